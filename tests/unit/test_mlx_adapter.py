"""Contract tests of the seam (`mlx_cache_server/mlx_adapter/`) against the installed mlx-lm.

Each names a private attribute or behaviour of mlx-lm's the adapter relies on: the names
it reads, the steps it copies (pinned by their source), the batch cache it builds over
our buffers, the step it writes (the same tokens as mlx-lm's own), and the mask defect it
corrects (reproduced, so the test fails once a release fixes it). A new mlx-lm release
that breaks the adapter fails here first, naming what to port.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import random
from importlib.metadata import version
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

from mlx_cache_server.mlx_adapter import hub, streams, windows
from mlx_cache_server.mlx_adapter.batch_cache import batch_over, filled
from mlx_cache_server.mlx_adapter.stepping import StepGenerator
from tests.fakes import kv_cache
from tests.helpers import greedy_alone
from tests.unit.test_mixed_generator import script


def arrays_equal(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(np.array(a), np.array(b))


def test_the_installed_mlx_lm_is_the_release_line_this_adapter_was_checked_for():
    major, minor, *_ = version("mlx-lm").split(".")
    assert (int(major), int(minor)) == (0, 32), (
        "re-check mlx_cache_server/mlx_adapter/batch_cache.py"
    )


def test_a_batch_built_over_our_buffers_is_the_batch_mlx_lm_builds():
    layers = [kv_cache([1, 2, 3, 4, 5])[0], kv_cache([6, 7])[0]]
    theirs = BatchKVCache.merge(layers)
    longest = max(c.offset for c in layers)
    padding = [longest - c.offset for c in layers]
    keys, values = mx.zeros_like(theirs.keys), mx.zeros_like(theirs.values)
    for i, (pad, c) in enumerate(zip(padding, layers, strict=True)):
        keys[i : i + 1, :, pad:longest] = c.keys[..., : c.offset, :]
        values[i : i + 1, :, pad:longest] = c.values[..., : c.offset, :]
    ours = batch_over(BatchKVCache, padding, keys, values, longest)
    for got, want in zip(filled(ours), filled(theirs), strict=True):
        assert arrays_equal(got, want)
    assert arrays_equal(ours.offset, theirs.offset)
    assert arrays_equal(ours.left_padding, theirs.left_padding)
    # Both go on the same way: one decode step, then each sequence taken out.
    step_k, step_v = mx.full((2, 2, 1, 4), 3.0), mx.full((2, 2, 1, 4), -3.0)
    for got, want in zip(
        ours.update_and_fetch(step_k, step_v), theirs.update_and_fetch(step_k, step_v), strict=True
    ):
        assert arrays_equal(got, want)
    assert arrays_equal(ours.make_mask(1), theirs.make_mask(1))
    for i in range(2):
        got, want = ours.extract(i), theirs.extract(i)
        assert isinstance(got, KVCache) and got.offset == want.offset
        assert arrays_equal(got.keys[..., : got.offset, :], want.keys[..., : want.offset, :])


# ------------------------------------------------------------ the private names relied on


def test_the_private_names_the_adapter_reads_are_there(tiny_model):
    import mlx_lm.utils

    model, _ = tiny_model
    gen = BatchGenerator(model, max_tokens=2)
    for name in ("_generation_batch", "_prompt_batch", "_unprocessed_sequences",
                 "_currently_processing", "_uid_count", "_counters"):  # fmt: skip
        assert hasattr(gen, name), f"BatchGenerator.{name}: stepping.py reads it"
    assert callable(gen._make_batch) and callable(gen._next)
    gen.insert([[1, 2, 3]])
    while not len(gen._generation_batch):
        gen.next()
    batch = gen._generation_batch
    for name in ("_next_tokens", "_next_logprobs", "_num_tokens", "_matchers",
                 "_current_tokens", "_current_logprobs", "_token_context"):  # fmt: skip
        assert hasattr(batch, name), f"GenerationBatch.{name}: streams.py reads it"
    gen.close()
    for cls in (RotatingKVCache, BatchRotatingKVCache):
        assert callable(cls._temporal_order), f"{cls.__name__}._temporal_order: windows.py"
    assert hasattr(RotatingKVCache(4), "_idx") and hasattr(BatchKVCache([0]), "_idx")
    assert list(inspect.signature(mlx_lm.utils._download).parameters)[0] == "path_or_hf_repo"
    assert hub.download.__module__ == "mlx_cache_server.mlx_adapter.hub"
    assert callable(streams.GENERATE.mx.logsumexp)


# The mlx-lm code the adapter copies, by the hash of its source: a release that changes
# one fails here, and the copy is compared with the new code, updated, and re-hashed.
COPIED = {
    "BatchGenerator._next (stepping.StepGenerator.step)": (
        BatchGenerator._next, "eb3a4e361dc2c19e"),
    "GenerationBatch._step (streams._step)": (GenerationBatch._step, "d7513c5031029194"),
    "GenerationBatch.next (streams.decode_through)": (GenerationBatch.next, "5d2a3d229fba02a9"),
    "BatchRotatingKVCache.make_mask (windows: the defect)": (
        BatchRotatingKVCache.make_mask, "ee6af6b6a2675bfd"),
}  # fmt: skip


@pytest.mark.parametrize("copied", sorted(COPIED))
def test_the_mlx_lm_code_the_adapter_copies_is_the_code_it_copied(copied):
    function, digest = COPIED[copied]
    source = inspect.getsource(function).encode()
    assert hashlib.sha256(source).hexdigest()[:16] == digest, f"{copied} changed: port it"


# ------------------------------------------------------------------- the step we own


def test_our_step_is_mlx_lms_step(tiny_model):
    model, _ = tiny_model
    args = {"stop_tokens": [], "completion_batch_size": 8, "prefill_batch_size": 2,
            "prefill_step_size": 64}  # fmt: skip
    vocab = model.args.vocab_size
    assert script(StepGenerator(model, **args), vocab) == script(
        BatchGenerator(model, **args), vocab
    )


class ThroughModel(StepGenerator):
    """The streams decoded by `decode_through` with their own model: mlx-lm's step."""

    def decode(self, streams_: GenerationBatch) -> list[Any]:
        return streams.decode_through(streams_, streams_.model)


