"""`MixedGenerator` steps as mlx-lm's `BatchGenerator` steps, fusing where it can."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator

import mlx_cache_server.engine.generator as generator
from mlx_cache_server.engine.generator import MixedGenerator

Record = tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]


def script(gen: BatchGenerator, vocab: int) -> list[Record]:
    """Two streams (one ending soon), then a prompt of two segments beside them, then a
    second prompt arriving while the first is prefilled; every step's responses."""

    def tokens(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(n)]

    records: list[Record] = []

    def step() -> None:
        gen.prefill_step_size = 16
        prompts, generated = gen.next()
        records.append((
            [(r.uid, r.progress, r.end_of_segment, r.end_of_prompt) for r in prompts],
            [(r.uid, r.token, r.finish_reason) for r in generated],
        ))  # fmt: skip

    gen.insert([tokens(1, 12), tokens(2, 9)], max_tokens=[200, 14])
    for _ in range(5):
        step()
    long = tokens(3, 150)
    gen.insert_segments([[long[:70], long[70:]]], max_tokens=[6])
    for _ in range(4):
        step()
    gen.insert([tokens(4, 40)], max_tokens=[6])
    for _ in range(25):
        step()
    return records


@pytest.mark.parametrize("completion_batch_size", [8, 2])
def test_steps_and_outputs_are_mlx_lms_own(tiny_model, monkeypatch, completion_batch_size):
    model, _ = tiny_model
    fused: list[list[tuple[int, ...]]] = []
    forward_together = generator.forward_together

    def recorded(model: Any, parts: Any, wanted: Any = None) -> Any:
        fused.append([tuple(t.shape) for t, _ in parts])
        return forward_together(model, parts, wanted)

    monkeypatch.setattr(generator, "forward_together", recorded)
    args = {"stop_tokens": [], "completion_batch_size": completion_batch_size,
            "prefill_batch_size": 2, "prefill_step_size": 64}  # fmt: skip
    vocab = model.args.vocab_size
    theirs = script(BatchGenerator(model, **args), vocab)
    ours = script(MixedGenerator(model, **args), vocab)
    # The same progress and the same tokens, step by step: the chunks predicted were the
    # chunks prefilled, prompts arriving, segments ending and streams ending included.
    assert ours == theirs
    assert any(finish == "length" for _, gen in theirs for _, _, finish in gen)
    if completion_batch_size == 8:
        assert len(fused) >= 5  # (a step beside a full batch prefills nothing: mlx-lm's own)
        assert all(parts[1][0] == 1 and 0 < parts[1][1] <= 16 for parts in fused)
    else:
        assert all(parts[0][0] < 2 for parts in fused)
