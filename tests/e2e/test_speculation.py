"""Prompt-lookup speculation: streams verify drafts in one pass, and their output is what
it is without speculation, token for token (greedy, or sampled from a seed), with stops,
limits, logprobs, a grammar, batches, a cancel, and the KV the next turn finds in the cache."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.engine import Delta, Failed, Finished, SamplingParams, Started
from app.runtime.blas import describe as describe_blas
from app.server import build_engine
from app.settings import Settings
from tests.helpers import wait_until

# Without a fast BLAS the server turns speculation off (a pass over a draft costs more).
pytestmark = pytest.mark.skipif(
    not describe_blas()[1],
    reason="speculation is off without OpenBLAS (apt-get install libopenblas0-pthread)",
)

# Text a reply can copy from its prompt: what prompt lookup drafts from.
SOURCE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 6


@dataclass
class Run:
    text: str = ""
    started: Started | None = None
    finished: Finished | None = None
    logprobs: list[Any] = field(default_factory=list)
    deltas: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event: Any) -> None:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Delta):
            self.text += event.text
            self.logprobs += event.logprobs
            self.deltas += 1
        elif isinstance(event, Finished | Failed):
            self.finished = event if isinstance(event, Finished) else None
            self.done.set()


def engine_for(model_dir: str, speculation: bool, **settings: Any):
    engine = build_engine(Settings(speculation=speculation, **settings), model_dir)
    engine.start()
    return engine


def ask(engine, tokens: list[int], **params: Any) -> Run:
    run = Run()
    engine.submit(tokens, SamplingParams(**{"temperature": 0.0, **params}), run)
    assert run.done.wait(300)
    return run


def prompt_of(engine, text: str = SOURCE) -> list[int]:
    return list(engine.tokenizer.encode("Copy this:\n" + text + "\nCopy:\n" + text[:40]))


@pytest.fixture(scope="module", params=["tiny", "default"])
def engines(request, tiny_model_dir):
    from app.models.default_model import default_model_dir

    model = str(tiny_model_dir if request.param == "tiny" else default_model_dir())
    on, off = engine_for(model, True), engine_for(model, False)
    yield on, off, request.param
    on.stop()
    off.stop()


def test_greedy_output_is_the_same_with_drafts_verified(engines):
    on, off, model = engines
    tokens = prompt_of(on)
    got, want = ask(on, tokens, max_tokens=96), ask(off, tokens, max_tokens=96)
    assert got.text == want.text
    assert got.finished.reason == want.finished.reason
    assert got.finished.completion_tokens == want.finished.completion_tokens
    # Drafts were verified: the default model copies the source back, so most are right;
    # the tiny random model does not, so its drafts are rejected and trimmed off.
    assert got.finished.drafted > 0 and want.finished.drafted == 0
    if model == "default":
        assert got.finished.accepted > got.finished.drafted // 3


@pytest.mark.parametrize("limit", [1, 2, 7, 13])
def test_max_tokens_ends_inside_a_draft_where_it_would_without(engines, limit):
    on, off, _ = engines
    tokens = prompt_of(on)
    got, want = ask(on, tokens, max_tokens=limit), ask(off, tokens, max_tokens=limit)
    assert (got.text, got.finished.reason) == (want.text, want.finished.reason)
    assert got.finished.completion_tokens == want.finished.completion_tokens == limit


def test_a_stop_string_inside_a_draft_ends_the_reply_where_it_would_without(engines):
    on, off, _ = engines
    tokens = prompt_of(on)
    whole = ask(off, tokens, max_tokens=64).text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    got, want = ask(on, tokens, max_tokens=64, stop=[stop]), ask(off, tokens, max_tokens=64,
                                                                 stop=[stop])  # fmt: skip
    assert (got.text, got.finished.reason) == (want.text, want.finished.reason) != ("", None)
    assert got.finished.stop_sequence == want.finished.stop_sequence == stop


def test_logprobs_of_drafted_tokens_are_the_models(engines):
    on, off, model = engines
    tokens = prompt_of(on)
    got, want = ask(on, tokens, max_tokens=40, logprobs=3), ask(off, tokens, max_tokens=40,
                                                                logprobs=3)  # fmt: skip
    assert got.text == want.text
    assert got.finished.accepted > 0 if model == "default" else got.finished.drafted > 0
    assert [lp.token for lp in got.logprobs] == [lp.token for lp in want.logprobs]
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [c.token for c in a.top] == [c.token for c in b.top]


def test_the_next_turn_finds_what_was_emitted_in_the_cache(engines):
    on, off, _ = engines
    tokens = prompt_of(on, SOURCE[:200])
    results = []
    for engine in (on, off):
        first = ask(engine, tokens, max_tokens=48)
        follow = tokens + list(engine.tokenizer.encode(first.text, add_special_tokens=False))
        second = ask(engine, follow + [5, 6, 7], max_tokens=4)
        results.append((first.text, second.started.cached_tokens, second.text))
    assert results[0] == results[1]


def test_a_grammar_or_a_bias_turns_drafting_off_and_changes_nothing(engines):
    on, off, _ = engines
    tokens = prompt_of(on)
    drafted = on.stats.drafted
    for params in ({"logit_bias": {5: 2.0}}, {"presence_penalty": 0.5, "temperature": 0.7}):
        got, want = ask(on, tokens, max_tokens=24, **params), ask(off, tokens, max_tokens=24,
                                                                  **params)  # fmt: skip
        assert got.text == want.text
    assert on.stats.drafted == drafted


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.3, "seed": 7},
        {"temperature": 0.8, "top_p": 0.9, "seed": 3},
        {"temperature": 1.0, "top_k": 20, "min_p": 0.05, "seed": 11},
    ],
)
def test_a_seeded_sampled_reply_is_drafted_and_is_the_one_it_is_without(engines, params):
    """A draft is verified by the sampler's own draws (a drawn token equal to the drafted
    one accepts it): the reply is the one plain steps draw from the same seed, again."""
    on, off, model = engines
    tokens = prompt_of(on)
    drafted, accepted = on.stats.drafted, on.stats.accepted
    got, again = ask(on, tokens, max_tokens=64, **params), ask(on, tokens, max_tokens=64, **params)
    want = ask(off, tokens, max_tokens=64, **params)
    assert got.text == again.text == want.text
    assert got.finished.reason == want.finished.reason
    assert on.stats.drafted > drafted
    if model == "default" and params["temperature"] < 0.5:
        assert on.stats.accepted > accepted  # it copies the source back, drafts and all


def test_two_streams_verify_drafts_together_and_decode_as_without(engines):
    """A second stream joins the first: they verify their drafts in one pass (the short
    one runs beside the long one throughout), and every reply is as without speculation."""
    out = []
    for engine in engines[:2]:
        tokens = prompt_of(engine)
        long, short = Run(), Run()
        engine.submit(tokens, SamplingParams(max_tokens=80, temperature=0.0), long)
        wait_until(lambda run=long: run.deltas > 2 or run.done.is_set())
        engine.submit(tokens[5:], SamplingParams(max_tokens=20, temperature=0.0), short)
        assert long.done.wait(300) and short.done.wait(300)
        out.append((long.text, short.text, long.finished.reason, short.finished.reason))
        if engine is engines[0] and engines[2] == "default":
            assert short.finished.drafted > 0 and short.finished.accepted > 0
    assert out[0] == out[1]


def test_a_request_cancelled_between_drafts_ends_and_the_engine_goes_on(engines):
    on, off, model = engines
    if model != "default":
        pytest.skip("the tiny model ends its reply before there is anything to cancel")
    tokens = prompt_of(on)
    run = Run()
    request = on.submit(tokens, SamplingParams(max_tokens=500, temperature=0.0), run)
    wait_until(lambda: on.stats.accepted > 0 and run.deltas > 3)
    request.cancel()
    assert run.done.wait(60) and run.finished.reason == "cancelled"
    got, want = ask(on, tokens, max_tokens=16), ask(off, tokens, max_tokens=16)
    assert got.text == want.text and got.started.cached_tokens > 0


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

    from app.engine.generator import MixedGenerator
    from app.engine.speculative import can_verify

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
    import numpy as np

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
    for (out, (reason, kv, tokens)), (want, (want_reason, want_kv, want_tokens)) in zip(
        got, plain, strict=True
    ):
        assert (out, reason, tokens) == (want, want_reason, want_tokens)
        assert same_kv(kv, want_kv)
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a.shape == b.shape and np.allclose(np.array(a), np.array(b), atol=1e-4)


@pytest.mark.parametrize("close_up", [False, True])
def test_each_stream_keeps_what_it_accepted_and_streams_without_drafts_ride_along(
    tiny_model, monkeypatch, close_up
):
    """One stream never drafts, one drafts every other step, one is always right, one is
    wrong every third step: each keeps the drafted tokens it accepted, the positions it
    rejected left as gaps its mask hides (`close_up`: closed up as soon as there are two);
    replies, ends, KV and logprobs are those of plain steps."""
    import numpy as np

    from app.engine import gapped_cache
    from app.engine.gapped_cache import GappedKVCache

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
    for (out, (reason, kv, tokens)), (want, (want_reason, want_kv, want_tokens)) in zip(
        got, plain, strict=True
    ):
        assert (out, reason, tokens) == (want, want_reason, want_tokens)
        assert same_kv(kv, want_kv)
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a.shape == b.shape and np.allclose(np.array(a), np.array(b), atol=1e-4)


def test_seeded_sampled_streams_verify_drafts_as_plain_steps_draw(tiny_model):
    """Streams sampling from their own seeds (one greedy beside them) verify drafts of their
    plain replies, wrong at different steps: each draw a drafted token is checked against
    is the one a plain step draws, and the key goes back to what the kept draws left it,
    so replies, ends and KV are those of plain steps."""
    from app.engine.sampling import make_sampler

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
    for (out, (reason, kv, tokens)), (want, (want_reason, want_kv, want_tokens)) in zip(
        got, plain, strict=True
    ):
        assert (out, reason, tokens) == (want, want_reason, want_tokens)
        assert same_kv(kv, want_kv)


def test_a_sampler_whose_draws_cannot_be_undone_decodes_plainly(tiny_model):
    """Verifying draws past the tokens kept; only a `Categorical`'s key can be put back, so a
    stream with any other sampler (its own state unknown) is not drafted for."""
    import mlx.core as mx

    from app.engine.sampling import make_sampler

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
    from app.engine.speculative import MAX_ROWS

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


@pytest.mark.parametrize("draft_seed", [0, 1])
def test_a_draft_model_drafts_where_lookup_finds_nothing(tiny_model_dir, tmp_path, draft_seed):
    """The target itself as its draft model (seed 0): every draft right; another random model
    (seed 1): most wrong. The reply is the plain one either way."""
    from tests.tiny_model import build_tiny_model

    draft = tiny_model_dir if draft_seed == 0 else build_tiny_model(tmp_path / "d", seed=1)
    on = engine_for(str(tiny_model_dir), True, draft_model=str(draft), num_draft_tokens=4)
    off = engine_for(str(tiny_model_dir), False)
    try:
        tokens = list(on.tokenizer.encode("qzx vbn wkj"))  # nothing in it to look up
        got, want = ask(on, tokens, max_tokens=30), ask(off, tokens, max_tokens=30)
        assert (got.text, got.finished.reason) == (want.text, want.finished.reason)
        assert got.finished.drafted > 0
        if draft_seed == 0:
            assert got.finished.accepted == got.finished.drafted
        follow = ask(on, tokens + [7, 8], max_tokens=5)  # a second request: a new draft KV
        assert follow.text == ask(off, tokens + [7, 8], max_tokens=5).text
    finally:
        on.stop()
        off.stop()


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_model_dir):
    from app.models.default_model import default_model_dir

    with pytest.raises(ValueError, match="another tokenizer"):
        build_engine(Settings(draft_model=str(default_model_dir())), str(tiny_model_dir))


def test_a_draft_model_goes_with_one_model_and_no_sharding(tiny_model_dir):
    from app.models.specs import model_specs
    from app.server.sharded import refusal

    two = Settings(model=str(tiny_model_dir), models=[{"path": str(tiny_model_dir), "id": "b"}],
                   draft_model="x")  # fmt: skip
    with pytest.raises(ValueError, match="drafts for one model"):
        model_specs(two, "default")
    assert "draft model" in refusal(Settings(draft_model="x"), 1)


def test_a_stop_string_and_the_limit_in_one_draft_leave_the_kv_for_the_next_turn(
    tiny_model_dir, monkeypatch
):
    """Drafts from an oracle (the plain reply), so that one draft holds both a stop string
    and the token where `max_tokens` ends the sequence in mlx-lm's batch: the reply ends at
    the stop string, and its KV still goes to the cache for the next turn."""
    import app.engine.generator as generator
    from app.engine.speculative import can_verify

    off = engine_for(str(tiny_model_dir), False)
    prompt = list(off.tokenizer.encode("Copy this: the quick brown fox jumps over it. " * 3))
    limit = 14
    want = ask(off, prompt, max_tokens=limit)
    reply = list(off.tokenizer.encode(want.text, add_special_tokens=False))

    def oracle(self) -> list[list[int]]:
        streams = self._generation_batch
        if not can_verify(streams):
            return []
        done = len(streams.tokens[0]) + 1 - len(prompt)
        draft = reply[done : done + streams.max_tokens[0] - streams._num_tokens[0] - 1]
        return [draft] if draft else []

    monkeypatch.setattr(generator.MixedGenerator, "_drafts", oracle)
    on = engine_for(str(tiny_model_dir), True)
    try:
        stop = next(want.text[i : i + 2] for i in range(4, 9)
                    if want.text.find(want.text[i : i + 2]) == i)  # fmt: skip
        turns = []
        for engine in (on, off):
            first = ask(engine, prompt, max_tokens=limit, stop=[stop])
            follow = prompt + list(engine.tokenizer.encode(first.text + " next",
                                                           add_special_tokens=False))  # fmt: skip
            second = ask(engine, follow, max_tokens=4)
            turns.append((first.text, first.finished.reason, second.started.cached_tokens,
                          second.text))  # fmt: skip
        assert on.stats.accepted > 0
        assert turns[0] == turns[1]
    finally:
        on.stop()
        off.stop()


def test_a_seeded_chat_completion_is_the_same_with_drafts_through_the_sdk():
    """Through the OpenAI SDK, a seeded sampled chat that copies a file: the server drafts
    (its metrics count accepted tokens) and answers what the server without speculation does,
    streamed or not."""
    import httpx
    from openai import OpenAI

    from app.models.default_model import default_model_dir
    from tests.live import serving

    messages = [{"role": "user", "content": "Repeat this file exactly:\n" + SOURCE}]
    params = {"model": "m", "messages": messages, "max_tokens": 80, "temperature": 0.4,
              "top_p": 0.95, "seed": 1234}  # fmt: skip
    replies = []
    for speculation in (True, False):
        with serving(str(default_model_dir()), served_model_name="m", speculation=speculation,
                     no_cache=True) as live:  # fmt: skip
            client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
            whole = client.chat.completions.create(**params).choices[0].message.content
            streamed = "".join(chunk.choices[0].delta.content or ""
                               for chunk in client.chat.completions.create(**params, stream=True)
                               if chunk.choices)  # fmt: skip
            metrics = httpx.get(live.url + "/metrics").text
            accepted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith("mlx_speculation_accepted_tokens_total"))  # fmt: skip
            replies.append((whole, streamed, accepted))
    (on, on_streamed, on_accepted), (off, off_streamed, off_accepted) = replies
    assert on == on_streamed == off == off_streamed and len(on) > 40
    assert on_accepted > 0 and off_accepted == 0
