"""Rotating windows (mlx-lm's `RotatingKVCache`, `BatchRotatingKVCache`) in token order.

A rotating layer writes its window as a ring: once full, a token's KV overwrites the
oldest one's, so the buffer's order is not the tokens'. mlx-lm puts it back in order with
a private method (`_temporal_order`), and keeps where the ring is written next in a
private fill index (`_idx`): these functions are all that touch them.

mlx-lm 0.32's `BatchRotatingKVCache.make_mask` for a chunk of several tokens reads the
window's fill index before the update puts a rotated window back in order: after a step
in which every prompt took one token (a hybrid model's prompt cut at its checkpoints can
make one), a padded prompt's mask is off by one and its tokens wrong. No upstream issue or
pull request reports it that we found (searched ml-explore/mlx-lm's issues, pull requests
and code); https://github.com/ml-explore/mlx-lm/pull/738 ("Fix sliding window batching")
fixed other cases in the same cache, not this one. A step of ours puts the
prompt batch's windows in order before it prefills several tokens (`in_order`), as the
update would, which makes the mask right; tests/unit/test_mlx_adapter.py reproduces the
defect and fails once a release fixes it, when the correction can go.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache


def in_order(caches: list[Any]) -> None:
    """Put every rotated batch window of `caches` in token order, in place (what their
    next multi-token update does first); other layers are left as they are."""
    for cache in caches:
        if isinstance(cache, BatchRotatingKVCache):
            cache._temporal_order()


def window_in_order(layer: Any, buffer: mx.array) -> mx.array:
    """A lone rotating layer's `buffer` (its keys or values) in token order, the tokens it
    holds only; the layer itself is not changed."""
    return layer._temporal_order(buffer)


def window_over(size: int, keys: mx.array, values: mx.array, offset: int) -> RotatingKVCache:
    """A lone rotating layer of `size` at token `offset`, holding `keys`/`values` (the KV
    of its last tokens, in order, at most `size`) as its buffers, filled to their end:
    mlx-lm sets the fill index (`_idx`) only through its own updates."""
    layer = RotatingKVCache(size)
    layer.keys, layer.values = keys, values
    layer.offset, layer._idx = offset, keys.shape[2]
    return layer
