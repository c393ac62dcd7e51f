"""Attention for a few queries a sequence on our kernel (`csrc/attention.c`).

A decode step, a batch of them, or a draft's pass: up to `MAX_QUERIES` queries a
sequence. MLX's CPU kernel computes `exp` one element at a time and each query's scores
in turn, so a draft's pass of 8 positions cost 8 steps' attention; the kernel takes the
query rows of a key head together over blocks of its keys, a row's arithmetic the same
whatever rows it is computed with (the same bits in a pass as in a single step), its
`exp` vectorized, the heads spread over the cores. The operands are the MLX arrays' own
buffers, read in place.

The kernel runs as a node of MLX's graph (the primitive in `csrc/layers.cpp`), so that a
step is built whole and evaluated at once. Used by `cpu_attention` where the kernels'
module is there (`native.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import native
from .live_positions import lengths_for

MAX_QUERIES = 16  # queries a sequence: a decode step's 1 to a long draft's pass
MAX_KEYS = 1 << 20  # as `csrc/attention.c`
NO_MASK, CAUSAL, BOOL_MASK, ADDITIVE_MASK = range(4)

enabled = True  # off: `cpu_attention` goes on as without the kernels


def _ops() -> Any:
    """The kernels' module, where it is there and attention is on."""
    return native.layers() if enabled else None


def available() -> bool:
    return _ops() is not None


def takes_live() -> bool:
    """Whether attention computes only a pass's live queries (`live_positions`)."""
    return available()


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array | None:
    """softmax(q k^T * scale + mask) v as `cpu_attention.attention` takes it; None where
    the kernel does not compute it (the caller goes on to MLX's path)."""
    b, heads, n_q, _ = queries.shape
    kv_heads, n_k = keys.shape[1], keys.shape[2]
    ops = _ops()
    if ops is None or not 0 < n_q <= min(MAX_QUERIES, n_k) or n_k > MAX_KEYS:
        return None
    if heads % kv_heads or keys.shape[0] != b or keys.shape[3] != queries.shape[3]:
        return None
    if tuple(values.shape[:3]) != (b, kv_heads, n_k):  # MLX's path says what is wrong
        return None
    kind = _mask_kind(mask, (b, heads, n_q, n_k))
    if kind is None:
        return None
    held = mask if kind in (BOOL_MASK, ADDITIVE_MASK) else None
    live = lengths_for(b, n_q)  # a verification pass's live queries (`live_positions`)
    return ops.attention(queries, keys, values, held, scale, kind, live)


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
