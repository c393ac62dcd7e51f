"""Prompt-lookup drafts: the tokens that followed the last time a sequence's latest tokens
appeared in it or in a reply its tenant was recently given, and how many of them to try.

A coding agent's turn often writes back text it was just shown (a file with a line
changed, a diff, a quoted error), so the tokens after an earlier occurrence of the last
few generated tokens are a good guess at the next ones. Verifying a guess of k tokens
takes one forward pass over k+1 positions, on a CPU about the cost of one; every token
of it that matches what the model would have produced anyway is a decode step saved
(`speculative`). A turn asked again (a retry, a second session) writes what an earlier
reply wrote, which its own prompt need not hold: those replies are looked in too
(`replies`).

Policy only, plain data, no MLX: `PromptLookup` indexes one sequence; `Pace` decides the
draft's length from how the last drafts fared, down to none for a while when they keep
failing, so that text the context does not predict is not decoded any slower, and keeps
the share of them accepted, which the batch's rule weighs (`speculative.draft_length`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import NON_TEXT

# Lengths of the matched suffix: looked up by its last 2, the longest wins. Followed far
# back, so that in text that repeats itself (a list, a reply asked for again) the place
# that lines up with the sequence wins over a later one that matches its last few tokens.
MIN_N, MAX_N = 2, 256
CANDIDATES = 16  # earlier occurrences of the last two tokens compared, latest first
# Tokens verified at most in one pass: with the token before them, as many queries as our
# CPU attention kernel takes a sequence (`kernel_attention.MAX_QUERIES`), which attends
# each as a single step does.
MAX_DRAFT = 15
PAUSE = 16  # steps without drafting after drafts kept failing
# A match running this far back: the sequence is copying earlier text (a file written back),
# which drafts as far as the match has run.
COPYING = 8
FORGET = 32  # steps over which a stream's acceptance rate drifts back to `ACCEPTED`
# The share of drafted tokens accepted where drafts are made (`python -m bench
# speculation`): what a stream expects before its own drafts have said otherwise.
ACCEPTED = 0.75


class PromptLookup:
    """Where each pair of a sequence's tokens ended, so that the tokens after an earlier
    occurrence of its last tokens are found at once: of the latest `CANDIDATES` earlier
    occurrences of its last two, the one whose match runs furthest back (up to MAX_N
    tokens), the latest of those. With `recent` texts (other replies of the same model and
    tenant: `replies`), an occurrence in one of them is a candidate too; whichever match
    runs further back drafts, a reply winning a tie, since it is what the model wrote after
    that context, where the prompt is what it was shown.

    Invariant: `ends` holds the pairs that end before the sequence's last token, so a
    lookup of the last tokens finds an earlier occurrence, never the suffix itself. One
    entry a token: a long prompt is indexed in milliseconds."""

    def __init__(self, recent: list[PromptLookup] | None = None) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = {}
        self.recent = recent or []

    def run(self, most: int = MAX_N) -> int:
        """How far back the best match of the sequence's last tokens runs, up to `most`
        (0: none); a pace reads no further than its longest draft (`Pace.next_length`)."""
        seq = self.tokens
        if len(seq) < MIN_N:
            return 0
        texts = [self, *self.recent]
        return max(_occurrence(text, seq, most)[1] for text in texts)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; index the pairs that now end before the last one."""
        start = len(self.tokens)
        # An image's positions are drafted from, and given to a draft model, as token 0.
        self.tokens.extend(t if t < NON_TEXT else 0 for t in tokens)
        seq = self.tokens
        for end in range(max(start, MIN_N), len(seq)):  # the pair ending at `end` (exclusive)
            self.ends.setdefault((seq[end - 2], seq[end - 1]), []).append(end)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the best earlier occurrence of the sequence's last
        tokens; [] when its last two never occurred before."""
        seq = self.tokens
        if len(seq) < MIN_N:
            return []
        best, run = _occurrence(self, seq)
        source = self
        for text in self.recent:
            end, longer = _occurrence(text, seq)
            if end is not None and (longer > run or longer == run and source is self):
                best, run, source = end, longer, text
        if best is None:
            return []
        if source is not self:
            return source.tokens[best : best + k]
        # A match running into the sequence's end is a cycle of that period (a run of one
        # token, a repeated line): it goes on as one, not for just one period.
        period = len(seq) - best
        return [seq[best + i % period] for i in range(k)] if period < k else seq[best : best + k]


def _occurrence(text: PromptLookup, seq: list[int], most: int = MAX_N) -> tuple[int | None, int]:
    """Of the latest `CANDIDATES` places in `text` where `seq`'s last two tokens end, the
    one whose match runs furthest back (up to `most`), the latest of those; and that run."""
    best, best_run = None, 0
    for end in reversed(text.ends.get((seq[-2], seq[-1]), [])[-CANDIDATES:]):
        run = _run(text.tokens, end, seq, most)
        if run > best_run:
            best, best_run = end, run
        if run == most:
            break
    return best, best_run


def _run(tokens: list[int], end: int, seq: list[int], most: int) -> int:
    """How many tokens of `tokens` before `end` equal the last ones of `seq` (at most
    `most`; `seq`'s own last token is never compared with itself: `end` is before it)."""
    run, most = 0, min(most, end, len(seq))
    while run < most and tokens[end - run - 1] == seq[-run - 1]:
        run += 1
    return run


@dataclass
class Pace:
    """How many tokens one sequence drafts next, from how its drafts fared."""

    k: int = 4
    failed: int = 0  # drafts in a row of which nothing was accepted
    paused: int = 0  # steps left without drafting
    rate: float = ACCEPTED  # the share of its drafted tokens accepted, recent drafts weighing most

    def next_length(self, run: int = 0) -> int:
        """The next draft's length; `run`: how far back the match of the sequence's latest
        tokens runs (`PromptLookup.run`), which from `COPYING` on is a copy under way, drafted
        as far as it has run, unless the last draft failed outright or drafts are paused
        (text that repeats without going on the same way).

        The rate moves with drafts verified, and at a rate the batch rule refuses to draft
        (`speculative.draft_length`) a stream would draft no more: each step it drifts back
        toward `ACCEPTED` (old evidence forgotten, more slowly than a failed draft lowers
        it), and a pause ends with it there."""
        self.rate += (ACCEPTED - self.rate) / FORGET
        if run >= COPYING and not self.failed and not self.paused:
            return max(self.k, min(MAX_DRAFT, run))
        if self.paused:
            self.paused -= 1
            if not self.paused:  # a fresh try
                self.rate = max(self.rate, ACCEPTED)
            return 0
        return self.k

    def saw(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens of which the first `accepted` were right."""
        self.rate += (accepted / drafted - self.rate) / 4
        if accepted == drafted:
            self.k, self.failed = min(MAX_DRAFT, self.k * 2), 0
        elif accepted == 0:
            self.failed += 1
            self.k = max(1, self.k // 2)
            if self.failed >= 3:
                self.paused, self.failed = PAUSE, 0
        else:
            self.k, self.failed = max(1, accepted + 1), 0
