"""A failure that belongs to one request fails that request only.

Faults are injected into one request's own sampler or logits processor, at
admission or in the middle of the batch's decoding, while other requests
stream; those must finish with exactly the tokens of their solo runs.
"""

from __future__ import annotations

from typing import Any

import pytest

import mlx_cache_server.engine.request
import mlx_cache_server.engine.running
from mlx_cache_server.engine import Delta, Engine, Failed, Finished, SamplingParams
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.helpers import ended, wait_until

QUESTIONS = ["What is two plus two?", "Name a colour.", "Say hello in French."]
# Long enough that the poisoned request comes and goes while these still run.
GREEDY = SamplingParams(max_tokens=200, temperature=0, logit_bias={99: -100.0})  # 99: <|im_end|>
POISON_TOP_P = 0.5  # marks the request whose sampler the fixture breaks
POISON_PRESENCE = 0.5  # marks the request whose logits processor the fixture breaks


def prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def tokens(sink: list[Any]) -> list[int]:
    return [lp.token for e in sink if isinstance(e, Delta) for lp in e.logprobs]


def with_logprobs(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "logprobs": 0})


def fails_after(calls: int, fn):
    """`fn`, which raises from its `calls`+1-th call on: a fault in the middle of decoding."""
    count = [0]

    def call(*args):
        count[0] += 1
        if count[0] > calls:
            raise RuntimeError("injected fault")
        return fn(*args)

    return call


@pytest.fixture
def faulty(monkeypatch):
    """Break the sampler of requests with top_p=0.5 and a processor of presence_penalty=0.5."""
    real_sampler = mlx_cache_server.engine.request.make_sampler
    real_processors = mlx_cache_server.engine.request.make_processors

    def make_sampler(temperature, top_p, *args):
        sampler = real_sampler(temperature, top_p, *args)
        return fails_after(3, sampler) if top_p == POISON_TOP_P else sampler

    def make_processors(logit_bias, presence_penalty, frequency_penalty):
        processors = real_processors(logit_bias, 0.0, frequency_penalty)
        if presence_penalty == POISON_PRESENCE:
            processors = [*processors, fails_after(3, lambda _tokens, logits: logits)]
        return processors

    monkeypatch.setattr(mlx_cache_server.engine.request, "make_sampler", make_sampler)
    monkeypatch.setattr(mlx_cache_server.engine.request, "make_processors", make_processors)


