"""The CPU fast path on a model: attention, SwiGLU and logprobs through numpy, and a few
queries' attention on our kernel where it is preloaded (`kernel_attention`).

One place for what the engine installs on MLX's CPU device, so that benchmarks measuring
"as the server runs" install the same (`cpu_attention`, `cpu_activations`, `cpu_logprobs`
say why each).
"""

from __future__ import annotations

from typing import Any

from . import cpu_activations, cpu_attention, cpu_logprobs


def install(model: Any) -> bool:
    """Route `model`'s attention and SwiGLU, and mlx-lm's logprobs, through numpy; False if
    the model's attention could not be routed (the rest is installed either way)."""
    attention = cpu_attention.install(model)
    cpu_activations.install(model)
    cpu_logprobs.install()
    return attention
