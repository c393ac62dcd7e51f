"""The logits of some positions of a pass, without computing them for every position.

An mlx-lm model returns logits for each input position. Prefilling a chunk to
sample the next token needs only the last row; the others cost a chunk x
vocabulary matrix (100 MB for 512 tokens of a 49k vocabulary in float32) and
the matmul that fills it. A verification pass needs each row's live positions
only, not the fillers its rows are padded with. While the pass runs, the model's
output projection (`lm_head`, or the embedding used as one when tied) is given
those positions alone. Projections act on each position separately, so those
rows are unchanged. Models laid out otherwise are run as they are, and their
logits taken at those positions.

In the adapter because it sets attributes of mlx-lm's model objects for the pass
(`lm_head`, `embed_tokens.as_linear`); they are the model's own again after it,
raised or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

Select = Callable[[mx.array], mx.array]


class _Positions:
    def __init__(self, project: Callable[[mx.array], mx.array], select: Select) -> None:
        self.project, self.select = project, select

    def __call__(self, x: mx.array) -> mx.array:
        return self.project(self.select(x))


def _projecting(model: Any, inputs: mx.array, cache: list[Any], select: Select) -> mx.array:
    """The model's output for `inputs`, its head projecting `select(hidden)` only."""
    undo: list[Callable[[], None]] = []
    head = model.get("lm_head") if isinstance(model, nn.Module) else None
    if isinstance(head, nn.Module):
        model.lm_head = _Positions(head, select)
        undo.append(lambda: setattr(model, "lm_head", head))
    inner = model.get("model") if isinstance(model, nn.Module) else None
    embed = inner.get("embed_tokens") if isinstance(inner, nn.Module) else None
    if isinstance(embed, nn.Module) and hasattr(embed, "as_linear"):
        embed.as_linear = _Positions(embed.as_linear, select)
        undo.append(lambda: delattr(embed, "as_linear"))
    try:
        out = model(inputs, cache=cache)
    finally:
        for restore in reversed(undo):
            restore()
    return out if undo else select(out)


def last_logits(model: Any, inputs: mx.array, cache: list[Any]) -> mx.array:
    """`model(inputs, cache=cache)[:, -1, :]`, projecting only the last position."""
    return _projecting(model, inputs, cache, lambda x: x[:, -1:, :])[:, -1, :]


def positions_logits(model: Any, inputs: mx.array, cache: list[Any], at: mx.array) -> mx.array:
    """`model(inputs, cache=cache)` at the positions `at` of its (batch x positions) rows
    flattened, as (len(at), vocabulary), projecting only those positions."""

    def select(x: mx.array) -> mx.array:
        return x.reshape(-1, x.shape[-1])[at][None]

    out = _projecting(model, inputs, cache, select)
    # A model that has the head but makes its logits another way gives every position's.
    return (out if out.shape[:2] == (1, at.shape[0]) else select(out))[0]
