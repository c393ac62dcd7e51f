"""Prompt-lookup drafts: the tokens that followed the last time a sequence's latest tokens
appeared in it, and how many of them to try.

A coding agent's turn often writes back text it was just shown (a file with a line
changed, a diff, a quoted error), so the tokens after an earlier occurrence of the last
few generated tokens are a good guess at the next ones. Verifying a guess of k tokens
takes one forward pass over k+1 positions, on a CPU about the cost of one; every token
of it that matches what the model would have produced anyway is a decode step saved
(`speculative`).

Policy only, plain data, no MLX: `PromptLookup` indexes one sequence; `Pace` decides the
draft's length from how the last drafts fared, down to none for a while when they keep
failing, so that text the context does not predict is not decoded any slower.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_N, MAX_N = 2, 8  # lengths of the matched suffix: looked up by its last 2, longest wins
CANDIDATES = 16  # earlier occurrences of the last two tokens compared, latest first
MAX_DRAFT = 12  # tokens verified at most in one pass
PAUSE = 16  # steps without drafting after drafts kept failing


class PromptLookup:
    """Where each pair of a sequence's tokens ended, so that the tokens after an earlier
    occurrence of its last tokens are found at once: of the latest `CANDIDATES` earlier
    occurrences of its last two, the one whose match runs furthest back (up to MAX_N
    tokens), the latest of those.

    Invariant: `ends` holds the pairs that end before the sequence's last token, so a
    lookup of the last tokens finds an earlier occurrence, never the suffix itself. One
    entry a token: a long prompt is indexed in milliseconds."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; index the pairs that now end before the last one."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        seq = self.tokens
        for end in range(max(start, MIN_N), len(seq)):  # the pair ending at `end` (exclusive)
            self.ends.setdefault((seq[end - 2], seq[end - 1]), []).append(end)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the best earlier occurrence of the sequence's last
        tokens; [] when its last two never occurred before."""
        seq = self.tokens
        if len(seq) < MIN_N:
            return []
        best, best_run = None, 0
        for end in reversed(self.ends.get((seq[-2], seq[-1]), [])[-CANDIDATES:]):
            run = MIN_N
            while (run < min(MAX_N, len(seq) - 1) and end - run > 0
                   and seq[end - run - 1] == seq[-run - 1]):  # fmt: skip
                run += 1
            if run > best_run:
                best, best_run = end, run
            if run == MAX_N:
                break
        if best is None:
            return []
        # A match running into the sequence's end is a cycle of that period (a run of one
        # token, a repeated line): it goes on as one, not for just one period.
        period = len(seq) - best
        return [seq[best + i % period] for i in range(k)] if period < k else seq[best : best + k]


@dataclass
class Pace:
    """How many tokens one sequence drafts next, from how its drafts fared."""

    k: int = 4
    failed: int = 0  # drafts in a row of which nothing was accepted
    paused: int = 0  # steps left without drafting

    def next_length(self) -> int:
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def saw(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens of which the first `accepted` were right."""
        if accepted == drafted:
            self.k, self.failed = min(MAX_DRAFT, self.k + 2), 0
        elif accepted == 0:
            self.failed += 1
            self.k = max(1, self.k // 2)
            if self.failed >= 3:
                self.paused, self.failed = PAUSE, 0
        else:
            self.k, self.failed = max(1, accepted + 1), 0
