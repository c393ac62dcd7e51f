"""A `BatchKVCache` over buffers we filled: the cache library's reach into its fill index.

mlx-lm builds a batch cache only by copying into a buffer of its own
(`BatchKVCache.merge`, or `update_and_fetch` on an empty one). To hand a batch
buffers built already (views of a lone cache's buffers, or segments written
straight into place: see `prompt_cache.joined`), `batch_over` sets what its update path
reads: `offset` (public) and `_idx`, how many slots of the buffer are filled
(private, with no public setter). Everything else goes through public methods.
tests/unit/test_mlx_adapter.py checks, against the installed mlx-lm, that a batch
built here is the batch mlx-lm builds; the pin in pyproject.toml (mlx-lm
>=0.32,<0.33) keeps that check meaningful.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


def batch_over(
    cls: type[BatchKVCache], padding: list[int], keys: mx.array, values: mx.array, length: int
) -> BatchKVCache:
    """A `cls` batch cache over `keys`/`values`, `length` slots (left padding included) filled."""
    batch = cls(padding)
    batch.keys, batch.values = keys, values
    batch.offset += length
    batch._idx = length
    return batch


def filled(batch: BatchKVCache) -> tuple[mx.array, mx.array]:
    """The filled part of a batch's buffers (views)."""
    return batch.keys_and_values()
