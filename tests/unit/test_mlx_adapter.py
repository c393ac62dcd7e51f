"""The installed mlx-lm against the places we set its internals.

`mlx_cache_server.mlx_adapter.batch_cache.batch_over` builds a `BatchKVCache` over buffers we
filled ourselves. If an mlx-lm release changes what its batch cache keeps, the
batch built here must stop passing for the one mlx-lm builds: these tests say so.
The engine's side batch starts `BatchGenerator`'s uid counter where the main
batch's uids never reach (`mlx_cache_server.engine.running.SIDE_UIDS`).
"""

from __future__ import annotations

from importlib.metadata import version

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_cache_server.mlx_adapter.batch_cache import batch_over, filled
from tests.fakes import kv_cache


def arrays_equal(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(np.array(a), np.array(b))


def test_the_installed_mlx_lm_is_the_release_line_this_adapter_was_checked_for():
    major, minor, *_ = version("mlx-lm").split(".")
    assert (int(major), int(minor)) == (0, 32), (
        "re-check mlx_cache_server/prompt_cache/mlx_lm_batch.py"
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


def test_a_generator_numbers_its_sequences_from_the_counter_the_side_batch_sets():
    from mlx_lm.generate import BatchGenerator

    from mlx_cache_server.engine.running import SIDE_UIDS

    # engine/running.py starts its side batch's counter at SIDE_UIDS, so that one dict
    # keyed by uid holds both batches' sequences.
    side = BatchGenerator(model=None)
    side._uid_count = SIDE_UIDS
    first = side.insert([[1, 2]], max_tokens=[3], caches=[[KVCache()]])
    second = side.insert([[4]], max_tokens=[3], caches=[[KVCache()]])
    assert first == [SIDE_UIDS] and second == [SIDE_UIDS + 1]
