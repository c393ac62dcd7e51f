"""Drafts from a small model of the same tokenizer (`--draft-model`), for the streams of a batch.

Where prompt lookup finds nothing to draft from, the draft model guesses a stream's next
tokens greedily; the target model verifies them as it verifies a lookup draft
(`speculative`). The draft model keeps its own KV of every stream it drafted for, one
row a stream, in one batch cache (`DraftBatch`), so a step's drafts for several streams
are one pass of the draft model a drafted token. A stream the batch has not seen is
caught up alone (its whole sequence, at its first draft); after that each pass feeds
each row only the tokens it has not seen, and a draft's tokens the sequence did not take
become gaps (`gapped_cache`), as a verification's rejected ones do in the target's cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..mlx_adapter.gapped_cache import GappedKVCache

CHUNK = 512  # tokens the draft model takes in at once while catching a stream up
# Tokens a row takes in at once after that: at most as many queries a sequence as our CPU
# attention kernel takes (`kernel_attention.MAX_QUERIES`), and a bounded pass for a batch
# whose rows fell far behind.
FEED = 16
# A row this many tokens behind its sequence (the streams drafted from prompt lookup for a
# while) is fed, drafting or not: a later draft's pass covers every row's unseen tokens.
BEHIND = 32


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

    def start(self) -> DraftBatch:
        return DraftBatch(self)


class DraftBatch:
    """The draft model's KV of the streams it drafts for, one row a stream (`uids`, in the
    generation batch's order as of the last call).

    Invariant: row i's cache holds, gaps aside, the KV of the first `fed[i]` tokens of its
    stream's sequence and then of `proposed[i]`, the last draft's tokens but its last; the
    next call keeps of those as many as the sequence took."""

    def __init__(self, source: DraftModel) -> None:
        self.model = source.model
        self.uids: list[int] = []
        self.cache: list[GappedKVCache] = []
        self.fed: list[int] = []
        self.proposed: list[list[int]] = []

    def draft(self, uids: list[int], sequences: list[list[int]], k: int) -> list[list[int]]:
        """k greedy tokens after each of `sequences` (stream `uids[i]`'s tokens so far, its
        next one included), one pass of the draft model a token. k = 0 drafts nothing; it
        feeds the rows their unseen tokens but the last where one has fallen `BEHIND`."""
        if k == 0 and not self._behind(uids, sequences):
            return [[] for _ in uids]
        self._follow(uids, sequences)
        self._settle(sequences)
        # Feeding only, the last tokens are left for the next draft, for the logits after them.
        ends = [len(s) - (k == 0) for s in sequences]
        while True:
            new = [s[f:e] for s, f, e in zip(sequences, self.fed, ends, strict=True)]
            if max(len(n) for n in new) <= FEED:
                break
            self._feed([n[: max(0, min(len(n) - 1, FEED))] for n in new])  # a row far behind
            mx.eval([c.state for c in self.cache])
        if k == 0:
            if max(len(n) for n in new):
                self._feed(new)
                mx.eval([c.state for c in self.cache])
            return [[] for _ in uids]
        logits = self._feed(new)
        last = mx.array([len(n) - 1 for n in new])
        y = mx.argmax(logits[mx.arange(len(new)), last], axis=-1)
        out = [y]
        for _ in range(k - 1):
            mx.async_eval(y)
            y = mx.argmax(self.model(y[:, None], cache=self.cache)[:, -1], axis=-1)
            out.append(y)
        drafts = mx.stack(out, axis=1).tolist()
        self.proposed = [d[:-1] for d in drafts]
        return drafts

    def _feed(self, pieces: list[list[int]]) -> mx.array:
        """One pass over each row's next `pieces[i]` (right-filled to the longest, the
        fillers' KV made gaps); its logits."""
        width = max(len(p) for p in pieces)
        inputs = mx.array([p + [0] * (width - len(p)) for p in pieces])
        logits = self.model(inputs, cache=self.cache)
        self._drop([width - len(p) for p in pieces])
        self.fed = [f + len(p) for f, p in zip(self.fed, pieces, strict=True)]
        return logits

    def _behind(self, uids: list[int], sequences: list[list[int]]) -> bool:
        rows = dict(zip(self.uids, self.fed, strict=True))
        return any(
            len(s) - rows[u] > BEHIND for u, s in zip(uids, sequences, strict=True) if u in rows
        )

    def _follow(self, uids: list[int], sequences: list[list[int]]) -> None:
        """Rows for exactly `uids`, in their order: gone streams' rows dropped, new streams
        caught up alone and added."""
        if uids == self.uids:
            return
        kept = [u for u in uids if u in self.uids]
        rows = [self.uids.index(u) for u in kept]
        fed = [self.fed[r] for r in rows]
        proposed = [self.proposed[r] for r in rows]
        if kept:
            for c in self.cache:
                c.filter(rows)
        else:
            self.cache = []
        for uid, sequence in zip(uids, sequences, strict=True):
            if uid in kept:
                continue
            caught = self._caught_up(sequence)
            if self.cache:
                for c, theirs in zip(self.cache, caught, strict=True):
                    c.extend(theirs)
            else:
                self.cache = caught
            kept.append(uid)
            fed.append(len(sequence) - 1)
            proposed.append([])
        order = [kept.index(u) for u in uids]
        if order != list(range(len(uids))):
            for c in self.cache:
                c.filter(order)
        self.uids = list(uids)
        self.fed = [fed[r] for r in order]
        self.proposed = [proposed[r] for r in order]

    def _caught_up(self, sequence: list[int]) -> list[GappedKVCache]:
        """A one-row batch cache of the KV of `sequence` but its last token."""
        cache = make_prompt_cache(self.model)
        body = sequence[:-1]
        for at in range(0, len(body), CHUNK):
            self.model(mx.array(body[at : at + CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
        return [GappedKVCache.of(GappedKVCache.merge([c])) for c in cache]

    def _settle(self, sequences: list[list[int]]) -> None:
        """Keep of each row's last draft the tokens its sequence took, in order, but its
        last token: the next pass feeds that, for the logits after it."""
        kept = []
        for s, f, p in zip(sequences, self.fed, self.proposed, strict=True):
            n = 0
            while n < len(p) and f + n < len(s) - 1 and s[f + n] == p[n]:
                n += 1
            kept.append(n)
        self._drop([len(p) - n for p, n in zip(self.proposed, kept, strict=True)])
        self.fed = [f + n for f, n in zip(self.fed, kept, strict=True)]
        self.proposed = [[] for _ in self.fed]

    def _drop(self, counts: list[int]) -> None:
        """Undo each row's last `counts[i]` positions: the batch's index comes back by what
        every row drops, each row's other ones become gaps."""
        common = min(counts)
        for c in self.cache:
            c.trim(common)
            c.leave([n - common for n in counts])
