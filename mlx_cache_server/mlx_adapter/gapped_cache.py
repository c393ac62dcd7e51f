"""A batch's KV cache with gaps: positions in a row that no query attends to.

Streams verifying drafts together (`speculative`) each keep as many drafted tokens as
they accepted, but mlx-lm's `BatchKVCache` has one index for the whole batch: a row that
accepted fewer than the row that accepted most is left with the KV of its rejected tokens
between what it keeps and the next step's KV. Closing that up moves the row's whole KV
(as `BatchKVCache.finalize` does for right padding), on a CPU more than a step costs;
here those positions become gaps instead, which every mask this cache makes hides, and
the row's `offset` (where RoPE places its next token) counts only the tokens it holds.
When gaps make up a large share of the cache, `compact` closes them all in one copy.

Invariants: in each row, the positions in [left_padding, _idx) that are not gaps hold
the KV of exactly the row's tokens, in order, and `offset` is their number; positions
at or past `gaps.shape[1]` are not gaps; `extract` hands a row out without its gaps.
Only a running batch's caches get gaps: the caches that join it come from prompts.

In the adapter because it reads and sets `BatchKVCache`'s private fill index (`_idx`)
and turns a batch's cache into one in place (`of` changes its class).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

# Gaps are closed up once a row holds this share of gaps (and at least MIN_GAPS).
GAP_SHARE, MIN_GAPS = 0.25, 64


class GappedKVCache(BatchKVCache):
    gaps: mx.array | None = None  # (rows, n) bool: True where a position is a gap

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        self.gaps = None

    @classmethod
    def of(cls, cache: BatchKVCache) -> GappedKVCache:
        """`cache` itself, now able to hold gaps: its class changes in place, since the
        batch holds it."""
        if not isinstance(cache, cls):
            cache.__class__ = cls
            cache.gaps = None
        return cache

    def leave(self, rejected: list[int]) -> None:
        """Make each row's last `rejected[i]` positions gaps: KV of tokens it did not keep."""
        if not any(rejected):
            return
        n = mx.array(rejected)
        new = mx.arange(self._idx)[None] >= (self._idx - n)[:, None]
        self.gaps = new | self._gaps_to(self._idx)
        self.offset = self.offset - n.astype(self.offset.dtype)
        most = max(self.gaps.sum(axis=1).tolist())
        if most >= max(MIN_GAPS, GAP_SHARE * self._idx):
            self.compact()

    def compact(self) -> None:
        """Close every row's gaps up: its tokens' KV right-aligned at `_idx`, as a batch
        that never had gaps holds it."""
        if self.gaps is None or self.keys is None:
            self.gaps = None
            return
        held = ~np.array(self._gaps_to(self._idx))
        for row, padding in enumerate(self.left_padding.tolist()):
            held[row, :padding] = False
        counts = held.sum(axis=1)
        length = int(counts.max())
        where = np.zeros((len(counts), length), dtype=np.int32)  # padding reads position 0
        for row, count in enumerate(counts):
            where[row, length - count :] = np.nonzero(held[row])[0]
        take = mx.array(where)[:, None, :, None]
        b, h, _, _ = self.keys.shape
        self.keys = mx.take_along_axis(self.keys, mx.broadcast_to(take, (b, h, length, 1)), axis=2)
        self.values = mx.take_along_axis(
            self.values, mx.broadcast_to(take, (b, h, length, 1)), axis=2
        )
        self.left_padding = mx.array((length - counts).tolist())
        self._idx, self.gaps = length, None

    def _gaps_to(self, length: int) -> mx.array:
        """The gaps as a (rows, length) mask: cut, or padded with positions that are not."""
        rows = self.left_padding.shape[0]
        if self.gaps is None:
            return mx.zeros((rows, length), dtype=mx.bool_)
        have = self.gaps.shape[1]
        if have >= length:
            return self.gaps[:, :length]
        return mx.concatenate([self.gaps, mx.zeros((rows, length - have), dtype=mx.bool_)], 1)

    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> mx.array:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.gaps is None:
            return mask
        return mask & ~self._gaps_to(self._idx + N)[:, None, None, :]

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        if self.gaps is not None and self.gaps.shape[1] > self._idx - n:
            cut = self.gaps[:, self._idx - n :]  # gaps trimmed off were not in `offset`
            self.offset = self.offset + cut.sum(axis=1).astype(self.offset.dtype)
            self.gaps = self.gaps[:, : self._idx - n]
        return super().trim(n)

    def filter(self, batch_indices: list[int]) -> None:
        gaps = None if self.gaps is None else self.gaps[mx.array(batch_indices, mx.int32)]
        before = self._idx
        super().filter(batch_indices)  # may drop leading padding every row has
        self.gaps = None if gaps is None or not batch_indices else gaps[:, before - self._idx :]

    def extend(self, other: BatchKVCache) -> None:
        if self.gaps is None and getattr(other, "gaps", None) is None:
            return super().extend(other)
        mine, theirs = _gaps_of(self), _gaps_of(other)
        longest = max(self._idx, other._idx)
        super().extend(other)  # both right-aligned at the longer index

        def aligned(gaps: mx.array) -> mx.array:
            pad = mx.zeros((gaps.shape[0], longest - gaps.shape[1]), dtype=mx.bool_)
            return mx.concatenate([pad, gaps], axis=1)

        self.gaps = mx.concatenate([aligned(mine), aligned(theirs)], axis=0)

    def extract(self, idx: int) -> KVCache:
        cache = super().extract(idx)
        if self.gaps is None:
            return cache
        padding = self.left_padding.tolist()[idx]
        row = np.array(self._gaps_to(self._idx)[idx, padding:])
        if not row.any():
            return cache
        held = mx.array(np.nonzero(~row)[0].astype(np.int32))
        cache.keys = mx.contiguous(cache.keys[:, :, held])
        cache.values = mx.contiguous(cache.values[:, :, held])
        cache.offset = cache.keys.shape[2]
        return cache


def _gaps_of(cache: BatchKVCache) -> mx.array:
    """A batch cache's gaps up to its index, none for a cache that cannot hold them."""
    if isinstance(cache, GappedKVCache):
        return cache._gaps_to(cache._idx)
    return mx.zeros((cache.left_padding.shape[0], cache._idx), dtype=mx.bool_)
