"""A request's generation stops when its handler is cancelled (its client left).

The engine's events can be ready at the very moment the cancellation arrives; the
cancellation must still win, or a gone client's generation runs to its last token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mlx_cache_server.engine import Delta, Event, SamplingParams
from mlx_cache_server.serving.generation import RequestContext, collect, tracked
from mlx_cache_server.serving.limits import Slot
from mlx_cache_server.serving.metrics import Metrics


class ReadyEngine:
    """Events that are always ready, as a fast model's tokens are."""

    LENGTH = 20_000  # far more tokens than the trial's steps before its cancellation

    def __init__(self) -> None:
        self.in_flight = 0

    async def stream(self, tokens, params, namespace=None) -> AsyncIterator[Event]:
        for _ in range(self.LENGTH):
            await asyncio.sleep(0)  # the engine thread hands each token over
            yield Delta("")


async def cancel_after(steps: int, engine: ReadyEngine, metrics: Metrics) -> bool:
    """Whether a handler cancelled once, `steps` loop turns in, ended cancelled."""
    ctx = RequestContext("id", "/v1/chat/completions", "tiny", None)
    events = tracked(engine, [1], SamplingParams(max_tokens=10), ctx, 600.0, metrics, Slot(engine))
    task = asyncio.ensure_future(collect(events))
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait({task})  # a swallowed cancellation runs on to the last event
    return task.cancelled()


def test_a_cancelled_request_stops_even_when_its_next_event_is_ready():
    engine, metrics = ReadyEngine(), Metrics()

    trials = range(1, 40)

    async def run() -> list[bool]:
        return [await cancel_after(steps, engine, metrics) for steps in trials]

    ran_on = [steps for steps, ok in zip(trials, asyncio.run(run()), strict=True) if not ok]
    assert not ran_on, f"ran on past a cancellation at these steps: {ran_on}"
    assert engine.in_flight == 0  # every slot freed
