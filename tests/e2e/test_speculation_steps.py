"""Verification steps in-process: `MixedGenerator` streams given drafts by oracles that
know the plain reply (right, wrong at chosen steps, missing some steps), each stream's
reply, end, KV and logprobs compared with plain steps': greedy, seeded, in batches, with
gaps, past the rows that verify together."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_speculation import SOURCE, pytestmark  # noqa: F401 (the same skip)


def generate_many(model, prompts: list[list[int]], limits: list[int], eos: int, oracles=None,
                  verified: list[int] | None = None, logprobs_out: list | None = None,
                  samplers: list | None = None):  # fmt: skip
    """Each stream's tokens, finish reason, final KV and tokens, the streams decoding in one
    batch, and the drafted tokens accepted; with `oracles`, one a stream, each a function of
    the tokens it generated so far that gives the step's draft (a step drafts when any
    stream's oracle gives one). `verified` gets the number of streams of each step that
    verified drafts, `logprobs_out` each stream's logprobs, a row a token; `samplers`, one a
    stream, sample (greedy without)."""
    import mlx.core as mx

    from mlx_cache_server.engine.generator import MixedGenerator
    from mlx_cache_server.engine.speculative import can_verify

    gen = MixedGenerator(model, speculation=oracles is not None, max_tokens=max(limits),
                         stop_tokens=[[eos]])  # fmt: skip
    uids = gen.insert(prompts, max_tokens=limits, samplers=samplers)
    if oracles is not None:

        def drafts() -> list[list[int]]:  # as `_drafts`, but the oracles', past the room left
            streams = gen._generation_batch
            if not can_verify(streams):
                return []
            out = []
            for i, uid in enumerate(streams.uids):
                j = uids.index(uid)
                out.append(oracles[j](len(streams.tokens[i]) + 1 - len(prompts[j])))
            if not any(out):
                return []
            if verified is not None:
                verified.append(len(out))
            return out

        gen._drafts = drafts
    accepted = []
    gen.on_verified = lambda uid, drafted, ok: accepted.append(ok)
    out, ends, logprobs = {u: [] for u in uids}, {}, {u: [] for u in uids}
    while len(ends) < len(uids):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                kv = [mx.array(c.keys[..., : c.offset, :]) for c in r.prompt_cache]
                ends[r.uid] = (r.finish_reason, kv, list(r.all_tokens))
    gen.close()
    if logprobs_out is not None:
        logprobs_out += [mx.stack(logprobs[u]) for u in uids]
    return [(out[u], ends[u]) for u in uids], sum(accepted)


def generate(model, prompt: list[int], limit: int, eos: int, oracle=None):
    """`generate_many` for a lone stream: its tokens, its end, the drafted tokens accepted."""
    [(out, end)], accepted = generate_many(model, [prompt], [limit], eos,
                                           None if oracle is None else [oracle])  # fmt: skip
    return out, end, accepted


def same_kv(a: list[Any], b: list[Any]) -> bool:
    import numpy as np

    return all(x.shape == y.shape and np.allclose(np.array(x), np.array(y), atol=1e-4)
               for x, y in zip(a, b, strict=True))  # fmt: skip


def assert_as_plain(got: list, plain: list, got_lp: list | None = None,
                    want_lp: list | None = None) -> None:  # fmt: skip
    """Each stream of `generate_many`'s `got` ended as in `plain`: its reply, why it ended, its
    tokens and its KV; and, given, its logprobs."""
    import numpy as np

    for (out, (reason, kv, tokens)), (want, (want_reason, want_kv, want_tokens)) in zip(
        got, plain, strict=True
    ):
        assert (out, reason, tokens) == (want, want_reason, want_tokens)
        assert same_kv(kv, want_kv)
    for a, b in zip(got_lp or [], want_lp or [], strict=True):
        assert a.shape == b.shape and np.allclose(np.array(a), np.array(b), atol=1e-4)


def oracle_of(want: list[int], eos: int, wrong_at: int | None, length: int = 5):
    """Drafts of the plain reply `want` (then end-of-text tokens past its end: more than the
    room left), one token made wrong at `wrong_at`."""

    def oracle(done: int) -> list[int]:
        draft = want[done : done + length] + [eos] * 8
        if wrong_at is not None and done <= wrong_at < done + len(draft):
            draft[wrong_at - done] = (draft[wrong_at - done] + 1) % 50
        return draft

    return oracle


@pytest.mark.parametrize("wrong_at", [None, 0, 3])
@pytest.mark.parametrize("limit", [7, 40])
def test_right_drafts_are_accepted_and_wrong_ones_cut_where_they_go_wrong(
    tiny_model, limit, wrong_at
):
    """Drafts from an oracle that knows the reply (one token made wrong at `wrong_at`): the
    reply, the reason it ended (its end-of-text token, or the limit, inside a draft) and
    the KV it leaves are those of plain steps."""
    model, tokenizer = tiny_model
    prompt = list(tokenizer.encode(SOURCE))
    eos = tokenizer.eos_token_id
    want, (reason, kv, tokens), _ = generate(model, prompt, limit, eos)
    oracle = oracle_of(want, eos, wrong_at)
    got, (got_reason, got_kv, got_tokens), accepted = generate(model, prompt, limit, eos, oracle)
    assert got == want and got_reason == reason and got_tokens == tokens
    assert accepted > 0
    assert same_kv(got_kv, kv)


def test_streams_verify_their_drafts_in_one_pass_as_plain_steps_decode(tiny_model):
    """Four streams of different lengths (left-padded rows), limits and drafts (one right
    throughout, the others wrong at different steps, of different lengths) verified
    together: each stream's reply, end and KV are those of the same batch's plain steps,
    as streams end inside a draft and the batch shrinks around them."""

    model, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    prompts = [list(tokenizer.encode(SOURCE[i:])) for i in (0, 9, 40, 75)]
    limits = [7, 30, 19, 26]  # the longest prompt ends first: the others' padding shifts
    want_lp, got_lp = [], []
    plain, _ = generate_many(model, prompts, limits, eos, logprobs_out=want_lp)
    wrong, lengths = [None, 2, 5, 11], [5, 3, 6, 4]
    oracles = [oracle_of(out, eos, at, n)
               for (out, _), at, n in zip(plain, wrong, lengths, strict=True)]  # fmt: skip
    verified = []
    got, accepted = generate_many(model, prompts, limits, eos, oracles, verified, got_lp)
    assert accepted > 0 and max(verified) == 4 and min(verified) < 4
    assert_as_plain(got, plain, got_lp, want_lp)


@pytest.mark.parametrize("close_up", [False, True])
def test_each_stream_keeps_what_it_accepted_and_streams_without_drafts_ride_along(
    tiny_model, monkeypatch, close_up
):
    """One stream never drafts, one drafts every other step, one is always right, one is
    wrong every third step: each keeps the drafted tokens it accepted, the positions it
    rejected left as gaps its mask hides (`close_up`: closed up as soon as there are two);
    replies, ends, KV and logprobs are those of plain steps."""

    from mlx_cache_server.mlx_adapter import gapped_cache
    from mlx_cache_server.mlx_adapter.gapped_cache import GappedKVCache

    gapped, closed = [], []
    leave, compact = GappedKVCache.leave, GappedKVCache.compact
    monkeypatch.setattr(GappedKVCache, "leave",
                        lambda c, r: (gapped.append(any(r)), leave(c, r))[1])  # fmt: skip
    monkeypatch.setattr(GappedKVCache, "compact", lambda c: (closed.append(1), compact(c))[1])
    if close_up:
        monkeypatch.setattr(gapped_cache, "MIN_GAPS", 2)
        monkeypatch.setattr(gapped_cache, "GAP_SHARE", 0.0)
    model, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    prompts = [list(tokenizer.encode(SOURCE[i:])) for i in (0, 9, 40, 75)]
    limits = [30, 24, 19, 40]
    want_lp, got_lp = [], []
    plain, _ = generate_many(model, prompts, limits, eos, logprobs_out=want_lp)
    replies = [out for out, _ in plain]

    def every_other(done: int) -> list[int]:
        return oracle_of(replies[1], eos, None, 3)(done) if done % 2 else []

    def wrong_often(done: int) -> list[int]:
        draft = replies[3][done : done + 3] + [eos] * 3
        return draft if done % 3 else [draft[0], (draft[1] + 1) % 50, *draft[2:]]

    oracles = [lambda done: [], every_other, oracle_of(replies[2], eos, None, 3), wrong_often]
    got, accepted = generate_many(model, prompts, limits, eos, oracles, [], got_lp)
    assert accepted > 0 and any(gapped) and bool(closed) == close_up
    assert_as_plain(got, plain, got_lp, want_lp)


def test_seeded_sampled_streams_verify_drafts_as_plain_steps_draw(tiny_model):
    """Streams sampling from their own seeds (one greedy beside them) verify drafts of their
    plain replies, wrong at different steps: each draw a drafted token is checked against
    is the one a plain step draws, and the key goes back to what the kept draws left it,
    so replies, ends and KV are those of plain steps."""
    from mlx_cache_server.engine.sampling import make_sampler

    model, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    prompts = [list(tokenizer.encode(SOURCE[i:])) for i in (0, 9, 40)]
    limits = [30, 19, 26]

    def samplers():  # fresh keys for each run
        return [make_sampler(0.9, seed=1), make_sampler(0.0),
                make_sampler(1.2, top_p=0.8, top_k=30, seed=2)]  # fmt: skip

    plain, _ = generate_many(model, prompts, limits, eos, samplers=samplers())
    again, _ = generate_many(model, prompts, limits, eos, samplers=samplers())
    assert [out for out, _ in plain] == [out for out, _ in again]
    oracles = [oracle_of(out, eos, at, n)
               for (out, _), at, n in zip(plain, [None, 2, 6], [4, 3, 5], strict=True)]  # fmt: skip
    verified = []
    got, accepted = generate_many(model, prompts, limits, eos, oracles, verified, None, samplers())
    assert accepted > 0 and max(verified) == 3
    assert_as_plain(got, plain)


def test_a_sampler_whose_draws_cannot_be_undone_decodes_plainly(tiny_model):
    """Verifying draws past the tokens kept; only a `Categorical`'s key can be put back, so a
    stream with any other sampler (its own state unknown) is not drafted for."""
    import mlx.core as mx

    from mlx_cache_server.engine.sampling import make_sampler

    model, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    prompts = [list(tokenizer.encode(SOURCE))]

    def own(logprobs):  # not a `Categorical`: whatever state it has cannot be put back
        return mx.argmax(logprobs, axis=-1)

    plain, _ = generate_many(model, prompts, [20], eos, samplers=[own])
    verified = []
    oracles = [oracle_of(plain[0][0], eos, None)]
    got, _ = generate_many(model, prompts, [20], eos, oracles, verified, None, [own])
    assert got[0][0] == plain[0][0] and verified == []
    seeded, _ = generate_many(model, prompts, [20], eos, oracles, verified, None,
                              [make_sampler(0.7, seed=3)])  # fmt: skip
    assert verified  # the same stream with a `Categorical` drafts


def test_more_streams_than_verify_together_decode_plainly(tiny_model):
    """Past `MAX_ROWS` streams every step is a plain one, until streams end."""
    from mlx_cache_server.engine.speculative import MAX_ROWS

    model, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    prompts = [list(tokenizer.encode(SOURCE[i:])) for i in range(MAX_ROWS + 1)]
    limits = [4 + 3 * i for i in range(len(prompts))]  # one ends, then the others verify
    plain, _ = generate_many(model, prompts, limits, eos)
    oracles = [oracle_of(out, eos, None) for out, _ in plain]
    verified = []
    got, accepted = generate_many(model, prompts, limits, eos, oracles, verified)
    for (out, (reason, kv, _)), (want, (want_reason, want_kv, _)) in zip(got, plain, strict=True):
        assert (out, reason) == (want, want_reason) and same_kv(kv, want_kv)
    assert verified and max(verified) <= MAX_ROWS
