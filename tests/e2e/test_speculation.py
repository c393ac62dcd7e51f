"""Prompt-lookup speculation: streams verify drafts in one pass, and their output is what
it is without speculation, token for token (greedy, or sampled from a seed), with stops,
limits, logprobs, a grammar, batches, a cancel, and the KV the next turn finds in the cache."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from mlx_cache_server.engine import Delta, Failed, Finished, SamplingParams, Started
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.runtime import kernel_block
from mlx_cache_server.runtime.blas import describe as describe_blas
from mlx_cache_server.settings import Settings
from tests.helpers import wait_until
from tests.live import settings_of

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
    engine = build_engine(settings_of(speculation=speculation, **settings), model_dir)
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
    from mlx_cache_server.models.default_model import default_model_dir

    model = str(tiny_model_dir if request.param == "tiny" else default_model_dir())
    on, off = engine_for(model, True), engine_for(model, False)
    yield on, off, request.param
    on.stop()
    off.stop()


@pytest.mark.portable
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


def ask_as(engine, tenant: str, tokens: list[int], max_tokens: int) -> Run:
    run = Run()
    engine.submit(tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens), run, tenant)
    assert run.done.wait(300)
    return run


def test_a_reply_is_drafted_again_from_the_last_one_for_its_tenant_only(engines):
    """A turn asked again (a retry, a second session) drafts from the reply written before:
    for the same tenant only, until the cache is flushed, and it decodes the same."""
    on, off, model = engines
    asked = [{"role": "user", "content": "Write a short poem about the sea."}]
    tokens = list(on.tokenizer.apply_chat_template(asked, add_generation_prompt=True))
    want = ask(off, tokens, max_tokens=64)
    first = ask_as(on, "a", tokens, 64)
    again = ask_as(on, "a", tokens, 64)
    elsewhere = ask_as(on, "b", tokens, 64)
    on.flush_cache()
    flushed = ask_as(on, "a", tokens, 64)
    assert want.text == first.text == again.text == elsewhere.text == flushed.text
    assert off.replies.tokens == 0 < on.replies.tokens  # kept only where drafts are made
    f, a = first.finished, again.finished
    # Drafted from the reply before, and every drafted token right: most of the reply
    # (a pass's first token is the one the step before drew, never a draft's).
    assert a.accepted == a.drafted > f.accepted
    assert a.accepted >= a.completion_tokens * 2 // 3
    for other in (elsewhere.finished, flushed.finished):  # nothing of tenant a's reply
        assert (other.drafted, other.accepted) == (f.drafted, f.accepted)


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


@pytest.mark.portable
def test_two_streams_verify_drafts_together_and_decode_as_without(engines, monkeypatch):
    """A second stream joins the first: they verify their drafts in one pass (the short
    one runs beside the long one throughout, rows of unequal drafts computed as far as
    each goes: `live_positions`), and every reply is as without speculation."""
    import mlx_cache_server.engine.speculative as speculative

    ragged, live = [], speculative.live_positions

    def seen(lengths, width):
        ragged.append(lengths)
        return live(lengths, width)

    monkeypatch.setattr(speculative, "live_positions", seen)
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
            # Passes whose rows' drafts differ in length: chosen where a pass's fillers
            # cost nothing (our kernels); without them the rows' drafts are cut to one
            # length where that is cheaper (`draft_length(padded=True)`), timing decides.
            if kernel_block.skips_fillers(engine.model):
                assert ragged
    assert out[0] == out[1]


def test_eight_streams_verify_their_drafts_in_one_pass_and_decode_as_without(engines, monkeypatch):
    """As many streams as a pass verifies (`MAX_ROWS`; `PADDED_ROWS` where a pass computes
    its fillers), started together: their passes hold every row, and each reply is as
    without speculation."""
    import mlx_cache_server.engine.generator as generator
    from mlx_cache_server.engine.speculative import MAX_ROWS, PADDED_ROWS
    from mlx_cache_server.runtime.kernel_block import skips_fillers

    rows, verify = [], generator.verify
    most = MAX_ROWS if skips_fillers(engines[0].model) else PADDED_ROWS

    def seen(batch, drafts):
        rows.append(len(drafts))
        return verify(batch, drafts)

    monkeypatch.setattr(generator, "verify", seen)
    replies = []
    for engine in engines[:2]:
        tokens = prompt_of(engine)
        runs = [Run() for _ in range(most)]
        for i, run in enumerate(runs):  # each its own prompt: the copy asked from another line
            engine.submit(tokens[i:], SamplingParams(max_tokens=120, temperature=0.0), run)
        assert all(run.done.wait(300) for run in runs)
        replies.append([(run.text, run.finished.reason) for run in runs])
    assert replies[0] == replies[1]
    if engines[2] == "default":
        assert most in rows


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


@pytest.mark.portable
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


@pytest.mark.parametrize("served, draft_seed", [("tiny", 0), ("tiny", 1), ("default", 0)])
def test_streams_decoding_together_draft_from_the_draft_model_in_one_pass(
    tiny_model_dir, tmp_path, monkeypatch, served, draft_seed
):
    """Three streams with nothing to look up, decoding together: the draft model drafts for
    all of them in one batch (its passes seen with several rows), each reply the plain one;
    where the draft model is the target itself, every draft is what the stream went on with."""
    from mlx_cache_server.engine.draft_model import DraftBatch
    from mlx_cache_server.models.default_model import default_model_dir
    from tests.tiny_model import build_tiny_model

    calls, draft = [], DraftBatch.draft

    def seen(self, uids, sequences, k):
        drafts = draft(self, uids, sequences, k)
        if k:
            calls.append((list(uids), [list(s) for s in sequences], drafts))
        return drafts

    monkeypatch.setattr(DraftBatch, "draft", seen)
    target = tiny_model_dir if served == "tiny" else default_model_dir()
    model = target if draft_seed == 0 else build_tiny_model(tmp_path / "d", seed=1)
    on = engine_for(str(target), True, draft_model=str(model), num_draft_tokens=4)
    off = engine_for(str(target), False)
    try:
        texts = ("qzx vbn wkj", "plm", "Name three colours of the rainbow and a fruit of each.")
        prompts = [list(on.tokenizer.encode(t)) for t in texts]
        runs = [Run() for _ in prompts]
        for tokens, run in zip(prompts, runs, strict=True):
            on.submit(tokens, SamplingParams(max_tokens=40, temperature=0.0), run)
        assert all(run.done.wait(300) for run in runs)
        for tokens, run in zip(prompts, runs, strict=True):
            want = ask(off, tokens, max_tokens=40)
            assert (run.text, run.finished.reason) == (want.text, want.finished.reason)
            assert run.finished.drafted > 0
    finally:
        on.stop()
        off.stop()
    assert max(len(uids) for uids, _, _ in calls) == len(prompts)
    if draft_seed == 0:  # each draft, as far as its stream went on, is what it went on with
        last = {u: s for uids, seqs, _ in calls for u, s in zip(uids, seqs, strict=True)}
        checked = 0
        for uids, seqs, drafts in calls:
            for u, s, d in zip(uids, seqs, drafts, strict=True):
                went_on = last[u][len(s) : len(s) + len(d)]
                assert d[: len(went_on)] == went_on
                checked += len(went_on)
        assert checked >= 20


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_model_dir):
    from mlx_cache_server.models.default_model import default_model_dir

    with pytest.raises(ValueError, match="another tokenizer"):
        build_engine(Settings(draft_model=str(default_model_dir())), str(tiny_model_dir))


def test_a_draft_model_goes_with_one_model_and_no_sharding(tiny_model_dir):
    from mlx_cache_server.models.sharding import refusal
    from mlx_cache_server.models.specs import model_specs

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
    import mlx_cache_server.engine.generator as generator
    from mlx_cache_server.engine.speculative import can_verify

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

    from mlx_cache_server.models.default_model import default_model_dir
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

            def total(name: str, text: str = metrics) -> float:
                return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith(f"mlx_speculation_{name}_total"))  # fmt: skip

            counts = [total(n) for n in ("accepted_tokens", "drafted_tokens", "drafts")]
            replies.append((whole, streamed, counts))
    (on, on_streamed, on_counts), (off, off_streamed, off_counts) = replies
    assert on == on_streamed == off == off_streamed and len(on) > 40
    accepted, drafted, drafts = on_counts
    assert 0 < accepted <= drafted and 0 < drafts <= drafted  # a draft is a token or more
    assert off_counts == [0, 0, 0]
