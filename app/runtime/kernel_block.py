"""A Llama block as two MLX ops around its cache's update and attention (`csrc/block.cpp`).

mlx-lm's Llama block is some fifty graph nodes on float32, each a task on MLX's CPU
stream with the pool's worker idle beside it, and building them takes the Python thread
a share of the two cores that run them (bench/README.md, "Decode kernels", has the
profile). `Block` runs the norm, projections and RoPE before attention as one op and
everything after it as another, with the same arithmetic in the same order: the same
bits as the model's own call, which the tests compare.

The cache's update and attention stay the model's own calls (the module's
`scaled_dot_product_attention`, ours where `cpu_attention` is installed), so every cache
type, mask and attention path works as before. `install` swaps the class of the blocks it
can run (mlx-lm's `llama` blocks whose norms and RoPE `kernel_layers` swapped, float32
weights, no biases); anything else it leaves alone, and `Block` hands any call it cannot
run (another dtype, `enabled` off) to the model's own.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from . import kernel_layers, native

enabled = True  # off: swapped blocks run mlx-lm's call, as before


class Block(llama.TransformerBlock):
    """mlx-lm's Llama block; float32 input runs as two ops around attention."""

    computes_as = llama.TransformerBlock  # for `forward_together`, which calls its parts

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ops = native.layers()
        run = enabled and kernel_layers.enabled and ops is not None
        if not run or x.dtype != mx.float32 or x.ndim != 3:
            return super().__call__(x, mask, cache)
        attn, mlp = self.self_attn, self.mlp
        first = kernel_layers.first_positions(cache.offset if cache is not None else 0, x.shape[0])
        if first is None:
            return super().__call__(x, mask, cache)
        rope = attn.rope
        q, k, v = ops.block_input(
            x, self.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight,
            attn.v_proj.weight, first, rope._inv_freq, self.input_layernorm.eps,
            attn.n_heads, attn.n_kv_heads, rope.dims, rope.traditional, rope.scale,
        )  # fmt: skip
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        attend = sys.modules[type(attn).__module__].scaled_dot_product_attention
        out = attend(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        return ops.block_output(
            x, out, attn.o_proj.weight, self.post_attention_layernorm.weight,
            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
            self.post_attention_layernorm.eps,
        )  # fmt: skip


def _linears(layer: Any) -> list[Any]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj]  # fmt: skip


def runs(layer: Any) -> bool:
    """Whether `Block` computes what `layer`'s own call does: an mlx-lm Llama block whose
    norms and RoPE are `kernel_layers`' and whose projections are plain float32 `Linear`s
    without biases."""
    if type(layer) not in (llama.TransformerBlock, Block):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not llama.Attention or type(mlp) is not llama.MLP:
        return False
    if type(attn.rope) is not kernel_layers.RoPE:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not kernel_layers.RMSNorm or n.weight.dtype != mx.float32 for n in norms):
        return False
    linears = _linears(layer)
    return all(
        type(p) is nn.Linear and "bias" not in p and p.weight.dtype == mx.float32 for p in linears
    )


def install(model: Any) -> int:
    """Swap the class of `model`'s blocks that `Block` runs (after `kernel_layers.install`);
    how many were swapped (0 where the extension cannot be built: `native.layers_problem`)."""
    ops = native.layers()
    if ops is None or not ops.has_block():
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is llama.TransformerBlock and runs(module):
            mx.eval([p.weight for p in _linears(module)])  # the ops take evaluated weights
            module.__class__ = Block
            try:  # the nodes are made, not run: the ops refuse weights they cannot read
                module(mx.zeros((1, 1, module.input_layernorm.weight.shape[0])))
            except ValueError:
                module.__class__ = llama.TransformerBlock
                continue
            swapped += 1
    return swapped
