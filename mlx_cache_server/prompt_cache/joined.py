"""`JoinedKVCache`: a KVCache assembled from stored segments, copied once, where it is used.

A fetch joins the segments of a path. Concatenating them right away would copy
every token, and mlx-lm's batching (`BatchKVCache.merge`) would then copy them
all again into its batch buffer. Here the join is left lazy (MLX evaluates on
use, so code that runs the cache directly pays one concatenation), and `merge`
writes each segment straight into the batch buffer: one copy either way.

A lone cache the caller has already run on (the server prefills a request on
its own before it joins the batch) is not copied at all: the batch takes views
of its buffers. And the batch hands a finished sequence's KV out as views of its
buffer instead of copies, since `PromptCache.insert` copies what it keeps
anyway. Each of these copies was one more sequence's KV at the peak of a request.
A prompt with nothing cached gets the same from `fresh_cache(model)`.

Invariant: `parts` describe the cache only while the caller has not changed it
(same `keys` object, same `offset`); otherwise `merge` reads `keys`/`values`.
MLX arrays are values: a view stays what it was when the batch later writes
into its buffer (MLX copies the buffer first if a view still holds it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from ..mlx_adapter.batch_cache import batch_over, filled


class JoinedKVCache(KVCache):
    def __init__(self, key_parts: list[mx.array], value_parts: list[mx.array]) -> None:
        super().__init__()
        self.parts = (key_parts, value_parts)
        self.keys = _join(key_parts)
        self.values = _join(value_parts)
        self.offset = sum(k.shape[2] for k in key_parts)
        self._joined = (self.keys, self.offset)

    def _untouched(self) -> bool:
        return self.keys is self._joined[0] and self.offset == self._joined[1]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # The joined buffer is exactly full, so `KVCache` would grow it by
        # concatenating it with free space: a second copy of every token. Join
        # the parts and the free space in one concatenation instead.
        if self._untouched():
            room = -(-(self.offset + keys.shape[2]) // self.step) * self.step - self.offset
            self.keys = _join([*self.parts[0], _free(self.parts[0][0], room)])
            self.values = _join([*self.parts[1], _free(self.parts[1][0], room)])
        return super().update_and_fetch(keys, values)

    @classmethod
    def merge(cls, caches: list[KVCache]) -> BatchKVCache:
        """What `BatchKVCache.merge` builds (left-padded), writing joined parts in place."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return ViewBatchKVCache([0] * len(caches))
        only = caches[0] if len(caches) == 1 else None
        if only is not None and not (isinstance(only, JoinedKVCache) and only._untouched()):
            return _batch([0], only.keys[...], only.values[...], longest)
        padding = [longest - n for n in lengths]
        first = next(c for c in caches if c.keys is not None)
        heads = max(c.keys.shape[1] for c in caches if c.keys is not None)
        keys = mx.zeros((len(caches), heads, longest, first.keys.shape[3]), first.keys.dtype)
        values = mx.zeros((len(caches), heads, longest, first.values.shape[3]), first.keys.dtype)
        for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            if isinstance(c, JoinedKVCache) and c._untouched():
                pieces = zip(*c.parts, strict=True)
            else:
                pieces = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]
            at = pad
            for k, v in pieces:
                n = k.shape[2]
                keys[i : i + 1, :, at : at + n] = k
                values[i : i + 1, :, at : at + n] = v
                at += n
        return _batch(padding, keys, values, longest)


def _batch(padding: list[int], keys: mx.array, values: mx.array, length: int) -> BatchKVCache:
    return batch_over(ViewBatchKVCache, padding, keys, values, length)


class FreshKVCache(KVCache):
    """A `KVCache` for a prompt with nothing cached, joining a batch as `JoinedKVCache` does.

    mlx-lm's own merge would copy it into the batch, and the batch copy it out again.
    """

    @classmethod
    def merge(cls, caches: list[KVCache]) -> BatchKVCache:
        return JoinedKVCache.merge(caches)


def fresh_cache(model: Any) -> list[Any]:
    """`make_prompt_cache(model)`, its plain KV layers as `FreshKVCache`s."""
    return [FreshKVCache() if type(c) is KVCache else c for c in make_prompt_cache(model)]


def as_fresh(cache: list[Any]) -> list[Any]:
    """`cache` with its plain KV layers as `FreshKVCache`s holding the same KV: a sequence
    taken out of a batch joins one again without a copy, as one from `fresh_cache` does."""
    return [_fresh(c) if type(c) is KVCache else c for c in cache]


def _fresh(c: KVCache) -> FreshKVCache:
    fresh = FreshKVCache()
    fresh.keys, fresh.values, fresh.offset = c.keys, c.values, c.offset
    return fresh


class ViewBatchKVCache(BatchKVCache):
    """mlx-lm's batch cache, handing a sequence's KV out as views of its buffer.

    `BatchKVCache.extract` copies, so that what mlx-lm's own server stores does not
    hold the batch's buffer; `PromptCache.insert` copies the tokens it keeps, so
    here the copy would only be one more sequence's KV at once.
    """

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        padding = self.left_padding.tolist()[idx]
        # The buffer's free slots come along (a `KVCache` holds `offset` tokens, whatever
        # its length): a sequence that goes on alone (`as_fresh`) writes its next tokens
        # there, in place once the batch has let go, instead of growing a copy.
        cache.keys = self.keys[idx : idx + 1, :, padding:]
        cache.values = self.values[idx : idx + 1, :, padding:]
        cache.offset = filled(self)[0].shape[2] - padding
        return cache


def _join(parts: list[mx.array]) -> mx.array:
    # A lone part is handed out as a view: a new array object the caller cannot
    # write through into the stored buffer.
    return parts[0][...] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _free(like: mx.array, n: int) -> mx.array:
    return mx.zeros((*like.shape[:2], n, like.shape[3]), like.dtype)
