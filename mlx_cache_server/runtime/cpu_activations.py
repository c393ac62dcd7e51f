"""The MLP's SwiGLU on MLX's CPU device, vectorized: our primitive, else numpy.

`silu(gate) * x` takes one `exp` per element of the MLP's hidden width, and on Linux
MLX's CPU `exp` is scalar: after attention, the activation was the largest cost of a
prefill that was not a matmul, and every decode step of many streams pays it too
(bench/README.md, "Attention on the Linux CPU", has the profile). Where our extension
builds (`native.layers()`), float32 SwiGLU is its node (`csrc/block.cpp`): mlx-lm's
arithmetic, so the same bits as a Llama block's node and as mlx-lm's own `swiglu`, 16
lanes at a time, and no evaluation mid-graph. Without it, the conditions of
`cpu_attention`: MLX's CPU device, float32, enough elements to pay for numpy's round
trip; anything else goes to mlx-lm's own compiled `swiglu`. Elementwise either way, so
the result of an element never depends on how a prompt was cut into chunks: cached
and uncached runs compute the same values.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import activations

from . import native
from .model_hooks import rebind

# Below (a decode step of one or two streams on the default model's 1,536-wide MLP):
# MLX's is as fast.
MIN_ELEMENTS = 1 << 12

enabled = True  # off: every call goes to mlx-lm's swiglu


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (`silu(gate) * x`), on our primitive or numpy where faster."""
    ops = native.layers() if enabled else None
    if ops is not None and _ours(gate, x):
        return ops.swiglu(gate, x)
    if not (enabled and _eligible(gate, x)):
        return activations.swiglu(gate, x)
    mx.eval(gate, x)
    out = np.array(gate)  # a copy: the result's own buffer
    e = np.negative(out)
    np.exp(e, out=e)
    e += 1
    out /= e  # silu(g) = g / (1 + exp(-g))
    out *= np.asarray(x)
    return mx.array(out)


def _ours(gate: mx.array, x: mx.array) -> bool:
    """float32 operands of one shape on MLX's CPU device"""
    return (
        mx.default_device() == mx.cpu
        and gate.dtype == mx.float32
        and x.dtype == mx.float32
        and gate.shape == x.shape
        and gate.ndim > 0
    )


def _eligible(gate: mx.array, x: mx.array) -> bool:
    """numpy's: enough elements to pay for its round trip"""
    return _ours(gate, x) and gate.size >= MIN_ELEMENTS


def install(model: Any) -> bool:
    """Route `model`'s SwiGLU here; False if no part of it calls mlx-lm's `swiglu` by name."""
    return rebind(model, "swiglu", activations.swiglu, swiglu, home=activations)
