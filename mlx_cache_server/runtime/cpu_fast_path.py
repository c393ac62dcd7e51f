"""The CPU fast path put in a model: its entry points, each where the model calls that op.

`fast_path.py` holds the switch and the rules that pick, call by call, which implementation
an entry point runs; this module only puts the entry points in place, when a model is
loaded and `fast_path.FAST_PATH.installs()`. Three mechanisms, all in
`mlx_adapter/model_patches.py`, which says what each touches:

    entry point                                  how a model reaches it
    cpu_attention.scaled_dot_product_attention   the name rebound in the model's modules
    cpu_activations.swiglu                       the name rebound in the model's modules
    cpu_logprobs.logsumexp                       `mlx_lm.generate`'s `mx.logsumexp`
    kernel_layers.RoPE, .RMSNorm                 modules of the model replaced
    kernel_block.Block                           the model's Llama blocks replaced
    kernel_linear.Linear, .Embedding             modules of the model replaced

The modules of ours exist only where our kernels' module is there (`native.problem` says
why not); the rest is installed either way. Benchmarks measuring "as the server runs"
install the same.
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
    """Put the fast path's entry points in `model` and in mlx-lm's generators; False if the
    model's attention could not be routed (the rest is installed either way)."""
    attention = cpu_attention.install(model)
    cpu_activations.install(model)
    cpu_logprobs.install()
    kernel_layers.install(model)
    kernel_block.install(model)  # after the layers: a block runs only with ours
    kernel_linear.install(model)  # after the blocks, which read their projections' weights
    return attention