def test_a_decode_through_the_model_is_the_batchs_own_step(tiny_model):
    model, _ = tiny_model
    vocab = model.args.vocab_size
    args = {"stop_tokens": [[5]], "completion_batch_size": 8, "prefill_step_size": 16}

    def biased(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits + mx.arange(logits.shape[-1]) * 0.01  # a logits processor

    def run(gen: BatchGenerator) -> list[tuple[Any, ...]]:
        prompts = [[(i * 31 + j * 7) % (vocab - 1) + 1 for j in range(5 + i)] for i in range(3)]
        gen.insert(prompts, max_tokens=[9, 3, 12], logits_processors=[[biased], [], []])
        out = []
        while (step := gen.next()) != ([], []):
            out += [(r.uid, r.token, r.finish_reason, r.all_tokens) for r in step[1]]
            out += [float(r.logprobs[r.token]) for r in step[1]]
        gen.close()
        return out

    assert run(ThroughModel(model, **args)) == run(BatchGenerator(model, **args))


def test_a_generator_numbers_its_sequences_from_its_first_uid():
    from mlx_cache_server.engine.running import SIDE_UIDS

    # engine/running.py starts its side batch's uids at SIDE_UIDS, so that one dict keyed
    # by uid holds both batches' sequences.
    side = StepGenerator(model=None, first_uid=SIDE_UIDS)
    first = side.insert([[1, 2]], max_tokens=[3], caches=[[KVCache()]])
    second = side.insert([[4]], max_tokens=[3], caches=[[KVCache()]])
    assert first == [SIDE_UIDS] and second == [SIDE_UIDS + 1]


def test_the_views_show_the_state_a_step_plans_from(tiny_model):
    model, _ = tiny_model
    gen = StepGenerator(model, prefill_step_size=4, prefill_batch_size=1)
    gen.insert_segments([[[1, 2, 3, 4, 5, 6], [7, 8]], [[9, 10]]])
    assert gen.waiting == 2 and gen.prefilling == [] and len(gen.streams) == 0
    gen.next()
    assert gen.waiting == 1 and len(gen.prompt_batch) == 1
    assert gen.prefilling == [[[5, 6], [7], [8]]]  # the last token is a segment of its own
    gen.close()


# ------------------------------------------------------- the window mask mlx-lm gets wrong


def rotated_padded_window() -> BatchRotatingKVCache:
    """A batch window of 8 whose first row is padded by 2: filled by a chunk, then rotated
    by a step in which every row took one token."""
    cache = BatchRotatingKVCache(8, left_padding=[2, 0])
    for n in (8, 1):
        kv = mx.ones((2, 1, n, 2))
        cache.update_and_fetch(kv, kv)
    return cache


def test_mlx_lms_mask_after_a_rotation_is_still_off_by_one():
    """mlx-lm 0.32's defect that `windows.in_order` corrects (see windows.py): when this
    fails, a release fixed it, and `StepGenerator.prefill` need not put windows in order."""
    cache = rotated_padded_window()
    assert cache.rotated
    ordered = copy.deepcopy(cache)
    windows.in_order([ordered])
    theirs, ours = np.array(cache.make_mask(3)), np.array(ordered.make_mask(3))
    assert theirs.shape == ours.shape and (theirs != ours).any()
    # What the update does (it orders the window first) is what the ordered mask says:
    # the padded row's pad slots, one fewer after the window's oldest token is dropped.
    kv = mx.ones((2, 1, 3, 2))
    cache.update_and_fetch(kv, kv)
    assert cache.left_padding.tolist()[0] == ordered.left_padding.tolist()[0] - 1


def test_our_step_gives_a_batch_of_windows_the_tokens_of_a_lone_run(tmp_path):
    """A prompt cut into one-token segments beside a padded one, on a model with sliding
    windows: mlx-lm's own step gives the padded prompt wrong tokens, ours the lone run's."""
    from mlx_lm import load

    from tests.hybrid_models import build_hybrid_model

    model, _ = load(str(build_hybrid_model(tmp_path / "gemma3_text", "gemma3_text")))

    def alone(prompt: list[int], k: int = 5) -> list[int]:
        return greedy_alone(model, prompt, k)

    rng = random.Random(5)
    b, c = [rng.randint(1, 40) for _ in range(37)], [rng.randint(1, 40) for _ in range(3)]

    def run(gen: BatchGenerator) -> list[list[int]]:
        first = gen.insert_segments([[b[:16], b[16:17], b[17:24], b[24:36], b[36:]]], [5])
        gen.next()
        second = gen.insert_segments([[c[:1], c[1:2], c[2:]]], [5])
        got: dict[int, list[int]] = {first[0]: [], second[0]: []}
        while (step := gen.next()) != ([], []):
            for r in step[1]:
                got[r.uid].append(r.token)
        gen.close()
        return [got[first[0]], got[second[0]]]

    want = [alone(b), alone(c)]
    assert run(StepGenerator(model, max_tokens=5, prefill_step_size=16)) == want
    assert run(BatchGenerator(model, max_tokens=5, prefill_step_size=16))[1] != want[1]


# ------------------------------------------------------------------ windows rebuilt


def test_a_window_rebuilt_over_its_tokens_goes_on_as_mlx_lms():
    theirs = RotatingKVCache(8)
    for n in (11, 1, 1, 1):
        kv = mx.arange(n * 2, dtype=mx.float32).reshape(1, 1, n, 2) + theirs.offset * 10
        theirs.update_and_fetch(kv, kv)
    held = windows.window_in_order(theirs, theirs.keys)
    assert held.shape[2] == 8  # the window's tokens only, oldest first
    ours = windows.window_over(8, held, windows.window_in_order(theirs, theirs.values),
                               theirs.offset)  # fmt: skip
    for _ in range(3):
        kv = mx.full((1, 1, 1, 2), float(theirs.offset))
        theirs.update_and_fetch(kv, kv)
        ours.update_and_fetch(kv, kv)
        assert np.array_equal(np.array(windows.window_in_order(ours, ours.keys)),
                              np.array(windows.window_in_order(theirs, theirs.keys)))  # fmt: skip
        assert ours.offset == theirs.offset
