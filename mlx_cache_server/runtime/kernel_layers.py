"""RoPE and RMSNorm on MLX's CPU device as one op each (`csrc/layers.cpp`).

On the CPU, `mx.fast.rope` and `mx.fast.rms_norm` have no kernel: each call builds MLX's
fallback, some twenty small ops for RoPE and six for RMSNorm, and a decode step of a small
model was mostly those ops' graph nodes, allocations and tasks (an in-process profile, in
bench/README.md as of c01f1a1, "Decode kernels"; `python -m bench decode` measures the
decode throughput this serves). The primitives compute the fallback's arithmetic in its
order, so their results are the same bits: nothing about a model's output changes but its
speed.

`install` replaces a model's `nn.RoPE` and `nn.RMSNorm` modules (those exact classes, not
a model's own variants) by subclasses that call the primitives where `fast_path.FastPath`
routes a call to them (float32 input) and MLX's own function for anything else. Needs the
extension module `native.layers()` builds; without it, nothing is replaced.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..mlx_adapter.model_patches import replace_modules
from . import native
from .fast_path import FAST_PATH, Route


class RoPE(nn.RoPE):
    """`nn.RoPE`, one op on float32 (batch, heads, positions, size) input."""

    def __init__(self, original: nn.RoPE, ops: Any) -> None:
        super().__init__(original.dims, original.traditional, original.base, original.scale)
        self._ops = ops
        self._inv_freq = ops.inv_freq(self.dims, self.base)
        mx.eval(self._inv_freq)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if FAST_PATH.rope(x) is not Route.KERNEL:
            return super().__call__(x, offset)
        first = first_positions(offset, x.shape[0])
        if first is None:
            return super().__call__(x, offset)  # MLX's error
        return self._ops.rope(x, first, self._inv_freq, self.dims, self.traditional, self.scale)


def first_positions(offset: int | mx.array, batch: int) -> mx.array | None:
    """A RoPE offset as the primitives take it: int32, one element or one a row; None for
    an offset MLX's RoPE would refuse."""
    if not isinstance(offset, mx.array):
        return mx.array([offset], mx.int32)
    if (
        offset.ndim > 1
        or offset.size not in (1, batch)
        or not mx.issubdtype(offset.dtype, mx.integer)
    ):
        return None
    # a cache's offsets are already int32 (batch,): no extra node for them
    first = offset if offset.ndim == 1 else offset.reshape(1)
    return first if first.dtype == mx.int32 else first.astype(mx.int32)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm`, one op on float32 input and weight."""

    def __init__(self, original: nn.RMSNorm, ops: Any) -> None:
        super().__init__(original.weight.shape[0], original.eps)
        self.weight = original.weight
        self._ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        if FAST_PATH.rms_norm(x, self.weight) is not Route.KERNEL:
            return super().__call__(x)
        return self._ops.rms_norm(x, self.weight, self.eps)


def _ours(value: Any, ops: Any) -> Any:
    if type(value) is nn.RoPE:
        return RoPE(value, ops)
    if type(value) is nn.RMSNorm:
        return RMSNorm(value, ops)
    return None


def install(model: Any) -> int:
    """Replace `model`'s RoPE and RMSNorm modules by ours; how many were replaced (0 where
    the extension cannot be built: `native.problem`)."""
    ops = native.layers()
    if ops is None:
        return 0
    return replace_modules(model, lambda child: _ours(child, ops))