def solo_runs(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        sink: list[Any] = []
        engine.submit(p, with_logprobs(GREEDY), sink.append)
        wait_until(lambda sink=sink: ended(sink))
        out.append(tokens(sink))
    return out


POISONS = {
    "sampler raises mid-decode": SamplingParams(max_tokens=24, temperature=1, top_p=POISON_TOP_P),
    "processor raises mid-decode": SamplingParams(
        max_tokens=24, temperature=0, presence_penalty=POISON_PRESENCE
    ),
    # A real fault, not an injected one: top_k beyond the vocabulary (HTTP refuses it with a
    # 400; a direct engine caller can still send it).
    "top_k beyond the vocabulary": SamplingParams(max_tokens=24, temperature=1, top_k=10**9),
}


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize(("no_cache", "kv_bits"), [(True, None), (False, None), (False, 8)])
def test_a_poisoned_request_joining_running_streams_fails_alone(
    tiny_model_dir, tiny_kv_model_dir, faulty, poison, no_cache, kv_bits
):
    # With kv_bits the requests take turns (`solo`) instead of sharing mlx-lm's batch.
    model = tiny_model_dir if kv_bits is None else tiny_kv_model_dir
    settings = Settings(no_cache=no_cache, kv_bits=kv_bits, kv_group_size=32)
    engine = build_engine(settings, str(model))
    engine.start()
    try:
        prompts = [prompt(engine.tokenizer, q) for q in QUESTIONS]
        solo = solo_runs(engine, prompts)
        engine.cache and engine.cache.clear()  # the batched run prefills them afresh
        sinks: list[list[Any]] = [[] for _ in prompts]
        for p, sink in zip(prompts, sinks, strict=True):
            engine.submit(p, with_logprobs(GREEDY), sink.append)
        wait_until(lambda: all(len(tokens(s)) >= 3 for s in sinks))  # all streaming
        poisoned: list[Any] = []
        engine.submit(prompts[0], POISONS[poison], poisoned.append)
        wait_until(lambda: ended(poisoned))
        assert not any(ended(s) for s in sinks)  # it failed while the others were streaming
        wait_until(lambda: all(ended(s) for s in sinks))
        assert isinstance(poisoned[-1], Failed) and poisoned[-1].reason == "error"
        assert "injected" not in poisoned[-1].message  # details go to the log, not the client
        for sink, expected in zip(sinks, solo, strict=True):
            assert isinstance(sink[-1], Finished), sink[-1]
            assert tokens(sink) == expected
        assert engine.stats.failed == 1
        wait_until(lambda: engine.running == 0)
        assert solo_runs(engine, prompts[:1]) == solo[:1]  # and it serves on
    finally:
        engine.stop()


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_poisoned_request_admitted_in_one_batch_with_others_fails_alone(
    tiny_model_dir, faulty, poison
):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    prompts = [prompt(engine.tokenizer, q) for q in QUESTIONS]
    engine.start()
    solo = solo_runs(engine, prompts)
    engine.stop()
    # Queued before the engine thread starts, so one intake admits them all together:
    # BatchGenerator's batched prefill and first decode step, not the lone-request path.
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    sinks: list[list[Any]] = [[] for _ in prompts]
    poisoned: list[Any] = []
    engine.submit(prompts[1], POISONS[poison], poisoned.append)
    for p, sink in zip(prompts, sinks, strict=True):
        engine.submit(p, with_logprobs(GREEDY), sink.append)
    engine.start()
    try:
        wait_until(lambda: all(ended(s) for s in [*sinks, poisoned]))
        assert isinstance(poisoned[-1], Failed)
        assert [tokens(s) for s in sinks] == solo
        assert all(isinstance(s[-1], Finished) for s in sinks)
    finally:
        engine.stop()


def test_requests_taken_when_the_batch_cannot_start_are_answered(tiny_model_dir, monkeypatch):
    engine = build_engine(Settings(), str(tiny_model_dir))

    def broken(*args, **kwargs):
        raise RuntimeError("no memory for a new batch (simulated)")

    monkeypatch.setattr(mlx_cache_server.engine.running, "MixedGenerator", broken)
    sinks: list[list[Any]] = [[] for _ in QUESTIONS]
    for q, sink in zip(QUESTIONS, sinks, strict=True):
        engine.submit(prompt(engine.tokenizer, q), GREEDY, sink.append)
    engine.start()
    try:
        wait_until(lambda: all(ended(s) for s in sinks), seconds=10)
        assert all(isinstance(s[-1], Failed) for s in sinks)
        assert engine.stats.failed == len(QUESTIONS)
    finally:
        engine.stop()


def test_nobody_is_left_waiting_at_shutdown(tiny_model_dir):
    engine = build_engine(Settings(), str(tiny_model_dir))
    engine.start()
    long = SamplingParams(max_tokens=2000, temperature=0, logit_bias={})
    eos = sorted(engine.tokenizer.eos_token_ids)
    long.logit_bias = {t: -100.0 for t in eos}  # runs until stopped
    running: list[Any] = []
    engine.submit(prompt(engine.tokenizer, QUESTIONS[0]), long, running.append)
    wait_until(lambda: any(isinstance(e, Delta) for e in running))
    queued: list[Any] = []
    engine.submit(prompt(engine.tokenizer, QUESTIONS[1]), long, queued.append)
    engine.stop()
    late: list[Any] = []
    engine.submit(prompt(engine.tokenizer, QUESTIONS[2]), GREEDY, late.append)
    for sink in (running, queued, late):
        assert isinstance(sink[-1], Failed) and "shutting down" in sink[-1].message
