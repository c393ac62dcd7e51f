"""The CPU fast path on a model: attention and logprobs through numpy, and where our
kernels' module is there (`native`): a few queries' attention on our kernel
(`kernel_attention`), RoPE, RMSNorm and SwiGLU as one MLX op each (`kernel_layers`,
`cpu_activations`; numpy's SwiGLU without it), a Llama block's work around attention as
two (`kernel_block`), and a decode step's other products on our kernel (`kernel_linear`).

One place for what the engine installs on MLX's CPU device, so that benchmarks measuring
"as the server runs" install the same (`cpu_attention`, `cpu_activations`, `cpu_logprobs`
`kernel_layers` say why each).
"""

from __future__ import annotations

from typing import Any

from . import (
    cpu_activations,
    cpu_attention,
    cpu_logprobs,
    kernel_block,
    kernel_layers,
    kernel_linear,
)


def install(model: Any) -> bool:
    """Route `model`'s attention and mlx-lm's logprobs through numpy, and its RoPE, RMSNorm,
    SwiGLU, Llama blocks and
    decode products through our primitives; False if the model's attention
    could not be routed (the rest is installed either way)."""
    attention = cpu_attention.install(model)
    cpu_activations.install(model)
    cpu_logprobs.install()
    kernel_layers.install(model)
    kernel_block.install(model)
    kernel_linear.install(model)  # after the blocks, which read their projections' weights
    return attention
