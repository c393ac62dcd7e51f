"""Cutting, joining and copying mlx-lm layer caches.

A prompt cache is mlx-lm's list of per-layer cache objects for one sequence
(batch size 1). Two storage modes follow from the layer types:

- Prefix sharing ("sliceable"): every layer is a `KVCache` or a
  `QuantizedKVCache`. Their state is a few arrays whose axis 2 is the token
  axis, so the KV of tokens [a, b) can be cut out and segments joined back.
- Checkpointed (hybrid models): `KVCache` layers beside sliding windows
  (`RotatingKVCache`, nothing kept at its start) and recurrent state
  (`ArraysCache` and its kin: linear attention, Mamba, convolutions). The KV
  layers are stored by prefix as above. The windows' KV is stored by token too,
  for the tokens a window still held when it was stored, and a window is rebuilt
  at token n from its last `max_size` tokens before n. Recurrent state cannot be
  cut: it is stored only as checkpoints, its whole state after a given token.
- Snapshot: anything else (`CacheList`, chunked or quantized windows, mixes of
  those). Only whole sequences can be stored and restored.

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
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from ..mlx_adapter.windows import window_in_order, window_over
from .joined import FreshKVCache, JoinedKVCache

# Per layer, the arrays of a token range, each with tokens on axis 2.
Segment = tuple[tuple[mx.array, ...], ...]

# By exact type: subclasses may hold more state than these arrays.
_SLICEABLE = (KVCache, QuantizedKVCache, JoinedKVCache, FreshKVCache)


@dataclass(frozen=True)
class Layout:
    """What a model's caches look like: the storage mode and each layer's kind.

    `checkpointed`: a hybrid model's; its KV layers' kinds are `(cls, group_size,
    bits)` as in a sliceable layout, a window's `(RotatingKVCache, max_size)`, a
    recurrent state's `(cls, number of arrays)`."""

    sliceable: bool
    kinds: tuple[tuple[Any, ...], ...]
    checkpointed: bool = False

    @property
    def segmented(self) -> bool:
        """Whether the tree's edges hold KV segments (prefix sharing, or hybrid)."""
        return self.sliceable or self.checkpointed

    @property
    def kv(self) -> tuple[int, ...]:
        """The layers stored by prefix."""
        return tuple(i for i, k in enumerate(self.kinds) if k[0] in _SLICEABLE)

    @property
    def windows(self) -> tuple[int, ...]:
        """The sliding-window layers (checkpointed mode)."""
        if not self.checkpointed:
            return ()
        return tuple(i for i, k in enumerate(self.kinds) if k[0] is RotatingKVCache)

    @property
    def states(self) -> tuple[int, ...]:
        """The recurrent-state layers, stored only as checkpoints (checkpointed mode)."""
        if not self.checkpointed:
            return ()
        return tuple(i for i in range(len(self.kinds)) if i not in (*self.kv, *self.windows))

    @property
    def span(self) -> int:
        """Tokens before a resume point whose window KV rebuilds every window there."""
        return max((self.kinds[i][1] for i in self.windows), default=0)

    def mode(self) -> str:
        """The storage mode in words, for the log and /v1/cache."""
        if self.sliceable:
            return "prefix sharing"
        if not self.checkpointed:
            return "whole-sequence snapshots"
        return (f"hybrid: {len(self.kv)} attention and {len(self.windows)} sliding-window "
                f"layers stored by token, {len(self.states)} recurrent-state layers "
                "checkpointed")  # fmt: skip


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
    if _hybrid(cache):
        return _checkpointed_layout(cache)
    return Layout(False, tuple((_kind(c),) for c in cache))


def mode_of(cache: list[Any]) -> str:
    """How a model's caches will be stored, from a fresh `make_prompt_cache` (empty layers):
    "prefix", "checkpointed" or "snapshot"."""
    if all(type(c) in _SLICEABLE for c in cache):
        return "prefix"
    return "checkpointed" if _hybrid(cache) else "snapshot"


def _hybrid(cache: list[Any]) -> bool:
    # Windows of different widths would need their KV kept over different spans of tokens.
    widths = {c.max_size for c in cache if type(c) is RotatingKVCache}
    return all(_checkpointable(c) for c in cache) and len(widths) <= 1


def _checkpointable(c: Any) -> bool:
    if type(c) in _SLICEABLE:
        return True
    if type(c) is RotatingKVCache:
        return c.keep == 0  # what `keep` holds at a window's start would need a copy of its own
    return isinstance(c, ArraysCache)


def _checkpointed_layout(cache: list[Any]) -> Layout:
    kinds: list[tuple[Any, ...]] = []
    offsets = set()
    for c in cache:
        if type(c) in _SLICEABLE or type(c) is RotatingKVCache:
            if c.keys is None:
                raise ValueError("cannot store an empty layer cache")
            if _arrays(c)[0].shape[0] != 1:
                raise ValueError("only batch-size-1 caches can be stored")
            offsets.add(c.offset)
        if type(c) is RotatingKVCache:
            kinds.append((RotatingKVCache, c.max_size))
        elif type(c) in _SLICEABLE:
            kinds.append((_kind(c), getattr(c, "group_size", None), getattr(c, "bits", None)))
        else:
            if c.batch_size != 1:
                raise ValueError("only batch-size-1 caches can be stored")
            kinds.append((type(c), len(c.cache)))
    if len(offsets) > 1:
        raise ValueError("layers of one cache disagree on their token count")
    return Layout(False, tuple(kinds), checkpointed=True)


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


