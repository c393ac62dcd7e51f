"""What each kind of mlx-lm layer cache is to the prompt cache, answered by the kind.

A prompt cache is mlx-lm's list of per-layer cache objects for one sequence (batch
size 1). `kind_of(layer)` is the one place that maps a layer's class to its kind; the
kind then says how the layer is stored, by its `role`:

- "prefix" (`FullKV`, `QuantizedKV`): a few arrays whose axis 2 is the token axis. The
  KV of tokens [a, b) is `cut` out as a segment, and segments are `join`ed back into a
  fresh layer, so a shared prefix is stored once.
- "window" (`Window`: a sliding window, nothing kept at its start). Its KV is `cut` by
  token too, from the tokens it still holds (`held`), and the layer is rebuilt at token
  n by `join`ing the KV of the last `max_size` tokens before n.
- "state" (`Recurrent`: linear attention, Mamba, convolutions). Its state cannot be cut:
  it is stored only as a `checkpoint`, the whole state after a given token.
- "whole" (`Whole`: anything else, such as `CacheList`, chunked KV, a quantized window
  or one that keeps tokens at its start). Stored only with the whole sequence.

Every kind answers `Kind` (`snapshot`: a stored copy of the whole layer; `stored`: the
mlx-lm class of that copy); those stored by token answer `ByToken` as well.

Invariants:
- Kinds are values: two layers of one class and parameters have equal kinds, which is
  how a model's layers are compared between inserts.
- Classes map by exact type, but recurrent state, which maps with its subclasses:
  a subclass of a KV cache may hold more state than the arrays cut here.
- A segment's arrays (`Arrays`, per layer) have tokens on axis 2, whatever the kind, so
  cutting a stored segment further needs no kind (`layers.cut_segment`).
- What `cut`, `checkpoint` and `snapshot` return holds fresh copies or views, never the
  caller's array objects (see `layers`); they are not evaluated yet.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from ..mlx_adapter.windows import window_in_order, window_over
from .joined import FreshKVCache, JoinedKVCache

Role = Literal["prefix", "window", "state", "whole"]

# One layer's part of a segment: its arrays, each with tokens on axis 2.
Arrays = tuple[mx.array, ...]


class Kind(Protocol):
    """What every kind answers; each role adds its own (see the module docstring)."""

    role: ClassVar[Role]

    @property
    def stored(self) -> type: ...

    def snapshot(self, layer: Any) -> Any: ...


class ByToken(Kind, Protocol):
    """What a kind stored by token answers (roles "prefix" and "window")."""

    def length(self, layer: Any) -> int:
        """The tokens it holds, checked storable by token (ValueError saying why not)."""
        ...

    def cut(self, layer: Any, start: int, end: int) -> Arrays:
        """A copy of its KV of tokens [start, end)."""
        ...

    def join(self, parts: list[Arrays], n: int) -> Any:
        """A fresh layer at token `n` from the parts of segments before it, in order."""
        ...


# ------------------------------------------------------------------- prefix kinds


@dataclass(frozen=True)
class FullKV:
    """A plain `KVCache` (or ours, which only join a batch differently): keys and values."""

    role: ClassVar[Role] = "prefix"
    width: ClassVar[int] = 2  # arrays of a layer in a segment

    @property
    def stored(self) -> type:
        return KVCache

    def arrays(self, layer: Any) -> Arrays:
        """What a segment of it holds: its arrays, tokens on axis 2."""
        return (layer.keys, layer.values)

    def length(self, layer: Any) -> int:
        """The tokens it holds, checked storable by token."""
        return _checked_length(layer, self.arrays)

    def cut(self, layer: Any, start: int, end: int) -> Arrays:
        """A copy of the KV of tokens [start, end)."""
        return tuple(own(a[..., start:end, :]) for a in self.arrays(layer))

    def join(self, parts: list[Arrays], n: int) -> Any:
        """A fresh layer of tokens [0, n), from segments' parts in order; copied where used."""
        return JoinedKVCache([p[0] for p in parts], [p[1] for p in parts])

    def snapshot(self, layer: Any) -> Any:
        if layer.keys is None:
            return views_of(layer)
        out = KVCache()
        out.keys, out.values = self.cut(layer, 0, layer.offset)
        out.offset = layer.offset
        return out

    def as_json(self) -> list[Any]:
        return ["KVCache", None, None]


@dataclass(frozen=True)
class QuantizedKV:
    """A `QuantizedKVCache`: keys and values as (data, scales, biases) each."""

    group_size: int
    bits: int
    role: ClassVar[Role] = "prefix"
    width: ClassVar[int] = 6

    @property
    def stored(self) -> type:
        return QuantizedKVCache

    def arrays(self, layer: Any) -> Arrays:
        return (*layer.keys, *layer.values)

    def length(self, layer: Any) -> int:
        return _checked_length(layer, self.arrays)

    def cut(self, layer: Any, start: int, end: int) -> Arrays:
        return tuple(own(a[..., start:end, :]) for a in self.arrays(layer))

    def join(self, parts: list[Arrays], n: int) -> Any:
        """A fresh layer of tokens [0, n): a lazy concatenation, which MLX evaluates on use."""
        columns = zip(*parts, strict=True)  # each array's parts, in token order
        arrays = [c[0] if len(c) == 1 else mx.concatenate(list(c), axis=2) for c in columns]
        layer = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        half = len(arrays) // 2
        layer.keys, layer.values = tuple(arrays[:half]), tuple(arrays[half:])
        layer.offset = n
        return layer

    def snapshot(self, layer: Any) -> Any:
        if layer.keys is None:
            return views_of(layer)
        arrays = self.cut(layer, 0, layer.offset)
        out = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        out.keys, out.values = tuple(arrays[:3]), tuple(arrays[3:])
        out.offset = layer.offset
        return out

    def as_json(self) -> list[Any]:
        return ["QuantizedKVCache", self.group_size, self.bits]


