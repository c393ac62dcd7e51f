"""Prefix-aware admission: requests sharing an uncached prefix compute it once."""

from __future__ import annotations

import time

from mlx_cache_server.engine import Delta, Finished, SamplingParams, Started
from mlx_cache_server.engine.request import Request
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.prompt_cache import PackedTokens
from mlx_cache_server.prompt_cache.radix import common_prefix_length, pack
from mlx_cache_server.settings import Settings
from tests.helpers import ended, wait_until

SYSTEM = "You are a careful assistant who answers briefly and precisely. " * 5


def chat(tokenizer, question):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run_all(engine, prompts, max_tokens=12):
    """Submit every prompt before the engine starts, so they arrive together."""
    events = [[] for _ in prompts]
    for prompt, sink in zip(prompts, events, strict=True):
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), sink.append)
    engine.start()
    wait_until(lambda: all(ended(sink) for sink in events))
    engine.stop()
    started = [next(e for e in sink if isinstance(e, Started)) for sink in events]
    texts = ["".join(e.text for e in sink if isinstance(e, Delta)) for sink in events]
    return started, texts


def test_shared_system_prompt_is_prefilled_once(tiny_model_dir, uncached_client):
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    engine = build_engine(Settings(), str(tiny_model_dir))
    prompts = [chat(engine.tokenizer, q) for q in questions]
    started, texts = run_all(engine, prompts)
    shared = min(common_prefix_length(prompts[0], p) for p in prompts[1:])
    assert started[0].cached_tokens == 0  # the leader computes the prefix
    assert all(s.cached_tokens >= shared for s in started[1:])  # the others reuse it
    # And nothing changed in what they generate.
    for question, text in zip(questions, texts, strict=True):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        r = uncached_client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        assert r.choices[0].message.content == text


def test_without_the_cache_nobody_waits(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    prompts = [chat(engine.tokenizer, f"Q{i}") for i in range(3)]
    started, texts = run_all(engine, prompts)
    assert [s.cached_tokens for s in started] == [0, 0, 0] and all(texts)


def test_a_running_request_shares_its_prompt_at_once(tiny_model_dir, uncached_client):
    """Its prompt is cached when prefilled, not when it ends: later requests reuse it."""
    engine = build_engine(Settings(), str(tiny_model_dir))
    questions = [f"Question {i}: what is {i} times {i}?" for i in range(4)]
    prompts = [chat(engine.tokenizer, q) for q in questions]
    no_end = {t: -100.0 for t in engine.tokenizer.eos_token_ids}  # keeps it running a while
    first: list = []
    engine.start()
    try:
        params = SamplingParams(max_tokens=300, temperature=0, logit_bias=no_end)
        engine.submit(prompts[0], params, first.append)
        deadline = time.monotonic() + 60
        while not any(isinstance(e, Delta) for e in first):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert not any(isinstance(e, Finished) for e in first)  # still generating
        later = [[] for _ in prompts[1:]]
        for prompt, sink in zip(prompts[1:], later, strict=True):
            engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0), sink.append)
        while not all(any(isinstance(e, Finished) for e in s) for s in [first, *later]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        engine.stop()
    shared = min(common_prefix_length(prompts[0], p) for p in prompts[1:])
    for question, sink in zip(questions[1:], later, strict=True):
        assert next(e for e in sink if isinstance(e, Started)).cached_tokens >= shared
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        r = uncached_client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        assert r.choices[0].message.content == "".join(e.text for e in sink if isinstance(e, Delta))


def test_a_requests_states_are_keyed_by_the_prompt_packed_on_arrival():
    prompt = [5, 6, 7, 8]
    request = Request(prompt, SamplingParams(max_tokens=4), print)
    for state in ([5, 6], prompt, [*prompt, 9, 10]):  # a shared prefix, the prompt, prompt + reply
        key = request.state_key(state)
        assert isinstance(key, PackedTokens) and key == pack(state)
    assert request.state_key([5, 9]) == [5, 9]  # not its sequence: taken as it is
    assert request.state_key([5, 6, 7, 9, 10]) == [5, 6, 7, 9, 10]
