"""A decode step's products outside a Llama block's nodes on our kernel (`csrc/gemm.c`).

A BLAS's sgemm packs the whole weight before it multiplies, which for a decode step's
one row costs as much as the product. `Linear` and `Embedding` (its `as_linear`, a tied
output projection) take the place of mlx-lm's float32 `nn.Linear` and `nn.Embedding`
modules and run a product of at most `fast_path.MAX_ROWS` rows as our primitive, which
reads each row of the weight once; longer inputs (a prefill chunk) and anything else go
to MLX's matmul, as before (`fast_path.FastPath.linear` decides). A row's result does not
depend on the rows beside it, so a row decoded alone, in a batch or in a draft's pass gets
the same bits, and the same as in a block's nodes (`kernel_block`).

`install` replaces modules in the model's tree (`mlx_adapter.model_patches.replace_modules`,
as `nn.quantize` does), after `kernel_block` took the blocks it runs (which read their
projections' weights).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..mlx_adapter.model_patches import recast, replace_modules
from . import native
from .fast_path import FAST_PATH, Route


def _product(x: mx.array, weight: mx.array) -> mx.array | None:
    """x @ weight.T on our kernel, or None where it is not routed there or refuses it."""
    if FAST_PATH.linear(x, weight) is not Route.KERNEL:
        return None
    try:
        return FAST_PATH.kernels("linear").linear(x, weight)
    except ValueError:  # a weight set since `install` that it does not read (a view)
        return None


class Linear(nn.Linear):
    """mlx-lm's `nn.Linear`; a few float32 rows run on our kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        out = _product(x, self.weight)
        if out is None:
            return super().__call__(x)
        return out + self.bias if "bias" in self else out


class Embedding(nn.Embedding):
    """mlx-lm's `nn.Embedding`; as a tied output projection, a few float32 rows run on
    our kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        out = _product(x, self.weight)
        return super().as_linear(x) if out is None else out


def _ours(module: Any, ops: Any) -> nn.Module | None:
    """`module`'s replacement, holding the same arrays; None to leave it as it is (not
    float32, or a weight the primitive does not take: a node made on stand-in input)."""
    kinds = {nn.Linear: Linear, nn.Embedding: Embedding}
    kind = kinds.get(type(module))
    if kind is None or module.weight.dtype != mx.float32 or module.weight.ndim != 2:
        return None
    mx.eval(module.weight)  # the primitive takes an evaluated weight
    try:
        ops.linear(mx.zeros((1, module.weight.shape[1])), module.weight)
    except ValueError:
        return None
    return recast(module, kind)  # its weight, its bias: the same arrays


def install(model: Any) -> int:
    """Replace `model`'s float32 `nn.Linear` and `nn.Embedding` modules by ours; how many
    were replaced (0 where the kernels' module is not there: `native.problem`)."""
    ops = native.layers()
    if ops is None:
        return 0
    return replace_modules(
        model, lambda child: _ours(child, ops) if isinstance(child, nn.Module) else None
    )
