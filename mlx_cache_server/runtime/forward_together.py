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

Invariants: each part's cache takes its part's tokens, as a call of the model on that
part alone would give it, but for the last bits a matrix product's row may differ in
when the matrix has more rows; the result's part `i` is the last norm's output for part
`i`'s tokens, shaped as they came `(B, L, hidden)`, or None if it was not wanted.
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
        module.TransformerBlock in (type(layer), getattr(type(layer), "computes_as", None))
        and type(layer.self_attn) is module.Attention
        for layer in layers
    )


def forward_together(
    model: Any, parts: Sequence[Part], wanted: Sequence[bool] | None = None
) -> list[mx.array | None]:
    """The last norm's output for each part's tokens (None for a part not `wanted`; all are
    by default), each part's cache updated with its tokens.

    A part not wanted (a prompt's chunk, whose logits nobody reads) still takes its KV in
    every layer, but its rows leave the pass after the last layer's keys and values: its
    own pass, evaluated only for its cache, would never compute the rest either."""
    wanted = [True] * len(parts) if wanted is None else list(wanted)
    if len(wanted) != len(parts) or not any(wanted):
        raise ValueError("forward_together needs one flag per part, at least one part wanted")
    inner = model.model
    attend = sys.modules[type(model).__module__].scaled_dot_product_attention
    embedded = [inner.embed_tokens(tokens) for tokens, _ in parts]
    masks = [create_attention_mask(h, c[0]) for h, (_, c) in zip(embedded, parts, strict=True)]
    shapes = [h.shape for h in embedded]
    x = mx.concatenate([h.reshape(-1, h.shape[-1]) for h in embedded])
    every = [True] * len(parts)
    last = len(inner.layers) - 1
    for i, layer in enumerate(inner.layers):
        caches = [cache[i] for _, cache in parts]
        x = _layer(layer, attend, x, shapes, masks, caches, wanted if i == last else every)
    x = inner.norm(x)
    out: list[mx.array | None] = []
    start = 0
    for (b, n, d), keep in zip(shapes, wanted, strict=True):
        out.append(x[start : start + b * n].reshape(b, n, d) if keep else None)
        start += b * n if keep else 0
    return out


def _layer(
    layer: Any,
    attend: Any,
    x: mx.array,
    shapes: list[tuple[int, ...]],
    masks: list[Any],
    caches: list[Any],
    keep: list[bool],
) -> mx.array:
    """One block over the parts' rows `x`: every part's cache takes its keys and values;
    the rows of the parts kept go on through attention and the MLP, and are returned."""
    attn = layer.self_attn
    spans, start = [], 0
    for b, n, _ in shapes:
        spans.append(slice(start, start + b * n))
        start += b * n
    kept = [span for span, k in zip(spans, keep, strict=True) if k]

    def rows(a: mx.array) -> mx.array:
        return a if all(keep) else mx.concatenate([a[span] for span in kept])

    normed = layer.input_layernorm(x)
    keys, values = attn.k_proj(normed), attn.v_proj(normed)
    queries = attn.q_proj(rows(normed))
    outputs, q_start = [], 0
    for (b, n, _), span, mask, cache, k_ in zip(shapes, spans, masks, caches, keep, strict=True):
        k = keys[span].reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = values[span].reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset  # before the update moves it on
        k, v = cache.update_and_fetch(attn.rope(k, offset=offset), v)
        if not k_:
            continue
        q = queries[q_start : q_start + b * n].reshape(b, n, attn.n_heads, -1)
        q_start += b * n
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offset)
        out = attend(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(b * n, -1))
    h = rows(x) + attn.o_proj(mx.concatenate(outputs))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def logits(model: Any, hidden: mx.array) -> mx.array:
    """The model's output head over `hidden` (a part `forward_together` returned)."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
