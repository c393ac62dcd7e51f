"""Drafts from a small model of the same tokenizer (`--draft-model`), for a lone stream.

Where prompt lookup finds nothing to draft from, the draft model guesses the next
`--num-draft-tokens` greedily; the target model verifies them as it verifies a lookup
draft (`speculative`). The draft model keeps its own KV of the sequence: it catches up
on the tokens it has not seen (the whole prompt, at a request's first draft), and after
a verification keeps the KV of the drafted tokens that were accepted only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

CHUNK = 512  # tokens the draft model takes in at once while catching up


class DraftModel:
    """The draft model and how many tokens it drafts a step."""

    def __init__(self, model: Any, tokens: int) -> None:
        if tokens < 1:
            raise ValueError("--num-draft-tokens must be at least 1")
        if not all(type(c) is KVCache for c in make_prompt_cache(model)):
            raise ValueError(
                "the draft model must have plain attention layers only (no sliding windows or "
                "recurrent state): its KV is cut back after each verification"
            )
        self.model, self.tokens = model, tokens

    def start(self) -> DraftState:
        return DraftState(self)


class DraftState:
    """One sequence's draft-model KV: `fed` tokens of the sequence, then `proposed` drafted
    tokens of the last draft, not yet known to be right."""

    def __init__(self, source: DraftModel) -> None:
        self.model = source.model
        self.cache = make_prompt_cache(source.model)
        self.fed = self.proposed = 0

    def draft(self, sequence: list[int], k: int) -> list[int]:
        """k greedy tokens after `sequence` (the tokens so far, the next one included)."""
        self.accept(0)  # a draft of others' never verified: none of ours stands
        new = sequence[self.fed :]
        for at in range(0, len(new) - 1, CHUNK):  # catching up: all but the last token
            self.model(mx.array(new[at : min(at + CHUNK, len(new) - 1)])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        y = self._next(new[-1:])
        out = [y]
        for _ in range(k - 1):
            y = self._next([y])
            out.append(y)
        self.fed, self.proposed = len(sequence), k - 1
        return out

    def accept(self, accepted: int) -> None:
        """The verification accepted the first `accepted` drafted tokens."""
        keep = min(accepted, self.proposed)
        for c in self.cache:
            c.trim(self.proposed - keep)
        self.fed += keep
        self.proposed = 0

    def _next(self, tokens: list[int]) -> int:
        logits = self.model(mx.array(tokens)[None], cache=self.cache)
        return int(mx.argmax(logits[0, -1]).item())
