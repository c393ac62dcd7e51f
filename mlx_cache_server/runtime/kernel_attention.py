"""Attention for a few queries a sequence on our kernel (`csrc/attention.c`).

A decode step, a batch of them, or a draft's pass: up to `MAX_QUERIES` queries a
sequence. MLX's CPU kernel computes `exp` one element at a time and each query's scores
in turn, so a draft's pass of 8 positions cost 8 steps' attention; the kernel takes the
query rows of a key head together over blocks of its keys, a row's arithmetic the same
whatever rows it is computed with (the same bits in a pass as in a single step), its
`exp` vectorized, the heads spread over the cores. The operands are the MLX arrays' own
buffers, read in place.

The kernel runs as a node of MLX's graph (the primitive in `csrc/layers.cpp`), so that a
step is built whole and evaluated at once. `fast_path.FastPath.attention` decides which
calls it takes (`takes` says which it can), and `cpu_attention` runs them here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx

from . import native
from .live_positions import lengths_for

MAX_QUERIES = 16  # queries a sequence: a decode step's 1 to a long draft's pass
MAX_KEYS = 1 << 20  # as `csrc/attention.c`
NO_MASK, CAUSAL, BOOL_MASK, ADDITIVE_MASK = range(4)


def takes(queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> bool:
    """Whether the kernel computes attention of these operands: up to `MAX_QUERIES`
    queries a sequence (no more than its keys), heads grouped evenly over the key heads,
    keys and values of these queries' batch and size, and a mask it takes (`mask_kind`).
    Where it does not, MLX's path says what is wrong, if anything is."""
    b, heads, n_q, _ = queries.shape
    kv_heads, n_k = keys.shape[1], keys.shape[2]
    if not 0 < n_q <= min(MAX_QUERIES, n_k) or n_k > MAX_KEYS:
        return False
    if heads % kv_heads or keys.shape[0] != b or keys.shape[3] != queries.shape[3]:
        return False
    if tuple(values.shape[:3]) != (b, kv_heads, n_k):
        return False
    return mask_kind(mask, (b, heads, n_q, n_k)) is not None


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array | None:
    """softmax(q k^T * scale + mask) v as `cpu_attention.attention` takes it; None where
    the kernel does not compute it (`takes`) or its module is not there."""
    ops = native.layers()
    if ops is None or not takes(queries, keys, values, mask):
        return None
    return run(ops, queries, keys, values, scale, mask)


def run(
    ops: ModuleType, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """`attention` on operands it `takes`, through the kernels' module `ops`."""
    b, heads, n_q, _ = queries.shape
    kind = mask_kind(mask, (b, heads, n_q, keys.shape[2]))
    held = mask if kind in (BOOL_MASK, ADDITIVE_MASK) else None
    live = lengths_for(b, n_q)  # a verification pass's live queries (`live_positions`)
    return ops.attention(queries, keys, values, held, scale, kind, live)


def mask_kind(mask: Any, shape: tuple[int, int, int, int]) -> int | None:
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
