"""A model's storage mode, and cutting, joining and copying mlx-lm layer caches.

A prompt cache is mlx-lm's list of per-layer cache objects for one sequence
(batch size 1). Each layer's kind (`kinds.kind_of`) says how that layer can be
stored; together they choose the model's storage mode (`Layout`):

- Prefix sharing ("sliceable"): every layer is of a prefix kind (`KVCache`,
  `QuantizedKVCache`), so the KV of tokens [a, b) can be cut out and segments
  joined back.
- Checkpointed (hybrid models): prefix kinds beside sliding windows of one width
  and recurrent state. The KV layers are stored by prefix as above. The windows'
  KV is stored by token too, for the tokens a window still held when it was
  stored, and a window is rebuilt at token n from its last `max_size` tokens
  before n. Recurrent state cannot be cut: it is stored only as checkpoints, its
  whole state after a given token.
- Snapshot: anything else (a layer of kind "whole", such as `CacheList` or a
  chunked or quantized window, or windows of different widths). Only whole
  sequences can be stored and restored.

Here the mode is decided and the per-layer work handed to each layer's kind; a
segment (per layer, its arrays with tokens on axis 2) is cut further without one.

MLX arrays are immutable values, but an `mx.array` Python object is updated in
place by `a[...] = b` (which is how `KVCache.update_and_fetch` writes). So a
cache handed out always holds fresh array objects; stored arrays are never
given away, which is what keeps stored state safe from callers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import mlx.core as mx

from .kinds import Arrays, Kind, Role, Whole, kind_from_json, kind_of, kinds_json, own, views_of

# Per layer, the arrays of a token range, each with tokens on axis 2.
Segment = tuple[Arrays, ...]

Mode = Literal["prefix", "checkpointed", "snapshot"]


def _mode(kinds: tuple[Kind, ...]) -> Mode:
    """The storage mode layers of these kinds allow."""
    if all(k.role == "prefix" for k in kinds):
        return "prefix"
    # Windows of different widths would need their KV kept over different spans of tokens.
    widths = {k.max_size for k in kinds if k.role == "window"}
    if all(k.role != "whole" for k in kinds) and len(widths) <= 1:
        return "checkpointed"
    return "snapshot"


@dataclass(frozen=True)
class Layout:
    """What a model's caches look like: each layer's kind, and so the storage mode.

    A snapshot layout's kinds are all `Whole`: each layer is stored with its sequence, so
    two such layouts differ only where the layers' classes do. A checkpointed one has no
    `Whole` kind."""

    kinds: tuple[Kind, ...]

    @cached_property
    def sliceable(self) -> bool:
        """Whether every layer is stored by prefix (prefix-sharing mode)."""
        return _mode(self.kinds) == "prefix"

    @cached_property
    def checkpointed(self) -> bool:
        """Whether it is a hybrid model's (checkpointed mode)."""
        return _mode(self.kinds) == "checkpointed"

    @property
    def segmented(self) -> bool:
        """Whether the tree's edges hold KV segments (prefix sharing, or hybrid)."""
        return self.sliceable or self.checkpointed

    @cached_property
    def kv(self) -> tuple[int, ...]:
        """The layers stored by prefix."""
        return self._role("prefix")

    @cached_property
    def windows(self) -> tuple[int, ...]:
        """The sliding-window layers (checkpointed mode)."""
        return self._role("window")

    @cached_property
    def states(self) -> tuple[int, ...]:
        """The recurrent-state layers, stored only as checkpoints (checkpointed mode)."""
        return self._role("state")

    def _role(self, role: Role) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k.role == role)

    @cached_property
    def by_prefix(self) -> Layout:
        """The layers stored by prefix alone, as a prefix-sharing layout."""
        return self if self.sliceable else Layout(tuple(self.kinds[i] for i in self.kv))

    @cached_property
    def span(self) -> int:
        """Tokens before a resume point whose window KV rebuilds every window there."""
        return max((self.kinds[i].max_size for i in self.windows), default=0)

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
    """The layout of a cache to store, each layer checked storable as its mode stores it."""
    if not cache:
        raise ValueError("a prompt cache must have at least one layer")
    kinds = tuple(kind_of(c) for c in cache)
    if _mode(kinds) == "snapshot":
        return Layout(tuple(Whole(k.stored) for k in kinds))
    lengths = {k.length(c) for k, c in zip(kinds, cache, strict=True)} - {None}
    if len(lengths) > 1:
        raise ValueError("layers of one cache disagree on their token count")
    return Layout(kinds)


