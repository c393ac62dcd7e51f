"""The logits of a chunk's last position, without computing them for every position.

An mlx-lm model returns logits for each input position. Prefilling a chunk to
sample the next token needs only the last row; the others cost a chunk x
vocabulary matrix (100 MB for 512 tokens of a 49k vocabulary in float32) and
the matmul that fills it. While the chunk runs, the model's output projection
(`lm_head`, or the embedding used as one when tied) is given the last position
alone. Projections act on each position separately, so that row is unchanged.
Models laid out otherwise are run as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _LastPosition:
    def __init__(self, project: Callable[[mx.array], mx.array]) -> None:
        self.project = project

    def __call__(self, x: mx.array) -> mx.array:
        return self.project(x[:, -1:, :])


def last_logits(model: Any, inputs: mx.array, cache: list[Any]) -> mx.array:
    """`model(inputs, cache=cache)[:, -1, :]`, projecting only the last position."""
    undo: list[Callable[[], None]] = []
    head = model.get("lm_head") if isinstance(model, nn.Module) else None
    if isinstance(head, nn.Module):
        model.lm_head = _LastPosition(head)
        undo.append(lambda: setattr(model, "lm_head", head))
    inner = model.get("model") if isinstance(model, nn.Module) else None
    embed = inner.get("embed_tokens") if isinstance(inner, nn.Module) else None
    if isinstance(embed, nn.Module) and hasattr(embed, "as_linear"):
        embed.as_linear = _LastPosition(embed.as_linear)
        undo.append(lambda: delattr(embed, "as_linear"))
    try:
        return model(inputs, cache=cache)[:, -1, :]
    finally:
        for restore in reversed(undo):
            restore()
