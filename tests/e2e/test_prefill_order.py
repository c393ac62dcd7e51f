"""Prompts start prefilling shortest first, and a short one does not wait for a long prefill
(`app.engine.schedule`, carried out by the batch). Orders of events, not times."""

from __future__ import annotations

import threading
from typing import Any

from app.engine import Delta, Finished, SamplingParams, Started
from app.server import build_engine
from app.settings import Settings
from tests.helpers import ended, wait_until


class Log:
    """Every event of every request, in the order the engine sent them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def sink(self, name: str):
        def emit(event: Any) -> None:
            with self.lock:
                self.events.append((name, event))

        return emit

    def first(self, name: str, kind: type) -> int:
        return next(i for i, (n, e) in enumerate(self.events) if n == name and isinstance(e, kind))

    def ended(self, name: str) -> bool:
        return ended([e for n, e in self.events if n == name])


class Counting:
    """The model, recording each forward pass's (rows, tokens)."""

    def __init__(self, model: Any) -> None:
        self.model, self.shapes = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.shapes.append(tuple(inputs.shape))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def prompts(engine, long_tokens: int) -> tuple[list[int], list[list[int]]]:
    story = engine.tokenizer.encode("Tell me a long story about the sea. ")
    chats = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )
        for q in ("Name a colour.", "What is two plus two?", "Say hello.")
    ]
    return (story * 400)[:long_tokens], chats


def test_prompts_arriving_together_start_shortest_first(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    long, shorts = prompts(engine, 1500)
    engine.model = counting = Counting(engine.model)
    log = Log()
    params = SamplingParams(max_tokens=2, temperature=0)
    # Queued before the engine thread starts: one intake takes them all, the long one first.
    engine.submit(long, params, log.sink("long"))
    for i, p in enumerate(shorts):
        engine.submit(p, params, log.sink(f"short{i}"))
    engine.start()
    try:
        wait_until(lambda: all(log.ended(n) for n in ["long", "short0", "short1", "short2"]))
    finally:
        engine.stop()
    # The short ones were prefilled together, the long one after them, never padded
    # into a pass of theirs (nor they into its chunks).
    together = [(rows, width) for rows, width in counting.shapes if rows > 1 and width > 1]
    assert together and all(
        rows == 3 and width <= max(map(len, shorts)) for rows, width in together
    )
    for i in range(len(shorts)):
        assert log.first(f"short{i}", Delta) < log.first("long", Delta)
        assert log.first(f"short{i}", Started) < log.first("long", Started)


def test_a_short_prompt_starts_beside_a_long_prefill_and_answers_first(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    engine.prefill_step_size = 32  # a long prefill of many steps, nothing decoding beside it
    long, shorts = prompts(engine, 3000)
    engine.model = counting = Counting(engine.model)
    log = Log()
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.start()
    try:
        engine.submit(long, params, log.sink("long"))
        wait_until(lambda: len(counting.shapes) >= 3)  # the long prompt is prefilling
        engine.submit(shorts[0], params, log.sink("short"))
        wait_until(lambda: log.ended("long") and log.ended("short"))
    finally:
        engine.stop()
    assert log.first("short", Finished) < log.first("long", Delta)
    assert log.first("long", Started) < log.first("short", Started)