def mode_of(cache: list[Any]) -> Mode:
    """How a model's caches will be stored, from a fresh `make_prompt_cache` (empty layers):
    "prefix", "checkpointed" or "snapshot"."""
    return _mode(tuple(kind_of(c) for c in cache))


def layout_json(layout: Layout) -> str:
    """A sliceable layout as text, for the disk tier's files."""
    return kinds_json(layout.kinds)


def layout_from_json(text: str) -> Layout:
    return Layout(tuple(kind_from_json(item) for item in json.loads(text)))


def length(cache: list[Any]) -> int | None:
    """Tokens held by a sliceable or checkpointed cache (None: only recurrent state, which
    does not count them)."""
    return next((c.offset for c in cache if hasattr(c, "offset")), None)


def checkpoint(layout: Layout, cache: list[Any]) -> list[Any] | None:
    """Copies of the recurrent-state layers as they are (None: the layout has none)."""
    if not layout.states:
        return None
    out = [layout.kinds[i].checkpoint(cache[i]) for i in layout.states]
    _settle(arrays_in(out))
    return out


def window_held(layout: Layout, cache: list[Any]) -> int:
    """How many of the last tokens every window layer of `cache` still holds."""
    return min((layout.kinds[i].held(cache[i]) for i in layout.windows), default=0)


def window_segment(layout: Layout, cache: list[Any], start: int, end: int) -> Segment:
    """A copy of the window layers' KV of tokens [start, end), which they must still hold
    (`end` is the cache's length)."""
    out = tuple(layout.kinds[i].cut(cache[i], start, end) for i in layout.windows)
    _settle(out)
    return out


def rebuild_windows(layout: Layout, pieces: list[tuple[Segment, int, int]], n: int) -> list[Any]:
    """Fresh window layers at token `n`, from the window KV of the `min(n, layout.span)`
    tokens before it: (segment, from, to) ranges of stored window segments, in order."""
    return [layout.kinds[i].join([tuple(a[..., lo:hi, :] for a in seg[li])
                                  for seg, lo, hi in pieces], n)
            for li, i in enumerate(layout.windows)]  # fmt: skip


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
    joined = iter(assemble(layout.by_prefix, pieces) if kv else [])
    rebuilt = iter(rebuild_windows(layout, windows, n))
    restored = iter(clone(saved) if saved is not None else [])
    kinds = {**dict.fromkeys(kv, joined), **dict.fromkeys(layout.windows, rebuilt)}
    return [next(kinds.get(i, restored)) for i in range(len(layout.kinds))]


def kv_part(layout: Layout, cache: list[Any]) -> list[Any]:
    """The layers a layout stores by prefix (those of `layout.by_prefix`)."""
    return [cache[i] for i in layout.kv] if layout.checkpointed else cache


def _settle(arrays: Any) -> None:
    # Evaluated before they are stored, not just scheduled: another thread (a fetch, the disk
    # writer) may read a stored array at once, and several threads waiting on an evaluation
    # still in flight on another thread's stream crash MLX (a segfault, seen under load in
    # tests/e2e/test_concurrency.py). A stream runs in order, so the next step waits for
    # these copies either way.
    mx.eval(arrays)


def slice_segment(layout: Layout, cache: list[Any], start: int, end: int) -> Segment:
    """A copy of the KV of tokens [start, end) of a cache of a sliceable `layout`."""
    seg = tuple(kind.cut(c, start, end) for kind, c in zip(layout.kinds, cache, strict=True))
    _settle(seg)
    return seg


def cut_segment(seg: Segment, start: int, end: int | None = None) -> Segment:
    """A copy of tokens [start, end) of a segment."""
    out = tuple(tuple(own(a[..., start:end, :]) for a in layer) for layer in seg)
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
    return [kind.join([tuple(a[..., :take, :] for a in seg[li]) for seg, take in pieces], total)
            for li, kind in enumerate(layout.kinds)]  # fmt: skip


def snapshot(cache: list[Any]) -> list[Any]:
    """A stored copy of a whole cache: KV layers cut to their tokens, others as views."""
    out = [kind_of(c).snapshot(c) for c in cache]
    _settle(arrays_in(out))
    return out


def clone(snap: list[Any]) -> list[Any]:
    """A cache the caller owns, restored from a snapshot without copying buffers."""
    return [views_of(c) for c in snap]


def can_trim(cache: list[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim(cache: list[Any], n: int) -> None:
    for c in cache:
        c.trim(n)
