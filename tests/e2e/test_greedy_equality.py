"""With a real (tiny, random-weight) mlx-lm model: cached state is the state itself.

Greedy output continued from a fetched cache must equal greedy output computed
from scratch, token for token, whatever kind of match the fetch made.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_cache_server.prompt_cache import PromptCache
from mlx_cache_server.prompt_cache.radix import common_prefix_length

# Also run with our kernels and the CPU fast path off (README, the portable lane).
pytestmark = pytest.mark.portable

SYSTEM = "You are a terse assistant. Answer in one line. " * 6


def greedy(model, prompt, fetched=None, max_tokens=12):
    """Greedy tokens for `prompt`, and the cache, which holds prompt + all but the last."""
    n = fetched.n_cached if fetched is not None and fetched.cache is not None else 0
    cache = fetched.cache if n else make_prompt_cache(model)
    logits = model(mx.array(prompt[n:])[None], cache=cache)
    out = []
    for i in range(max_tokens):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        if i + 1 < max_tokens:
            logits = model(mx.array([[out[-1]]]), cache=cache)
    return out, cache


def chat(tokenizer, *turns, system=SYSTEM):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run(model, cache, prompt, expect_kind=None):
    """Serve one prompt through the cache; check it against a cache-free run."""
    fetched = cache.fetch("tiny", prompt)
    if expect_kind is not None:
        assert fetched.kind == expect_kind
    out, kv = greedy(model, prompt, fetched)
    assert out == greedy(model, prompt)[0]
    assert cache.insert("tiny", prompt + out[:-1], kv)
    return fetched, out


def test_segments_assembled_equal_the_state_computed_directly(tiny_model):
    model, tokenizer = tiny_model
    cache = PromptCache()
    a = chat(tokenizer, "What is the capital of France?")
    b = chat(tokenizer, "Name a prime number.")
    for prompt in (a, b):
        _, kv = greedy(model, prompt, max_tokens=1)
        cache.insert("tiny", prompt, kv)
    query = b + [65, 66]
    fetched = cache.fetch("tiny", query)
    assert fetched.kind == "shorter" and fetched.n_cached == len(b)
    direct = make_prompt_cache(model)
    model(mx.array(b)[None], cache=direct)
    for got, want in zip(fetched.cache, direct, strict=True):
        assert got.offset == want.offset == len(b)
        for x, y in ((got.keys, want.keys), (got.values, want.values)):
            np.testing.assert_allclose(
                np.array(x[..., : got.offset, :]),
                np.array(y[..., : want.offset, :]),
                rtol=1e-4,
                atol=1e-4,
            )


def test_multi_turn_chat_shorter_matches(tiny_model):
    model, tokenizer = tiny_model
    cache = PromptCache()
    _, out1 = run(model, cache, chat(tokenizer, "Hi"), "miss")
    reply = tokenizer.decode(out1)
    fetched, out2 = run(model, cache, chat(tokenizer, "Hi", reply, "And then?"))
    assert fetched.n_cached > len(chat(tokenizer, "Hi")) // 2
    run(model, cache, chat(tokenizer, "Hi", reply, "And then?", tokenizer.decode(out2), "Ok."))


def test_exact_repeat(tiny_model):
    model, tokenizer = tiny_model
    cache = PromptCache()
    prompt = chat(tokenizer, "Repeat me")
    _, kv = greedy(model, prompt, max_tokens=1)
    cache.insert("tiny", prompt, kv)
    fetched, _ = run(model, cache, prompt, "exact")
    assert fetched.n_cached == len(prompt) - 1


def test_longer_cached_sequence_cut_back_regenerate(tiny_model):
    model, tokenizer = tiny_model
    cache = PromptCache()
    first = chat(tokenizer, "Tell me a story about a fox.")
    run(model, cache, first)
    edited = chat(tokenizer, "Tell me a story about a cat.")
    fetched, _ = run(model, cache, edited, "longer")
    assert fetched.n_cached == common_prefix_length(first, edited)
    fetched, _ = run(model, cache, first[:-3])  # a prefix of what is stored
    assert fetched.kind == "longer" and fetched.n_cached == len(first) - 4


def test_branching_conversations_share_the_system_prompt(tiny_model):
    model, tokenizer = tiny_model
    cache = PromptCache()
    stored: list[list[int]] = []
    for question in ("One?", "Two?", "Three?", "Four?"):
        prompt = chat(tokenizer, question)
        fetched, out = run(model, cache, prompt)
        shared = max((common_prefix_length(prompt, s) for s in stored), default=0)
        assert fetched.n_cached == min(shared, len(prompt) - 1)
        stored.append(prompt + out[:-1])
    # Each stored token is held once: the system prompt is not paid four times.
    distinct = sum(
        len(s) - max((common_prefix_length(s, t) for t in stored[:i]), default=0)
        for i, s in enumerate(stored)
    )
    one = make_prompt_cache(model)
    model(mx.array(stored[0][:1])[None], cache=one)
    per_token = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in one)
    assert cache.nbytes == distinct * per_token < 2 * len(stored[0]) * per_token


@pytest.mark.parametrize("budget_turns", [1, 2])
def test_after_eviction(tiny_model, budget_turns):
    model, tokenizer = tiny_model
    prompt = chat(tokenizer, "A first question")
    _, kv = greedy(model, prompt, max_tokens=1)
    per_token = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in kv)
    cache = PromptCache(max_bytes=int(budget_turns * 1.3 * len(prompt) * per_token))
    # Different system prompts: little is shared, so the budget forces evictions.
    convs = [chat(tokenizer, "Question", system=f"{i}. {SYSTEM}") for i in range(4)]
    for conv in convs:
        run(model, cache, conv)
        assert cache.nbytes <= cache.max_bytes
    stats = cache.stats()
    assert stats.evictions > 0 and stats.shortened > 0  # some went whole, some lost their end
    for conv in reversed(convs):  # some hit, some cut back, some evicted: all must be right
        run(model, cache, conv + tokenizer.encode("more"))
