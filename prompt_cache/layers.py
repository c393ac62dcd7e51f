"""Cutting, joining and copying mlx-lm layer caches.

A prompt cache is mlx-lm's list of per-layer cache objects for one sequence
(batch size 1). Two storage modes follow from the layer types:

- Prefix sharing ("sliceable"): every layer is a `KVCache` or a
  `QuantizedKVCache`. Their state is a few arrays whose axis 2 is the token
  axis, so the KV of tokens [a, b) can be cut out and segments joined back.
- Snapshot: anything else (`RotatingKVCache` windows, `ArraysCache`/SSM state,
  `CacheList` hybrids, mixes). The state of token i depends on more than
  token i's own KV, so only whole sequences can be stored and restored.

MLX arrays are immutable values, but an `mx.array` Python object is updated in
place by `a[...] = b` (which is how `KVCache.update_and_fetch` writes). So a
cache handed out always holds fresh array objects; stored arrays are never
given away, which is what keeps stored state safe from callers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .joined import FreshKVCache, JoinedKVCache

# Per layer, the arrays of a token range, each with tokens on axis 2.
Segment = tuple[tuple[mx.array, ...], ...]

# By exact type: subclasses may hold more state than these arrays.
_SLICEABLE = (KVCache, QuantizedKVCache, JoinedKVCache, FreshKVCache)


@dataclass(frozen=True)
class Layout:
    """What a model's caches look like: the storage mode and each layer's kind."""

    sliceable: bool
    kinds: tuple[tuple[Any, ...], ...]


def layout_of(cache: list[Any]) -> Layout:
    if not cache:
        raise ValueError("a prompt cache must have at least one layer")
    if all(type(c) in _SLICEABLE for c in cache):
        kinds = []
        for c in cache:
            if c.keys is None:
                raise ValueError("cannot store an empty layer cache")
            if _arrays(c)[0].shape[0] != 1:
                raise ValueError("only batch-size-1 caches can be stored")
            kinds.append((_kind(c), getattr(c, "group_size", None), getattr(c, "bits", None)))
        if len({c.offset for c in cache}) != 1:
            raise ValueError("layers of one cache disagree on their token count")
        return Layout(True, tuple(kinds))
    return Layout(False, tuple((_kind(c),) for c in cache))


_KINDS = {cls.__name__: cls for cls in (KVCache, QuantizedKVCache)}


def layout_json(layout: Layout) -> str:
    """A sliceable layout as text, for the disk tier's files."""
    return json.dumps([[cls.__name__, group, bits] for cls, group, bits in layout.kinds])


def layout_from_json(text: str) -> Layout:
    kinds = tuple((_KINDS[name], group, bits) for name, group, bits in json.loads(text))
    return Layout(True, kinds)


def _kind(layer: Any) -> type:
    # Our KVCache subclasses only change how a cache joins a batch: same state.
    return KVCache if type(layer) in (JoinedKVCache, FreshKVCache) else type(layer)


def length(cache: list[Any]) -> int:
    """Tokens held by a sliceable cache."""
    return cache[0].offset


def _arrays(layer: Any) -> tuple[mx.array, ...]:
    if type(layer) is not QuantizedKVCache:
        return (layer.keys, layer.values)
    return (*layer.keys, *layer.values)


def _own(a: mx.array) -> mx.array:
    # A slice shares its source's buffer; contiguous() copies it into one of
    # its own, so a stored range does not keep the whole source alive.
    return mx.contiguous(a)


def slice_segment(cache: list[Any], start: int, end: int) -> Segment:
    """A copy of the KV of tokens [start, end) of a sliceable cache."""
    seg = tuple(tuple(_own(a[..., start:end, :]) for a in _arrays(c)) for c in cache)
    mx.async_eval(seg)
    return seg


def cut_segment(seg: Segment, start: int, end: int | None = None) -> Segment:
    """A copy of tokens [start, end) of a segment."""
    out = tuple(tuple(_own(a[..., start:end, :]) for a in layer) for layer in seg)
    mx.async_eval(out)
    return out


def arrays_in(tree: Any) -> list[mx.array]:
    """Every array in a segment, a cache state or a list of layer caches."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in arrays_in(item)]
    if isinstance(tree, dict):
        return [a for item in tree.values() for a in arrays_in(item)]
    if hasattr(tree, "state"):
        return arrays_in(tree.state)
    return []


def nbytes(tree: Any) -> int:
    """Bytes of all arrays in a segment or a list of layer caches."""
    return sum(a.nbytes for a in arrays_in(tree))


def assemble(layout: Layout, pieces: list[tuple[Segment, int]]) -> list[Any]:
    """A fresh cache holding the first `take` tokens of each segment, in order.

    Nothing is copied here: KV layers are `JoinedKVCache`s (copied once, where
    they are used), quantized ones lazy concatenations that MLX evaluates on use.
    """
    total = sum(take for _, take in pieces)
    cache = []
    for li, (cls, group_size, bits) in enumerate(layout.kinds):
        parts = [[seg[li][ai][..., :take, :] for seg, take in pieces]
                 for ai in range(len(pieces[0][0][li]))]  # fmt: skip
        if cls is KVCache:
            cache.append(JoinedKVCache(*parts))
            continue
        layer = QuantizedKVCache(group_size=group_size, bits=bits)
        arrays = [p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for p in parts]
        half = len(arrays) // 2
        layer.keys, layer.values = tuple(arrays[:half]), tuple(arrays[half:])
        layer.offset = total
        cache.append(layer)
    return cache


def _fresh_views(layer: Any) -> Any:
    state = tree_map(lambda a: a[...] if isinstance(a, mx.array) else a, layer.state)
    return type(layer).from_state(state)


def snapshot(cache: list[Any]) -> list[Any]:
    """A stored copy of a whole cache: KV layers cut to their tokens, others as views."""
    out = []
    for c in cache:
        if type(c) in _SLICEABLE and c.keys is not None:
            arrays = [_own(a[..., : c.offset, :]) for a in _arrays(c)]
            if type(c) is QuantizedKVCache:
                layer = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
                layer.keys, layer.values = tuple(arrays[:3]), tuple(arrays[3:])
            else:
                layer = KVCache()
                layer.keys, layer.values = arrays
            layer.offset = c.offset
            out.append(layer)
        else:
            out.append(_fresh_views(c))
    mx.async_eval(arrays_in(out))
    return out


def clone(snap: list[Any]) -> list[Any]:
    """A cache the caller owns, restored from a snapshot without copying buffers."""
    return [_fresh_views(c) for c in snap]


def can_trim(cache: list[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim(cache: list[Any], n: int) -> None:
    for c in cache:
        c.trim(n)
