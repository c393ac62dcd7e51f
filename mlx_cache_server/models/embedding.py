"""Embedding models run by mlx-lm: a decoder's hidden states, pooled into one vector per input.

Decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are architectures mlx-lm
already loads; what makes one an embedding model is its pooling, which its
sentence-transformers files name (`modules.json`, `1_Pooling/config.json`): the last token's
hidden state, the mean over tokens, or the first token's, then usually an L2 normalization.

Inputs are batched right-padded: in a causal model a token never attends to the padding after
it, so an input's hidden states are the same alone or in any batch.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

PoolingMode = Literal["last", "mean"]
BATCH_TOKENS = 8192  # padded tokens in one forward pass, bounding its activations
CHUNK = 512  # a longer input runs alone, this many tokens at a time over its KV: attention's
# scores stay chunk x length instead of length x length


@dataclass(frozen=True)
class Pooling:
    mode: PoolingMode = "last"
    normalize: bool = True


def sentence_transformers_pooling(folder: Path) -> Pooling | None:
    """The pooling a sentence-transformers model folder declares; None if it declares none.
    A ValueError for what a causal model run by mlx-lm cannot reproduce."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(modules, list):
        return None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    others = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if others:  # a Dense projection, say: vectors without it would be silently wrong
        raise ValueError(f"its sentence-transformers modules {sorted(others)} are not supported")
    try:
        config = json.loads((folder / kinds["Pooling"].get("path", "") / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    modes = {k for k, v in config.items() if k.startswith("pooling_mode_") and v}
    if modes == {"pooling_mode_lasttoken"}:
        mode: PoolingMode = "last"
    elif modes == {"pooling_mode_mean_tokens"}:
        mode = "mean"
    else:  # cls: a causal model's first token sees nothing else; max and the rest: not here
        raise ValueError(f"its pooling {sorted(modes)} is not supported (last token or mean)")
    return Pooling(mode, normalize="Normalize" in kinds)


def pool(hidden: mx.array, lengths: list[int], mode: PoolingMode) -> mx.array:
    """One vector per row of right-padded hidden states (batch, tokens, width)."""
    if mode == "last":
        return hidden[mx.arange(hidden.shape[0]), mx.array(lengths) - 1]
    mask = mx.arange(hidden.shape[1])[None, :] < mx.array(lengths)[:, None]
    total = (hidden * mask[..., None]).sum(axis=1)
    return total / mx.array(lengths, dtype=hidden.dtype)[:, None]


class Embedder:
    """A loaded embedding model: token lists in, float32 vectors out. Thread-safe."""

    def __init__(self, model: Any, tokenizer: Any, pooling: Pooling, context_length: int) -> None:
        if not callable(getattr(model, "model", None)):
            raise ValueError(
                "this model's architecture does not expose its hidden states to mlx-lm "
                "(no inner `model`): it cannot serve embeddings"
            )
        self.model, self.tokenizer = model, tokenizer
        self.pooling, self.context_length = pooling, context_length
        self.pad = getattr(tokenizer, "pad_token_id", None) or 0
        self.in_flight = 0  # requests between their check and their answer (`ModelPool`)
        self._lock = threading.Lock()  # one forward pass at a time: they use every core anyway

    @property
    def width(self) -> int:
        return int(self.model.args.hidden_size)

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input, in order; inputs must be non-empty and fit the context."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out: list[list[float]] = [[] for _ in inputs]
        long = [i for i in order if len(inputs[i]) > CHUNK]
        for i in long:
            out[i] = self._chunked(inputs[i])
        order = order[: len(order) - len(long)]
        start = 0
        while start < len(order):
            end = start + 1  # the longest of a batch sets its padded size: sorted, it is last
            while end < len(order) and (end - start + 1) * len(inputs[order[end]]) <= BATCH_TOKENS:
                end += 1
            batch = [inputs[i] for i in order[start:end]]
            for i, vector in zip(order[start:end], self._forward(batch), strict=True):
                out[i] = vector
            start = end
        return out

    def _chunked(self, tokens: list[int]) -> list[float]:
        """One long input, CHUNK tokens at a time over its own KV: in a causal model each
        token's hidden state is the same as in one pass."""
        from mlx_lm.models.cache import make_prompt_cache

        with self._lock:
            cache = make_prompt_cache(self.model)
            total, last = None, None
            for start in range(0, len(tokens), CHUNK):
                chunk = mx.array([tokens[start : start + CHUNK]])
                hidden = self.model.model(chunk, cache=cache)[0].astype(mx.float32)
                last = hidden[-1]
                total = hidden.sum(axis=0) if total is None else total + hidden.sum(axis=0)
                mx.eval(total, last)
            vector = last if self.pooling.mode == "last" else total / len(tokens)
            if self.pooling.normalize:
                vector = vector / mx.maximum(mx.linalg.norm(vector), 1e-12)
            mx.eval(vector)
        return vector.tolist()

    def _forward(self, batch: list[list[int]]) -> list[list[float]]:
        lengths = [len(tokens) for tokens in batch]
        width = max(lengths)
        padded = mx.array([tokens + [self.pad] * (width - len(tokens)) for tokens in batch])
        with self._lock:
            hidden = self.model.model(padded).astype(mx.float32)
            vectors = pool(hidden, lengths, self.pooling.mode)
            if self.pooling.normalize:
                norm = mx.linalg.norm(vectors, axis=-1, keepdims=True)
                vectors = vectors / mx.maximum(norm, 1e-12)
            mx.eval(vectors)
        return vectors.tolist()
