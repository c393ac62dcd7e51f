"""Attention on MLX's CPU device with the softmax in numpy, whose exp is vectorized.

On Linux, MLX's CPU backend computes `exp` one element at a time, and a prefill chunk's
softmax over a long context is most of its attention's time (`python -m bench
cpu-attention` times one layer's attention both ways and the warm turns it serves). Here
the two matmuls stay in MLX (its BLAS) and the softmax runs in numpy on a zero-copy view
of the scores: its SIMD exp. numpy's own BLAS is not used for them: a second BLAS thread
pool spinning beside MLX's slowed every matmul of the forward pass on a machine with few
cores. Queries are taken in chunks so that a chunk's scores stay under `CHUNK_SCORES`
values (a chunk holds at least one query per sequence, so a decode step's scores are
computed at once): rows are independent, so each is an exact softmax, with no rescaling.

A decode step (one query a sequence) over a short context (`fast_path.DECODE_MAX_KEYS`) is the
exception (`decode_attention`): all of it runs in numpy, its matmuls included, each small
enough that numpy's BLAS keeps it on the calling thread (`fast_path.DECODE_MAX_PRODUCT`). There
MLX's kernel spent most of its time in its scalar `exp` and its many small ops, and
`attention` in the round trips of MLX's two matmuls; over longer contexts numpy's path
measured slower (in-process timings, in bench/README.md as of c01f1a1, "Decode steps'
attention"; `python -m bench decode` measures the decode steps this serves).

Which calls take which path (`KERNEL`: `kernel_attention`, where our kernels' module is
there; `NUMPY_DECODE`: `decode_attention`; `NUMPY`: `attention`; else mlx-lm's own
`scaled_dot_product_attention`) is `fast_path.FastPath.attention`'s to say: only MLX's CPU
device, float32, no quantized cache, no attention sinks. The entry point is installed by
rebinding the name a model's modules call (`install`), mlx-lm's attention entry point: no
mlx-lm file is changed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import base

from ..mlx_adapter.model_patches import rebind
from . import kernel_attention
from .fast_path import FAST_PATH, Route

CHUNK_SCORES = 1 << 22  # scores computed at once (16 MiB of float32)

LOWEST = np.finfo(np.float32).min


def scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, on the route `FAST_PATH` picks."""
    route = FAST_PATH.attention(queries, keys, values, cache, mask, sinks)
    if route is Route.KERNEL:
        ops = FAST_PATH.kernels("attention")
        return kernel_attention.run(ops, queries, keys, values, scale, mask)
    if route is Route.NUMPY_DECODE:
        return decode_attention(queries, keys, values, scale, mask)
    if route is Route.NUMPY:
        return attention(queries, keys, values, scale, mask)
    return base.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """softmax(q k^T * scale + mask) v for (batch, heads, length, dim) arrays.

    Grouped-query attention as MLX's kernel does it: query head i reads key/value head
    i // (query heads / key heads). `mask` is None, "causal" (the queries are the last
    of the keys' positions) or an array broadcast to (batch, heads, queries, keys),
    boolean (True: may attend) or additive.
    """
    b, n_heads, n_q, dim = queries.shape
    n_kv, n_k = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv
    q = (queries * scale).reshape(b, n_kv, groups, n_q, dim)
    kt = keys[:, :, None].swapaxes(-1, -2)  # (b, kv heads, 1, dim, keys)
    v = values[:, :, None]
    if isinstance(mask, mx.array):
        mx.eval(mask)
    m = _mask(mask, b, n_kv, groups, n_q, n_k)
    step = max(1, CHUNK_SCORES // (b * n_heads * n_k))
    parts = []
    for at in range(0, n_q, step):
        scores = q[:, :, :, at : at + step] @ kt  # MLX's BLAS: one thread pool, not two
        mx.eval(scores)
        s = np.asarray(scores)  # this step's own buffer: worked on in place
        if not s.flags.writeable:
            s = s.copy()
        part = None if m is None else m[..., at : at + step, :] if m.shape[-2] > 1 else m
        total = _exp_rows(s, part)
        # Written in place when numpy could: then the scores' own buffer holds the weights.
        weights = scores if np.shares_memory(s, np.asarray(scores)) else mx.array(s)
        part = (weights @ v) / mx.array(total)
        mx.eval(part)  # before the next chunk: one chunk's scores alive at a time
        parts.append(part)
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=3)
    return out.reshape(b, n_heads, n_q, -1)


def decode_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """`attention` for one query per sequence (a decode step), all of it in numpy.

    Its two matmuls are small (a few query heads against each sequence's keys): MLX's
    kernel pays more for its scalar `exp` and its many small ops, and `attention` for
    the round trips of MLX's matmuls, than numpy takes for the whole.
    """
    b, n_heads, _, dim = queries.shape
    n_kv, n_k = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv
    mx.eval(queries, keys, values, *([mask] if isinstance(mask, mx.array) else []))
    q = np.asarray(queries).reshape(b, n_kv, groups, dim) * np.float32(scale)
    s = q @ np.asarray(keys).swapaxes(-1, -2)  # (batch, kv heads, groups, keys)
    m = _mask(mask, b, n_kv, groups, 1, n_k)
    s /= _exp_rows(s, None if m is None else m[..., 0, :])
    out = s @ np.asarray(values)
    return mx.array(out.reshape(b, n_heads, 1, -1))


def _exp_rows(s: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """exp(scores + mask - each row's largest) in place in `s`, and the rows' sums to divide
    by: in place, since a long context's scores are the largest array attention makes."""
    if m is not None:
        if m.dtype == np.bool_:  # a finite floor, as MLX's: no NaN from a masked row
            np.copyto(s, LOWEST, where=~m)
        else:
            s += m
    top = s.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0  # a row an additive mask fully masks: zeros, not NaN
    s -= top
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    total[total == 0] = 1
    return total


def _mask(mask: Any, b: int, n_kv: int, groups: int, n_q: int, n_k: int) -> np.ndarray | None:
    """The mask as an array that broadcasts to (batch, kv heads, groups, queries, keys)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if n_q == 1:
            return None
        positions = np.arange(n_k - n_q, n_k)
        return positions[:, None] >= np.arange(n_k)[None, :]
    m = np.asarray(mask)
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)  # (batch or 1, heads or 1, queries, keys)
    heads = m.shape[1]
    if heads == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], n_kv, groups, *m.shape[2:])


def install(model: Any) -> bool:
    """Route `model`'s attention through this module's entry point; False if no part of it
    calls mlx-lm's `scaled_dot_product_attention` by name."""
    return rebind(
        model, "scaled_dot_product_attention", base.scaled_dot_product_attention,
        scaled_dot_product_attention, home=base,
    )  # fmt: skip