def length(cache: list[Any]) -> int | None:
    """Tokens held by a sliceable or checkpointed cache (None: only recurrent state, which
    does not count them)."""
    return next((c.offset for c in cache if hasattr(c, "offset")), None)


def checkpoint(layout: Layout, cache: list[Any]) -> list[Any] | None:
    """Copies of the recurrent-state layers as they are (None: the layout has none)."""
    if not layout.states:
        return None
    out = [_fresh_views(cache[i]) for i in layout.states]
    _settle(arrays_in(out))
    return out


def window_held(layout: Layout, cache: list[Any]) -> int:
    """How many of the last tokens every window layer of `cache` still holds."""
    return min((window_in_order(cache[i], cache[i].keys).shape[2] for i in layout.windows),
               default=0)  # fmt: skip


def window_segment(layout: Layout, cache: list[Any], start: int, end: int) -> Segment:
    """A copy of the window layers' KV of tokens [start, end), which they must still hold
    (`end` is the cache's length)."""
    seg = []
    for i in layout.windows:
        c = cache[i]
        keys, values = window_in_order(c, c.keys), window_in_order(c, c.values)
        lo, hi = keys.shape[2] - (c.offset - start), keys.shape[2] - (c.offset - end)
        seg.append((_own(keys[..., lo:hi, :]), _own(values[..., lo:hi, :])))
    out = tuple(seg)
    _settle(out)
    return out


def rebuild_windows(layout: Layout, pieces: list[tuple[Segment, int, int]], n: int) -> list[Any]:
    """Fresh window layers at token `n`, from the window KV of the `min(n, layout.span)`
    tokens before it: (segment, from, to) ranges of stored window segments, in order."""
    out = []
    for li, i in enumerate(layout.windows):
        size = layout.kinds[i][1]
        keep = min(n, size)
        keys, values = (mx.concatenate([seg[li][a][..., lo:hi, :] for seg, lo, hi in pieces],
                                       axis=2)[..., -keep:, :]
                        for a in (0, 1))  # fmt: skip
        out.append(window_over(size, _own(keys), _own(values), n))
    return out


def assemble_checkpointed(
    layout: Layout,
    pieces: list[tuple[Segment, int]],
    windows: list[tuple[Segment, int, int]],
    saved: Any,
    n: int,
) -> list[Any]:
    """A fresh cache at token `n`: the KV layers joined from segments (as `assemble`), the
    windows rebuilt from `windows` (see `rebuild_windows`), the recurrent states restored
    from the checkpoint `saved`."""
    kv = layout.kv
    joined = iter(assemble(Layout(True, tuple(layout.kinds[i] for i in kv)), pieces) if kv else [])
    rebuilt = iter(rebuild_windows(layout, windows, n))
    restored = iter(clone(saved) if saved is not None else [])
    kinds = {**dict.fromkeys(kv, joined), **dict.fromkeys(layout.windows, rebuilt)}
    return [next(kinds.get(i, restored)) for i in range(len(layout.kinds))]


def kv_part(layout: Layout, cache: list[Any]) -> list[Any]:
    """The layers a layout stores by prefix."""
    return [cache[i] for i in layout.kv] if layout.checkpointed else cache


def _arrays(layer: Any) -> tuple[mx.array, ...]:
    if type(layer) is not QuantizedKVCache:
        return (layer.keys, layer.values)
    return (*layer.keys, *layer.values)


def _settle(arrays: Any) -> None:
    # Evaluated before they are stored, not just scheduled: another thread (a fetch, the disk
    # writer) may read a stored array at once, and several threads waiting on an evaluation
    # still in flight on another thread's stream crash MLX (a segfault, seen under load in
    # tests/e2e/test_concurrency.py). A stream runs in order, so the next step waits for
    # these copies either way.
    mx.eval(arrays)


def _own(a: mx.array) -> mx.array:
    # A slice shares its source's buffer; contiguous() copies it into one of
    # its own, so a stored range does not keep the whole source alive.
    return mx.contiguous(a)


def slice_segment(cache: list[Any], start: int, end: int) -> Segment:
    """A copy of the KV of tokens [start, end) of a sliceable cache."""
    seg = tuple(tuple(_own(a[..., start:end, :]) for a in _arrays(c)) for c in cache)
    _settle(seg)
    return seg


def cut_segment(seg: Segment, start: int, end: int | None = None) -> Segment:
    """A copy of tokens [start, end) of a segment."""
    out = tuple(tuple(_own(a[..., start:end, :]) for a in layer) for layer in seg)
    _settle(out)
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
    _settle(arrays_in(out))
    return out


def clone(snap: list[Any]) -> list[Any]:
    """A cache the caller owns, restored from a snapshot without copying buffers."""
    return [_fresh_views(c) for c in snap]


def can_trim(cache: list[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim(cache: list[Any], n: int) -> None:
    for c in cache:
        c.trim(n)
