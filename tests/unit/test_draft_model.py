"""The draft model's batch: drafts for several streams at once are each stream's own greedy
continuation, whatever joined, left, took or rejected before."""

from __future__ import annotations

import random

import pytest
from mlx_lm import load

from mlx_cache_server.engine.draft_model import BEHIND, FEED, DraftBatch, DraftModel
from tests.helpers import greedy_alone


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load(str(tiny_model_dir))[0]


def greedy(model, sequence: list[int], k: int) -> list[int]:
    """k greedy tokens after `sequence`, the draft model alone over a fresh cache."""
    return greedy_alone(model, sequence, k)


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


def test_the_draft_model_keeps_rows_only_for_streams_that_asked_it():
    """A stream that lookup drafts for costs the draft model no row (no prefill of its
    prompt); one that asked keeps its row while it runs; the rows go with their streams."""
    from types import SimpleNamespace

    from mlx_cache_server.engine.drafting import PromptLookup
    from mlx_cache_server.engine.generator import MixedGenerator

    calls = []

    class Rows:  # stands in for `DraftBatch`: what the generator asks of it
        def draft(self, uids, sequences, k):
            calls.append((list(uids), k))
            return [[9] * k for _ in uids]

    def lookup(tokens):
        text = PromptLookup()
        text.extend(tokens)
        return (text, None, None)

    gen = SimpleNamespace(_model_uids=set(), _model_batch=None, _modelled=[],
                          draft_model=SimpleNamespace(start=Rows),
                          _drafting={u: lookup([u, u + 1]) for u in (1, 2, 3)})  # fmt: skip
    step = MixedGenerator._model_drafts

    gen._modelled = [False, True, False]  # lookup drafted for 1 and 3
    assert step(gen, [1, 2, 3], [[5], [], [6, 6]], [0, 2, 0]) == [[5], [9, 9], [6, 6]]
    assert calls[-1] == ([2], 2)
    gen._modelled = [False, False, True]  # 2 keeps its row; 3 asks now
    step(gen, [1, 2, 3], [[5], [7], []], [0, 0, 3])
    assert calls[-1] == ([2, 3], 3)
    gen._modelled = [False]
    step(gen, [1], [[5]], [0])  # 2 and 3 ended: their rows go, and the batch with them
    assert gen._model_batch is None and len(calls) == 2
