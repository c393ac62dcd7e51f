"""A request admitted alone gets its first token from its own prefill's logits.

Requests admitted together go through `BatchGenerator`'s batched prefill and
its one-token decode step instead; both paths must produce the same tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlx_cache_server.engine import Delta, Failed, Finished, SamplingParams, Started
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.helpers import ended, wait_until

QUESTIONS = ["What is two plus two?", "Name a colour.", "Say hello in French."]


class CountingModel:
    """The model, recording how many tokens each forward pass was given."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[int] = []

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        self.calls.append(inputs.shape[1])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def collect(engine, prompts, params: SamplingParams, together: bool) -> list[list[Any]]:
    """Run `prompts` all in one admission (together) or each on its own, in order."""
    sinks: list[list[Any]] = [[] for _ in prompts]

    def wait(which: list[list[Any]]) -> None:
        wait_until(lambda: all(ended(s) for s in which))

    if together:  # queued before the engine thread starts: one intake takes them all
        for p, sink in zip(prompts, sinks, strict=True):
            engine.submit(p, params, sink.append)
        engine.start()
        wait(sinks)
    else:
        engine.start()
        for p, sink in zip(prompts, sinks, strict=True):
            engine.submit(p, params, sink.append)
            wait([sink])
    engine.stop()
    return sinks


def text(sink: list[Any]) -> str:
    return "".join(e.text for e in sink if isinstance(e, Delta))


def finished(sink: list[Any]) -> Finished:
    return next(e for e in sink if isinstance(e, Finished))


@pytest.mark.parametrize("no_cache", [True, False])
def test_lone_and_batched_admission_generate_the_same(tiny_model_dir, no_cache):
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    runs = {}
    for together in (True, False):
        engine = build_engine(Settings(no_cache=no_cache), str(tiny_model_dir))
        prompts = [prompt(engine.tokenizer, q) for q in QUESTIONS]
        runs[together] = collect(engine, prompts, params, together)
    for batched, lone in zip(runs[True], runs[False], strict=True):
        assert text(lone) == text(batched)
        assert finished(lone) == finished(batched)
        lone_lps = [lp for e in lone if isinstance(e, Delta) for lp in e.logprobs]
        batched_lps = [lp for e in batched if isinstance(e, Delta) for lp in e.logprobs]
        assert [lp.token for lp in lone_lps] == [lp.token for lp in batched_lps]
        assert [[c.token for c in lp.top] for lp in lone_lps] == [
            [c.token for c in lp.top] for lp in batched_lps
        ]
        for a, b in zip(lone_lps, batched_lps, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_a_lone_request_needs_no_separate_decode_step_for_its_first_token(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    engine.model = counting = CountingModel(engine.model)
    p = prompt(engine.tokenizer, QUESTIONS[0])
    (sink,) = collect(engine, [p], SamplingParams(max_tokens=1, temperature=0), together=False)
    assert finished(sink) == Finished("length", 1)
    assert counting.calls == [len(p)]  # one forward pass over the whole prompt, nothing else


def test_a_warm_turn_prefills_only_what_is_new(tiny_model_dir):
    # Without drafts: turn 2 would verify turn 1's reply as a draft, several positions a pass.
    engine = build_engine(Settings(speculation=False), str(tiny_model_dir))
    engine.model = counting = CountingModel(engine.model)
    first = prompt(engine.tokenizer, QUESTIONS[0])
    sinks = collect(engine, [first, first], SamplingParams(max_tokens=3, temperature=0), False)
    started = next(e for e in sinks[1] if isinstance(e, Started))
    assert started.cached_tokens == len(first) - 1
    # One forward pass over the prompt in turn 1; in turn 2 only one-token passes: the
    # prompt's one uncached token, then decode steps.
    assert counting.calls[0] == len(first) and set(counting.calls[1:]) == {1}
    assert text(sinks[0]) == text(sinks[1])


def test_the_first_token_can_end_the_request(tiny_model_dir):
    engine = build_engine(Settings(), str(tiny_model_dir))
    eos = min(engine.tokenizer.eos_token_ids)
    p = prompt(engine.tokenizer, QUESTIONS[1])
    forced = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0})
    (sink,) = collect(engine, [p], forced, together=False)
    assert finished(sink) == Finished("stop", 1) and text(sink) == ""
    # It was still cached: the prompt is there for the next turn.
    assert engine.cache.peek(engine.cache_key(), p + [1])[1] == len(p)


def test_a_stop_string_in_the_first_token(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    p = prompt(engine.tokenizer, QUESTIONS[2])
    (free,) = collect(engine, [p], SamplingParams(max_tokens=1, temperature=0), False)
    first = text(free)
    assert first  # the tiny model's first token here is some visible text
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    params = SamplingParams(max_tokens=8, temperature=0, stop=[first])
    (stopped,) = collect(engine, [p], params, together=False)
    assert finished(stopped) == Finished("stop", 1, stop_sequence=first) and text(stopped) == ""


def test_a_failed_prefill_fails_that_request_only(tiny_model_dir, caplog):
    engine = build_engine(Settings(), str(tiny_model_dir))

    class Broken(CountingModel):
        def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            if inputs.shape[1] > 1:
                raise RuntimeError("out of memory (simulated)")
            return self.model(inputs, *args, **kwargs)

    engine.model = Broken(engine.model)
    params = SamplingParams(max_tokens=4, temperature=0)
    (sink,) = collect(engine, [prompt(engine.tokenizer, QUESTIONS[0])], params, False)
    assert any(isinstance(e, Failed) for e in sink)
    assert "simulated" in caplog.text and not any("simulated" in str(e) for e in sink)
    assert engine.stats.failed == 1 and engine.running == 0


def test_a_long_lone_prompt_is_prefilled_in_steps(tiny_model_dir):
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    p = prompt(engine.tokenizer, QUESTIONS[2])
    params = SamplingParams(max_tokens=6, temperature=0)
    batched, _ = collect(engine, [p, p], params, together=True)  # two: the batched path
    engine = build_engine(Settings(no_cache=True), str(tiny_model_dir))
    engine.prefill_step_size = 16
    engine.model = counting = CountingModel(engine.model)
    (lone,) = collect(engine, [p], params, together=False)
    assert text(lone) == text(batched)
    # Longer than a step: in the batch's chunks (a prompt arriving meanwhile can start
    # beside it, `schedule`), its last token in the last chunk, whose logits give the first
    # token (`PromptSteps.last_chunk`): no one-token step for it before it decodes.
    chunks = [n for n in counting.calls if n > 1]
    assert sum(chunks) == len(p) and max(chunks) == 16


def test_a_prompt_prefilled_alone_is_cached_once_before_it_ends(tiny_model_dir):
    engine = build_engine(Settings(), str(tiny_model_dir))
    stored: list[int] = []  # tokens of each state put into the cache
    insert = engine.cache.insert

    def counting(key: Any, tokens: Any, kv: Any) -> Any:
        stored.append(tokens.n_tokens if hasattr(tokens, "n_tokens") else len(tokens))
        return insert(key, tokens, kv)

    engine.cache.insert = counting
    p = prompt(engine.tokenizer, QUESTIONS[1])
    no_end = {t: -100.0 for t in engine.tokenizer.eos_token_ids}
    (sink,) = collect(engine, [p], SamplingParams(max_tokens=5, logit_bias=no_end), False)
    assert finished(sink).reason == "length"
    # Once prefilled (a request sharing it starts from it), once ended: not again when its
    # first token enters the batch, which would copy the same KV out of the batch.
    assert stored == [len(p), len(p) + 5]
