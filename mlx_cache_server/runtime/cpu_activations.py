"""The MLP's SwiGLU on MLX's CPU device, vectorized: our primitive, else numpy.

`silu(gate) * x` takes one `exp` per element of the MLP's hidden width, and on Linux MLX's
CPU `exp` is scalar: after attention, the activation was the largest cost of a prefill
that was not a matmul, and every decode step of many streams pays it too (`python -m bench
cpu-attention` times a forward pass per op kind, the activation among them, with MLX's
kernels and with the fast path: bench/results/cpu_attention.json). Where our extension
builds (`native.layers()`), float32 SwiGLU is its node (`csrc/block.cpp`): mlx-lm's
arithmetic, so the same bits as a Llama block's node and as mlx-lm's own `swiglu`, 16
lanes at a time, and no evaluation mid-graph. Without it, numpy's, where the round trip
pays (`fast_path.MIN_ELEMENTS`); `fast_path.FastPath.swiglu` picks, and anything else goes
to mlx-lm's own compiled `swiglu`. Elementwise either way, so the result of an element
never depends on how a prompt was cut into chunks: cached and uncached runs compute the
same values.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import activations

from ..mlx_adapter.model_patches import rebind
from .fast_path import FAST_PATH, Route


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (`silu(gate) * x`), on the route `FAST_PATH` picks."""
    route = FAST_PATH.swiglu(gate, x)
    if route is Route.KERNEL:
        return FAST_PATH.kernels("swiglu").swiglu(gate, x)
    if route is Route.NUMPY:
        return numpy_swiglu(gate, x)
    return activations.swiglu(gate, x)


def numpy_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`silu(gate) * x` through numpy's vectorized exp, for float32 operands of one shape."""
    mx.eval(gate, x)
    out = np.array(gate)  # a copy: the result's own buffer
    e = np.negative(out)
    np.exp(e, out=e)
    e += 1
    out /= e  # silu(g) = g / (1 + exp(-g))
    out *= np.asarray(x)
    return mx.array(out)


def install(model: Any) -> bool:
    """Route `model`'s SwiGLU here; False if no part of it calls mlx-lm's `swiglu` by name."""
    return rebind(model, "swiglu", activations.swiglu, swiglu, home=activations)
