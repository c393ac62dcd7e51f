"""Waiting on the engine and the server without sleeping longer than needed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mlx_cache_server.engine import Failed, Finished

# A tool's parameters that bound every value, so a forced call always ends: as each API
# (chat tools, Anthropic's input_schema, Responses' function tools) wraps it.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def greedy_alone(model: Any, prompt: list[int], k: int = 5) -> list[int]:
    """k greedy tokens after `prompt`, the model alone over a fresh cache: what a batch
    must give each of its sequences."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, out = make_prompt_cache(model), []
    logits = model(mx.array(prompt)[None], cache=cache)
    for _ in range(k):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([out[-1:]]), cache=cache)
    return out


def wait_until(condition: Callable[[], Any], seconds: float = 60) -> None:
    """Poll `condition` until it holds; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def ended(sink: list[Any]) -> bool:
    """Whether a request's collected events include its last one."""
    return any(isinstance(e, Finished | Failed) for e in sink)


class FakeClock:
    """A clock the test moves by hand, for the engine's idle timing."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
