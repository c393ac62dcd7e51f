"""The draft model's batch: drafts for several streams at once are each stream's own greedy
continuation, whatever joined, left, took or rejected before."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from app.engine.draft_model import BEHIND, FEED, DraftBatch, DraftModel


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load(str(tiny_model_dir))[0]


def greedy(model, sequence: list[int], k: int) -> list[int]:
    """k greedy tokens after `sequence`, the draft model alone over a fresh cache."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(sequence)[None], cache=cache)
    out = []
    for _ in range(k):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array(out[-1:])[None], cache=cache)
    return out


def test_a_batchs_drafts_are_each_sequences_own_through_joins_leaves_and_rejections(model):
    rng = random.Random(0)
    batch = DraftBatch(DraftModel(model, 4))
    seqs = {u: [rng.randrange(3, 90) for _ in range(n)] for u, n in [(1, 9), (2, 30), (3, 3)]}
    uids = [1, 2]
    for step in range(12):
        if step == 3:
            uids = [1, 2, 3]  # a stream joins
        if step == 6:
            uids = [3, 1]  # one leaves, and the order changes
        if step == 9:
            seqs[4] = [rng.randrange(3, 90) for _ in range(17)]
            uids = [4, 3, 1]
        k = 1 + step % 4
        drafts = batch.draft(uids, [seqs[u] for u in uids], k)
        assert drafts == [greedy(model, seqs[u], k) for u in uids], step
        for u, d in zip(uids, drafts, strict=True):
            taken = rng.randrange(0, k + 1)  # what the target agreed with, then its own token
            seqs[u] += d[:taken] + [rng.randrange(3, 90)]
    assert batch.uids == uids


def test_a_row_far_behind_is_fed_without_a_draft(model):
    batch = DraftBatch(DraftModel(model, 3))
    seqs = [[5, 6, 7, 8], [9, 10, 11]]
    batch.draft([1, 2], seqs, 2)
    assert batch.draft([1, 2], [s + [12] for s in seqs], 0) == [[], []]
    assert batch.fed == [4, 3]  # not behind: nothing fed
    seqs = [s + [12] for s in seqs]
    seqs[0] += list(range(20, 20 + BEHIND + 1))
    assert batch.draft([1, 2], seqs, 0) == [[], []]
    assert batch.fed == [len(s) - 1 for s in seqs]  # all but the last, fed
    assert batch.draft([1, 2], seqs, 3) == [greedy(model, s, 3) for s in seqs]
    seqs[0] = seqs[0] + [7]  # a step's token, and steps lookup drafted for row 1 alone
    seqs[1] = seqs[1] + list(range(30, 30 + 3 * FEED))
    assert batch.draft([1, 2], seqs, 2) == [greedy(model, s, 2) for s in seqs]
    assert batch.fed == [len(s) for s in seqs]


def test_a_plain_step_that_took_a_drafted_token_leaves_the_next_one_to_draft_from(model):
    batch = DraftBatch(DraftModel(model, 3))
    seq = [5, 6, 7, 8]
    first = batch.draft([1], [seq], 3)[0]
    seq = seq + first[:1]  # no verification: a plain step drew the draft's first token
    assert batch.draft([1], [seq], 2) == [greedy(model, seq, 2)]
