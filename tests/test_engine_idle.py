"""The engine hands pooled memory back after a pause, not between back-to-back requests."""

from __future__ import annotations

import threading
import time

import app.engine as engine_module
from app.engine import Failed, Finished, SamplingParams
from app.server import build_engine
from app.settings import Settings


def finish(engine, prompt: list[int]) -> None:
    done = threading.Event()

    def emit(event) -> None:
        if isinstance(event, Finished | Failed):
            done.set()

    engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0), emit)
    assert done.wait(60)


def test_memory_is_released_once_idle(tiny_model_dir, monkeypatch):
    released: list[float] = []
    monkeypatch.setattr(engine_module, "_release_memory", lambda: released.append(1.0))
    engine = build_engine(Settings(), str(tiny_model_dir))
    engine.release_after = 1.0
    prompt = engine.tokenizer.encode("hello there, how are you?")
    engine.start()
    try:
        for _ in range(3):
            finish(engine, prompt)
        assert released == []  # the next request came at once: keep the buffers
        time.sleep(2.5)
        assert released == [1.0]  # one release per pause, not one per idle tick
        finish(engine, prompt)
        time.sleep(2.5)
        assert len(released) == 2
    finally:
        engine.stop()
