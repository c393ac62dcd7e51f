"""One forward pass over several sequences' new tokens, each with its own KV cache.

A step that prefills a prompt's chunk and decodes the running streams runs, in
mlx-lm's `BatchGenerator`, two forward passes: the streams' and the chunk's. On a
CPU the streams' pass costs nearly what reading every weight once costs, for a few
rows, and the streams wait for both passes between two tokens. Here the parts' rows
go through the projections, the MLP and the norms as one matrix, as in SGLang's and
vLLM's mixed batches; only attention, which reads each part's own KV, runs per part.

It repeats the forward pass of mlx-lm's Llama and Qwen2 models (`SUPPORTED`, which
covers the models mlx-lm maps to them, Mistral among them), calling the model's own
modules and its module's `scaled_dot_product_attention` (ours where
`cpu_attention` is installed) in the same order: a part's KV, RoPE offsets and mask
are what the model's own call would make of them. Other models run their own passes
(`supports`).

Invariants: each part's cache takes exactly its part's tokens, as a call of the model
on that part alone would give it; the result's part `i` is the last norm's output for
part `i`'s tokens, shaped as they came `(B, L, hidden)`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import create_attention_mask

SUPPORTED = (llama, qwen2)  # model modules whose forward pass `forward_together` repeats

Part = tuple[mx.array, list[Any]]  # a part's tokens (B, L) and its cache, one per layer


def supports(model: Any) -> bool:
    """Whether `forward_together` computes what `model`'s own call would: one of the
    `SUPPORTED` modules' models, every layer that module's full-attention block, all
    layers in this process (split by heads is the same pass)."""
    module = sys.modules.get(type(model).__module__)
    if module not in SUPPORTED or type(model) is not module.Model:
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner, "swa_idx", None) is not None:
        return False  # sliding-window layers take a mask of their own
    if getattr(inner, "pipeline_size", 1) != 1:
        return False  # split by layers over processes: its pass hands hidden states on
    return all(
        type(layer) is module.TransformerBlock and type(layer.self_attn) is module.Attention
        for layer in layers
    )


def forward_together(model: Any, parts: Sequence[Part]) -> list[mx.array]:
    """The last norm's output for each part's tokens, its cache updated with them."""
    inner = model.model
    attend = sys.modules[type(model).__module__].scaled_dot_product_attention
    embedded = [inner.embed_tokens(tokens) for tokens, _ in parts]
    masks = [create_attention_mask(h, c[0]) for h, (_, c) in zip(embedded, parts, strict=True)]
    shapes = [h.shape for h in embedded]
    x = mx.concatenate([h.reshape(-1, h.shape[-1]) for h in embedded])
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        normed = layer.input_layernorm(x)
        queries, keys, values = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
        outputs, start = [], 0
        for (b, n, _), mask, (_, cache) in zip(shapes, masks, parts, strict=True):
            rows = slice(start, start + b * n)
            start += b * n
            q = queries[rows].reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
            k = keys[rows].reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = values[rows].reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            c = cache[i]
            q = attn.rope(q, offset=c.offset)
            k = attn.rope(k, offset=c.offset)
            k, v = c.update_and_fetch(k, v)
            out = attend(q, k, v, cache=c, scale=attn.scale, mask=mask)
            outputs.append(out.transpose(0, 2, 1, 3).reshape(b * n, -1))
        h = x + attn.o_proj(mx.concatenate(outputs))
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    x = inner.norm(x)
    out, start = [], 0
    for b, n, d in shapes:
        out.append(x[start : start + b * n].reshape(b, n, d))
        start += b * n
    return out


def logits(model: Any, hidden: mx.array) -> mx.array:
    """The model's output head over `hidden` (a part `forward_together` returned)."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