_PREFIX_BY_NAME: dict[str, type[FullKV] | type[QuantizedKV]] = {
    "KVCache": FullKV,
    "QuantizedKVCache": QuantizedKV,
}


def kind_from_json(item: list[Any]) -> FullKV | QuantizedKV:
    """A prefix kind from `as_json`'s form (the disk tier's files)."""
    name, group_size, bits = item
    return FullKV() if _PREFIX_BY_NAME[name] is FullKV else QuantizedKV(group_size, bits)


def width_of(name: str) -> int:
    """Arrays of a layer in a segment of the prefix kind `name` (as in `as_json`; 0: none)."""
    cls = _PREFIX_BY_NAME.get(name)
    return cls.width if cls is not None else 0


def kinds_json(kinds: tuple[Any, ...]) -> str:
    """Prefix kinds as text, for the disk tier's files."""
    return json.dumps([k.as_json() for k in kinds])


# ------------------------------------------------------------ window, state, whole


@dataclass(frozen=True)
class Window:
    """A `RotatingKVCache` that keeps nothing at its start: the last `max_size` tokens."""

    max_size: int
    role: ClassVar[Role] = "window"

    @property
    def stored(self) -> type:
        return RotatingKVCache

    def length(self, layer: Any) -> int:
        return _checked_length(layer, lambda c: (c.keys, c.values))

    def held(self, c: Any) -> int:
        """How many of the last tokens it still holds."""
        return window_in_order(c, c.keys).shape[2]

    def cut(self, c: Any, start: int, end: int) -> Arrays:
        """A copy of the KV of tokens [start, end), which it must still hold (`end` is its
        length)."""
        keys, values = window_in_order(c, c.keys), window_in_order(c, c.values)
        lo, hi = keys.shape[2] - (c.offset - start), keys.shape[2] - (c.offset - end)
        return own(keys[..., lo:hi, :]), own(values[..., lo:hi, :])

    def join(self, parts: list[Arrays], n: int) -> Any:
        """A fresh window at token `n`, from the KV of the `min(n, max_size)` (or more)
        tokens before it, in order."""
        keep = min(n, self.max_size)
        keys, values = (mx.concatenate([p[a] for p in parts], axis=2)[..., -keep:, :]
                        for a in (0, 1))  # fmt: skip
        return window_over(self.max_size, own(keys), own(values), n)

    def snapshot(self, layer: Any) -> Any:
        return views_of(layer)


@dataclass(frozen=True)
class Recurrent:
    """`ArraysCache` or a subclass: a state that depends on every token before, in order."""

    cls: type
    arrays: int
    role: ClassVar[Role] = "state"

    @property
    def stored(self) -> type:
        return self.cls

    def length(self, layer: Any) -> None:
        """Nothing: it does not count tokens (checked storable all the same)."""
        if layer.batch_size != 1:
            raise ValueError("only batch-size-1 caches can be stored")
        return None

    def checkpoint(self, layer: Any) -> Any:
        """A copy of its whole state as it is."""
        return views_of(layer)

    def snapshot(self, layer: Any) -> Any:
        return views_of(layer)


@dataclass(frozen=True)
class Whole:
    """A layer stored only with its whole sequence: `cls` is its class (or the class a
    stored copy of it is)."""

    cls: type
    role: ClassVar[Role] = "whole"

    @property
    def stored(self) -> type:
        return self.cls

    def snapshot(self, layer: Any) -> Any:
        return views_of(layer)


# ------------------------------------------------------------------------ mapping


def _window(layer: Any) -> Window | Whole:
    # What `keep` holds at a window's start would need a copy of its own.
    return Window(layer.max_size) if layer.keep == 0 else Whole(RotatingKVCache)


_FULL_KV = FullKV()
_BY_TYPE: dict[type, Callable[[Any], Any]] = {
    KVCache: lambda layer: _FULL_KV,
    JoinedKVCache: lambda layer: _FULL_KV,
    FreshKVCache: lambda layer: _FULL_KV,
    QuantizedKVCache: lambda layer: QuantizedKV(layer.group_size, layer.bits),
    RotatingKVCache: _window,
}


def kind_of(layer: Any) -> FullKV | QuantizedKV | Window | Recurrent | Whole:
    """The kind of one mlx-lm layer cache (an empty one too)."""
    make = _BY_TYPE.get(type(layer))
    if make is not None:
        return make(layer)
    if isinstance(layer, ArraysCache):
        return Recurrent(type(layer), len(layer.cache))
    return Whole(type(layer))


# ------------------------------------------------------------------------ helpers


def _checked_length(layer: Any, arrays: Callable[[Any], Arrays]) -> int:
    if layer.keys is None:
        raise ValueError("cannot store an empty layer cache")
    if arrays(layer)[0].shape[0] != 1:
        raise ValueError("only batch-size-1 caches can be stored")
    return layer.offset


def own(a: mx.array) -> mx.array:
    """A copy of `a` in a buffer of its own."""
    # A slice shares its source's buffer; contiguous() copies it into one of
    # its own, so a stored range does not keep the whole source alive.
    return mx.contiguous(a)


def views_of(layer: Any) -> Any:
    """The same layer over new array objects (views of its buffers)."""
    state = tree_map(lambda a: a[...] if isinstance(a, mx.array) else a, layer.state)
    return type(layer).from_state(state)
