"""Attention for a few queries a sequence on our kernel (`csrc/attention.c`).

A decode step, a batch of them, or a draft's pass: up to `MAX_QUERIES` queries a
sequence. MLX's CPU kernel computes `exp` one element at a time and each query's scores
in turn, so a draft's pass of 8 positions cost 8 steps' attention; the kernel takes the
query rows of a key head together over blocks of its keys, a row's arithmetic the same
whatever rows it is computed with (the same bits in a pass as in a single step), its
`exp` vectorized, the heads spread over the cores. The operands are the MLX arrays' own
buffers, read in place.

The kernel runs as a node of MLX's graph (the primitive in `csrc/layers.cpp`), so that a
step is built whole and evaluated at once; called from here instead, on evaluated arrays,
each layer's attention waited for the layers before it (bench/README.md, "Decode
kernels"). That call stays for where the extension cannot be built.

Used by `cpu_attention` when the kernels' library is preloaded (`native.py`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np

from . import native
from .live_positions import lengths_for

MAX_QUERIES = 16  # queries a sequence: a decode step's 1 to a long draft's pass
MAX_KEYS = 1 << 20  # as `csrc/attention.c`
NO_MASK, CAUSAL, BOOL_MASK, ADDITIVE_MASK = range(4)

enabled = True  # off: `cpu_attention` goes on as without the kernels
# Off: the kernel is called from here on evaluated arrays, not as a node of the graph (as
# where the extension of `csrc/layers.cpp` cannot be built).
primitive = True

_long3, _long4 = ctypes.c_long * 3, ctypes.c_long * 4


class _Attention(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in
          ("batch", "heads", "kv_heads", "queries", "keys", "dim", "vdim", "mask_kind")),
        ("scale", ctypes.c_float),
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("q_stride", _long3), ("k_stride", _long3), ("v_stride", _long3),
        ("mask", ctypes.c_void_p), ("mask_stride", _long4),
        ("out", ctypes.c_void_p),
        ("live", ctypes.c_void_p),  # NULL here: every query computed
    ]  # fmt: skip


_function: Any = None  # the kernel, once looked for; False: not in this process


def _kernel() -> Any:
    global _function
    if _function is None:  # once: a library is preloaded at start or never
        path = native.loaded()
        if path is None:
            _function = False
        else:
            _function = ctypes.CDLL(str(path)).mlxcs_attention
            _function.argtypes = [ctypes.POINTER(_Attention)]
            _function.restype = ctypes.c_int
    return _function or None


def available() -> bool:
    return enabled and _kernel() is not None


def _node_ops() -> Any:
    """The extension that makes the kernel a node of the graph; None where it is not built,
    has no kernel to call, or `primitive` is off."""
    ops = native.layers() if primitive else None
    return ops if ops is not None and ops.has_attention() else None


def takes_live() -> bool:
    """Whether attention computes only a pass's live queries (`live_positions`): the
    kernel's node, not its call from here."""
    return available() and _node_ops() is not None


def _view(a: mx.array) -> np.ndarray:
    """`a`'s buffer as numpy sees it, the last axis contiguous."""
    view = np.asarray(a)
    return view if view.strides[-1] == 4 else np.ascontiguousarray(view)


def _strides(view: np.ndarray) -> list[int]:
    return [s // 4 for s in view.strides[:-1]]


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array | None:
    """softmax(q k^T * scale + mask) v as `cpu_attention.attention` takes it; None where
    the kernel does not compute it (the caller goes on to MLX's path)."""
    b, heads, n_q, _ = queries.shape
    kv_heads, n_k = keys.shape[1], keys.shape[2]
    if _kernel() is None or not 0 < n_q <= min(MAX_QUERIES, n_k) or n_k > MAX_KEYS:
        return None
    if heads % kv_heads or keys.shape[0] != b or keys.shape[3] != queries.shape[3]:
        return None
    if tuple(values.shape[:3]) != (b, kv_heads, n_k):  # MLX's path says what is wrong
        return None
    kind = _mask_kind(mask, (b, heads, n_q, n_k))
    if kind is None:
        return None
    ops = _node_ops()
    if ops is not None:
        held = mask if kind in (BOOL_MASK, ADDITIVE_MASK) else None
        live = lengths_for(b, n_q)  # a verification pass's live queries (`live_positions`)
        return ops.attention(queries, keys, values, held, scale, kind, live)
    return _called(queries, keys, values, scale, mask, kind)


def _mask_kind(mask: Any, shape: tuple[int, int, int, int]) -> int | None:
    """How the kernel takes `mask` for attention of this (batch, heads, queries, keys);
    None for a mask it does not take: not one of these queries and keys (MLX's path says
    so), of another type, or another kind."""
    if mask is None or isinstance(mask, str) and mask == "causal":
        return CAUSAL if mask and shape[2] > 1 else NO_MASK
    if not isinstance(mask, mx.array) or mask.dtype not in (mx.bool_, mx.float32):
        return None
    if mask.ndim > 4:
        return None
    padded = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if any(size not in (1, full) for size, full in zip(padded, shape, strict=True)):
        return None
    return BOOL_MASK if mask.dtype == mx.bool_ else ADDITIVE_MASK


def _called(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, kind: int
) -> mx.array | None:
    """The kernel called here, on evaluated arrays: where the extension with the primitive
    is not to be had (`native.layers_problem`)."""
    b, heads, n_q, dim = queries.shape
    kv_heads, n_k = keys.shape[1], keys.shape[2]
    arrays = [queries, keys, values, *([mask] if isinstance(mask, mx.array) else [])]
    mx.eval(*arrays)
    q, k, v = _view(queries), _view(keys), _view(values)
    out = np.empty((b, heads, n_q, values.shape[-1]), np.float32)
    spec = _Attention(
        b, heads, kv_heads, n_q, n_k, dim, values.shape[-1], kind, scale,
        q.ctypes.data, k.ctypes.data, v.ctypes.data,
        _long3(*_strides(q)), _long3(*_strides(k)), _long3(*_strides(v)),
        None, _long4(0, 0, 0, 0), out.ctypes.data,
    )  # fmt: skip
    held = None
    if kind in (BOOL_MASK, ADDITIVE_MASK):
        m = np.asarray(mask)
        held = np.broadcast_to(m.reshape((1,) * (4 - m.ndim) + m.shape), (b, heads, n_q, n_k))
        spec.mask = held.ctypes.data
        spec.mask_stride = _long4(*(s // held.itemsize for s in held.strides))
    if _kernel()(ctypes.byref(spec)) != 0:
        return None
    del held, q, k, v  # the views, kept alive until the kernel returned
    return mx.array(out)
