"""A decode step that verifies drafts: each stream's next tokens in one pass.

mlx-lm's `GenerationBatch` decodes one token a sequence a step, the token it sampled at
the step before (`mlx_adapter.streams.next_tokens`) going in as the step's input. Here
each row's token goes in followed by a draft of k more (`drafting`), all rows in one
forward pass over k+1 positions. After each position the row's sampler draws the token
a plain step would have drawn there (greedy: the argmax; sampled: a draw from the row's
own filtered distribution, its key split once a draw as a plain step splits it); the
draft's tokens that equal those draws are the row's accepted ones, and the step emits,
for every row, its token and those.
A row without a draft (or with a shorter one) is filled out with tokens it never keeps,
which the pass does not compute where our kernels run it (`live_positions`) and does not
project to logits (`positions_logits`).
The rows share one KV index (`BatchKVCache` keeps one `_idx` for the batch): the positions
past the most any row accepted are trimmed off, and each row's own rejected ones below
that become gaps its masks hide (`gapped_cache`). A seeded sampler's key goes back to what
the kept draws left it, and each row's draw after its last emitted token becomes the next
step's input, as a plain step would have left it.

Why a drawn token equal to the draft is the rule for sampling too: a draft is one token,
not a distribution, and accepting it with the probability the model gives it (the
speculative-sampling rule for such a draft) is what a draw equal to it is; a draw that
differs is the model's own token, as the rule's draw from what is left would be. So
a reply has the distribution it has without drafts, and a seeded one is the same reply.

Invariants: every token emitted is the one plain steps would emit (chosen by the same
sampler, the same key for a seeded one, over the same context); the batch's caches hold,
gaps aside, the KV of exactly the tokens in `tokens` (what a finished sequence's cache
goes to the prompt cache with); `max_tokens` and the stop tokens end a sequence at the
token they would have, and nothing past it is emitted.

Only where trimming the caches undoes the rejected tokens (`BatchKVCache` layers), for
sequences without logits processors (a grammar, biases, penalties: they would have to see
each drafted token before it is verified), and for at most `MAX_ROWS` rows (`PADDED_ROWS`
where a pass computes its fillers).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from ..mlx_adapter.gapped_cache import GappedKVCache
from ..mlx_adapter.last_logits import positions_logits
from ..mlx_adapter.streams import finish_reason, next_logprobs, next_tokens, set_next
from ..runtime import cpu_logprobs
from ..runtime.live_positions import live_positions
from .drafting import ACCEPTED
from .sampling import Categorical

# A pass's rows and positions (rows times k+1) at most: as far as the pass-cost model
# below was measured (`python -m bench speculation --pass-cost` times one pass by rows and
# positions); PADDED_ROWS where a pass computes its fillers (`kernel_block.skips_fillers`).
MAX_ROWS, PADDED_ROWS, MAX_POSITIONS = 8, 4, 64
# A pass over B rows costs about 1 + PER_ROW * (B-1) times a lone stream's step, and
# PER_DRAFTED more for each drafted position of any row, or for each of its B x k
# positions past the first where it computes its fillers; nothing for the pass's width.
PER_DRAFTED, PER_ROW = 0.116, 0.22


def longest_draft(rows: int) -> int:
    """The longest draft a batch of `rows` sequences verifies."""
    return MAX_POSITIONS // rows - 1


def draft_length(lengths: list[int], rates: list[float] | None = None, padded: bool = False) -> int:
    """How many drafted tokens a step of streams with drafts this long (0: none) verifies,
    each stream's draft cut to it; 0 for a plain step. `rates`: the share of each stream's
    drafted tokens it expects accepted (`drafting.Pace.rate`; `ACCEPTED` each if None);
    `padded`: the pass computes its fillers, every row as long as the longest draft.

    Every stream's speed counts, not the batch's total: a stream's expected speed-up is its
    expected tokens over what the pass costs against a plain step (below 1 for a stream
    without a draft, which waits for the others' positions), and the length chosen makes
    the product of the streams' speed-ups largest (proportional fairness), so that a
    drafting stream does not buy its speed with a larger loss of the others'. A stream
    alone drafts what it has unless its drafts are nearly always wrong; beside three plain
    ones, a few tokens; streams that all draft, as far as the product gains."""
    rows = len(lengths)
    rates = rates or [ACCEPTED] * rows
    plain = 1 + PER_ROW * (rows - 1)
    best, best_gain = 0, 0.0
    for k in range(1, min(max(lengths, default=0), longest_draft(rows)) + 1):
        drafted = [min(n, k) for n in lengths]
        cost = (plain + PER_DRAFTED * (rows * k if padded else sum(drafted))) / plain
        gain = sum(math.log((1 + r * d) / cost) for d, r in zip(drafted, rates, strict=True))
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def can_verify(batch: GenerationBatch, most: int = MAX_ROWS) -> bool:
    """Whether `batch` has at most `most` sequences, none of them with logits processors,
    its samplers' draws can be undone, and its caches a trim rolls back."""
    n = len(batch.uids)
    return (
        0 < n <= most
        and next_tokens(batch) is not None
        and not any(batch.logits_processors or [])
        and all(_rewindable(s) for s in batch.samplers or [])
        and all(_trimmable(c) for c in batch.prompt_cache)
    )


def _rewindable(sampler: Any) -> bool:
    # Draws past the kept ones are undone by putting the key back: a sampler whose only
    # state is a `Categorical`'s key.
    return (
        sampler is None
        or isinstance(getattr(sampler, "__wrapped__", sampler), Categorical)
        or sampler is greedy_sampler
    )


def _trimmable(cache: Any) -> bool:
    # By its trim: subclasses that only change how a sequence is handed out qualify.
    return isinstance(cache, BatchKVCache) and type(cache).trim in (
        BatchKVCache.trim,
        GappedKVCache.trim,
    )


def verify(
    batch: GenerationBatch, drafts: list[list[int]]
) -> tuple[list[Any], list[int], list[int]]:
    """One step of `batch` (see `can_verify`) taking each row's draft in after its next
    token (a row without one, or with a shorter one, is filled out with tokens never
    kept): the responses of every token emitted, row by row; for each row how many of its
    draft's first tokens the model agreed with; and how many drafted tokens each row
    emitted (as many as it agreed with, or fewer where the row ended)."""
    k = max(len(d) for d in drafts)
    first, first_logprobs = next_tokens(batch), next_logprobs(batch)
    rows = mx.array([d + [0] * (k - len(d)) for d in drafts], dtype=first.dtype)
    inputs = mx.concatenate([first[:, None], rows], axis=1)
    lengths = [1 + len(d) for d in drafts]
    ragged = min(lengths) < k + 1
    if not ragged:
        logits = batch.model(inputs, cache=batch.prompt_cache)
    else:  # the fillers computed by no block that can skip them, projected by no head
        live, spread = _live(lengths, k + 1)
        with live_positions(lengths, k + 1):
            logits = positions_logits(batch.model, inputs, batch.prompt_cache, live)
    # B*(k+1) rows: numpy's vectorized exp where the CPU fast path is on (`cpu_logprobs`).
    logprobs = logits - cpu_logprobs.logsumexp(logits, axis=-1, keepdims=True)
    if ragged:  # a filler's, its row's last live position's: never read
        logprobs = logprobs[spread].reshape(len(drafts), k + 1, -1)
    chosen, keys = _drawn(batch, logprobs)
    mx.eval(chosen, logprobs, first_logprobs)
    model_says, firsts = chosen.tolist(), first.tolist()
    agreed = [_agreeing(d, says) for d, says in zip(drafts, model_says, strict=True)]
    most = max(agreed)
    rejected = [most - n for n in agreed]
    for c in batch.prompt_cache:  # the positions past every row's kept ones go, then each
        c.trim(k - most)  # row's own rejected ones become gaps
        if any(rejected):
            GappedKVCache.of(c).leave(rejected)
    for i, sampler, drawn in keys:
        sampler.key = drawn[agreed[i]]  # the key the kept draws left
    out, keep, used = [], [], []
    for i, (uid, draft, n) in enumerate(zip(batch.uids, drafts, agreed, strict=True)):
        tokens = [firsts[i], *draft[:n]]
        token_logprobs = [first_logprobs[i], *(logprobs[i, j] for j in range(n))]
        emitted, reason = _emitted(batch, i, tokens, token_logprobs)
        batch.tokens[i].extend(t for t, _ in emitted)
        used.append(len(emitted) - 1)
        out += [GenerationBatch.Response(uid, t, lp, None, None, None) for t, lp in emitted]
        if reason is None:
            keep.append(i)
            continue
        last = out[-1]
        last.finish_reason, last.all_tokens = reason, batch.tokens[i]
        last.prompt_cache = batch.extract_cache(i)
        for c in last.prompt_cache:  # the KV of what this row did not emit goes too
            c.trim(n + 1 - len(emitted))
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    if keep:
        kept = chosen[mx.array(keep), mx.array([agreed[i] for i in keep])]
        set_next(batch, kept, [logprobs[i, agreed[i]] for i in keep])
    return out, agreed, used


def _live(lengths: list[int], width: int) -> tuple[mx.array, mx.array]:
    """A pass's live positions (each row's first `lengths[b]` of `width`) in its rows
    flattened; and for each of its positions the live one it takes its logits from."""
    live, spread, start = [], [], 0
    for b, n in enumerate(lengths):
        live += range(b * width, b * width + n)
        spread += [start + min(t, n - 1) for t in range(width)]
        start += n
    return mx.array(live), mx.array(spread)


def _drawn(batch: GenerationBatch, logprobs: mx.array) -> tuple[mx.array, list[Any]]:
    """Each row's draw after each position, as a plain step's sampler would draw it there,
    and for each seeded sampler its key after each draw."""
    samplers = [s or greedy_sampler for s in batch.samplers or [None] * len(batch.uids)]
    if all(s is greedy_sampler for s in samplers):
        return mx.argmax(logprobs, axis=-1), []
    rows, keys = [], []
    for i, sampler in enumerate(samplers):
        if sampler is greedy_sampler:
            rows.append(mx.argmax(logprobs[i], axis=-1))
            continue
        own = getattr(sampler, "__wrapped__", sampler)
        draws, after = [], []
        for j in range(logprobs.shape[1]):  # one draw a position, in order: a key a draw
            draws.append(sampler(logprobs[i, j : j + 1]))
            after.append(getattr(own, "key", None))
        rows.append(mx.concatenate(draws))
        if after[0] is not None:
            keys.append((i, own, after))
    return mx.stack(rows), keys


def _agreeing(draft: list[int], model_says: list[int]) -> int:
    """How many of the draft's first tokens are the model's own choices."""
    n = 0
    while n < len(draft) and draft[n] == model_says[n]:
        n += 1
    return n


def _emitted(
    batch: GenerationBatch, i: int, tokens: list[int], logprobs: list[Any]
) -> tuple[list[tuple[int, Any]], str | None]:
    """Row i's tokens up to the one that ends it (its limit or a stop), and why it ended."""
    emitted, reason = [], None
    for token, lp in zip(tokens, logprobs, strict=True):
        reason = finish_reason(batch, i, token)
        emitted.append((token, lp))
        if reason is not None:
            break
    return emitted, reason
