"""A Llama block as two MLX ops around its cache's update and attention (`csrc/block.cpp`).

mlx-lm's Llama block is dozens of graph nodes on float32, each a task on MLX's CPU
stream with the pool's worker idle beside it, and building them takes the Python thread
a share of the two cores that run them (an in-process profile, in bench/README.md as of
c01f1a1, "Decode kernels"; `python -m bench decode` measures the decode throughput this
serves). `Block` runs the norm, projections and RoPE before attention as one op and
everything after it as another, with the same arithmetic in the same order: the same
bits as mlx-lm's own block, SwiGLU included (`cpu_activations` computes it the same
way), which the tests compare.

The cache's update and attention stay the model's own calls (the module's
`scaled_dot_product_attention`, ours where `cpu_attention` is installed), so every cache
type, mask and attention path works as before. `install` replaces the blocks it can run
(mlx-lm's `llama` blocks whose norms and RoPE `kernel_layers` replaced, float32 weights, no
biases) by a `Block` holding the same parts; anything else it leaves alone, and `Block`
hands any call `fast_path.FastPath.block` does not route to it (another dtype or device,
the fast path off) or whose weights the ops refuse to the model's own.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from ..mlx_adapter.model_patches import called_by, recast, replace_modules
from . import kernel_layers, native
from .fast_path import FAST_PATH, Route
from .live_positions import lengths_for


class Block(llama.TransformerBlock):
    """mlx-lm's Llama block; float32 input runs as two ops around attention."""

    computes_as = llama.TransformerBlock  # for `forward_together`, which calls its parts

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if FAST_PATH.block(x, _weights(self)) is not Route.KERNEL:
            return super().__call__(x, mask, cache)
        first = kernel_layers.first_positions(cache.offset if cache is not None else 0, x.shape[0])
        if first is None:
            return super().__call__(x, mask, cache)
        ops = FAST_PATH.kernels("block")
        attn, lengths = self.self_attn, lengths_for(x.shape[0], x.shape[1])
        try:  # before the cache's update: weights replaced since `install` may be refused
            q, k, v = _inputs(ops, self, x, first, lengths)
        except ValueError:
            return super().__call__(x, mask, cache)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        attend = called_by(attn, "scaled_dot_product_attention")
        out = attend(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        return _output(ops, self, x, out, lengths)


def _inputs(
    ops: Any, layer: Any, x: mx.array, first: mx.array, lengths: mx.array | None = None
) -> list[mx.array]:
    attn, rope = layer.self_attn, layer.self_attn.rope
    return ops.block_input(
        x, layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight,
        attn.v_proj.weight, first, rope._inv_freq, layer.input_layernorm.eps,
        attn.n_heads, attn.n_kv_heads, rope.dims, rope.traditional, rope.scale, lengths,
    )  # fmt: skip


def _output(
    ops: Any, layer: Any, x: mx.array, attended: mx.array, lengths: mx.array | None = None
) -> mx.array:
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    return ops.block_output(
        x, attended, attn.o_proj.weight, norm.weight, mlp.gate_proj.weight,
        mlp.up_proj.weight, mlp.down_proj.weight, norm.eps, lengths,
    )  # fmt: skip


def _weights(layer: Any) -> list[mx.array]:
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return norms + [p.weight for p in _linears(layer)]


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


def skips_fillers(model: Any) -> bool:
    """Whether a pass of `model` within `live_positions` computes no filler: every block of
    it ours, and attention our kernel's node."""
    layers = getattr(model, "layers", None)
    return (
        bool(layers)
        and all(type(layer) is Block for layer in layers)
        and FAST_PATH.kernels("attention") is not None
    )


def install(model: Any) -> int:
    """Replace `model`'s blocks that `Block` runs (after `kernel_layers.install`) by a
    `Block` holding the same parts; how many were replaced (0 where the extension cannot
    be built: `native.problem`)."""
    ops = native.layers()
    if ops is None or not ops.has_block():
        return 0
    return replace_modules(model, lambda child: _ours(child, ops))


def _ours(layer: Any, ops: Any) -> Block | None:
    """`layer` as a `Block`, or None to leave it as it is."""
    if type(layer) is not llama.TransformerBlock or not runs(layer):
        return None
    mx.eval(_weights(layer))  # the ops take evaluated weights
    return recast(layer, Block) if _takes(ops, layer) else None


def _takes(ops: Any, layer: Any) -> bool:
    """Whether the ops take `layer`'s weights (evaluated, row-contiguous): two nodes made on
    stand-in input, not run."""
    attn = layer.self_attn
    x = mx.zeros((1, 1, layer.input_layernorm.weight.shape[0]))
    try:
        q, k, v = _inputs(ops, layer, x, mx.array([0], mx.int32))
        _output(ops, layer, x, mx.zeros((1, attn.n_heads, 1, v.shape[-1])))
    except ValueError:
        return False
    return True
