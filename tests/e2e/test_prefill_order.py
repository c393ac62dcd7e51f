"""Prompts start prefilling shortest first, and a short one does not wait for a long prefill
(`mlx_cache_server.engine.schedule`, carried out by the batch). Orders of events, not times."""

from __future__ import annotations

import threading
from typing import Any

from mlx_cache_server.engine import Delta, Finished, SamplingParams, Started
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
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


def queue_behind_a_prefill(engine, log: Log) -> None:
    """ "first" prefilling (a small prefill_step_size makes it take many steps), then
    "queued", longer, which waits in the batch's queue for it."""
    engine.submit(list(range(3, 90)) * 40, SamplingParams(max_tokens=2), log.sink("first"))
    wait_until(lambda: engine.running == 1)
    engine.submit(list(range(5, 90)) * 50, SamplingParams(max_tokens=2), log.sink("queued"))


def started(log: Log, name: str) -> Started:
    return next(e for n, e in log.events if n == name and isinstance(e, Started))


def test_prompts_sharing_a_long_prefix_wait_for_the_one_prefilling_it(tiny_model_dir):
    # Longer than a step, so they start one at a time: those queued behind the first
    # follow it and reuse its prefix instead of each prefilling it in turn.
    engine = build_engine(Settings(), str(tiny_model_dir))
    system = [(7 * i) % 80 + 5 for i in range(1500)]
    log = Log()
    for i in range(4):
        engine.submit(system + [10 + i] * (5 + i), SamplingParams(max_tokens=3), log.sink(i))
    engine.start()
    try:
        wait_until(lambda: all(log.ended(i) for i in range(4)))
    finally:
        engine.stop()
    assert sorted(started(log, i).cached_tokens for i in range(4)) == [0, 1500, 1500, 1500]


def test_a_prompt_prefilled_in_the_batch_is_cached_before_its_reply_ends(tiny_model_dir):
    engine = build_engine(Settings(), str(tiny_model_dir))
    system = [(7 * i) % 80 + 5 for i in range(1500)]
    no_end = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    log = Log()
    engine.start()
    try:
        engine.submit(system + [11, 12], SamplingParams(max_tokens=500, logit_bias=no_end),
                      log.sink("long"))  # fmt: skip
        wait_until(lambda: any(n == "long" and isinstance(e, Delta) for n, e in log.events))
        engine.submit(system + [21, 22, 23], SamplingParams(max_tokens=2), log.sink("next"))
        wait_until(lambda: log.ended("next"))
        assert not log.ended("long")  # still decoding: its prompt was cached when prefilled
    finally:
        engine.stop()
    assert started(log, "next").cached_tokens == 1500


def test_requests_taken_from_the_queue_are_answered_when_admitting_them_fails(
    tiny_model_dir, monkeypatch
):
    import mlx_cache_server.engine.entering as batch  # where the batch plans admissions

    engine = build_engine(Settings(prefill_step_size=16), str(tiny_model_dir))
    real, calls = batch.plan_admission, []

    def failing_once(new, prefilling, *args, **kwargs):
        # Admitting the queued request, once the first one no longer prefills.
        if not calls and not prefilling and len(new[0].tokens) == 85 * 50:
            calls.append(new)
            raise RuntimeError("planning failed (injected)")
        return real(new, prefilling, *args, **kwargs)

    monkeypatch.setattr(batch, "plan_admission", failing_once)
    log = Log()
    engine.start()
    try:
        # Longer than the one prefilling: it waits in the queue, then its admission fails.
        queue_behind_a_prefill(engine, log)
        wait_until(lambda: log.ended("first") and log.ended("queued"))
    finally:
        engine.stop()
    assert calls  # the failure was injected where meant
    assert any(n == "queued" and type(e).__name__ == "Failed" for n, e in log.events)


def test_a_request_waiting_for_its_turn_counts_as_waiting(tiny_model_dir):
    engine = build_engine(Settings(prefill_step_size=16, no_cache=True), str(tiny_model_dir))
    log = Log()
    engine.start()
    try:
        queue_behind_a_prefill(engine, log)
        # As /health and mlx_queue_depth report it: submitted, not yet running.
        wait_until(lambda: engine.waiting == 1 and engine.running == 1 or log.ended("first"))
        assert not log.ended("first")
        wait_until(lambda: log.ended("queued"))
    finally:
        engine.stop()
    assert engine.waiting == 0
