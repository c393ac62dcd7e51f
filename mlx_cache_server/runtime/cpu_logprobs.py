"""Logits normalized into logprobs on MLX's CPU device through numpy, whose exp is vectorized.

Every sampled token first has its row of logits turned into logprobs, `logits -
logsumexp(logits)`: one `exp` per vocabulary entry, and on Linux MLX's CPU `exp` is
scalar, so with many streams this was, after the matmuls, among a decode step's largest
costs (`python -m bench decode` measures decode with many streams:
bench/results/decode.json). `install` has mlx-lm's generators call `logsumexp` here
(`mlx_adapter.model_patches.route_generate`); the engine's own normalizations call it
directly.

Each row is reduced on its own, so among steps of several streams a sequence's logprobs
never depend on which others share its step. `fast_path.FastPath.logsumexp` leaves one or
two rows to MLX (`fast_path.MIN_ROWS` says why). The two normalizations differ in the last
bits only; a greedy token is the largest logit either way (unless subtracting rounds two
logits into one).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..mlx_adapter.model_patches import route_generate
from .fast_path import FAST_PATH, Route


def logsumexp(a: mx.array, axis: int | None = None, keepdims: bool = False) -> mx.array:
    """`mx.logsumexp`, on the route `FAST_PATH` picks."""
    if FAST_PATH.logsumexp(a, axis) is Route.NUMPY:
        return numpy_logsumexp(a, keepdims)
    return mx.logsumexp(a, axis=axis, keepdims=keepdims)


def numpy_logsumexp(a: mx.array, keepdims: bool = False) -> mx.array:
    """`mx.logsumexp` along the last axis of float32 rows, each row alone, through numpy."""
    mx.eval(a)
    x = np.asarray(a)
    top = x.max(axis=-1, keepdims=True)
    # A row without a finite largest value (all -inf, or an inf) is shifted by 0, so it
    # gives what MLX's gives: -inf, or inf.
    shift = np.where(np.isfinite(top), top, 0).astype(x.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = shift + np.log(np.exp(x - shift).sum(axis=-1, keepdims=True))
    return mx.array(out if keepdims else out[..., 0])


def install() -> bool:
    """Route mlx-lm's generators' `logsumexp` here; False if it was routed already."""
    return route_generate("logsumexp", logsumexp)
