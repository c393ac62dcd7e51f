"""Hybrid models (sliding windows, linear attention, Mamba, convolutions beside attention),
built tiny from mlx-lm's own classes: greedy replies with the cache equal those without it,
and each request reuses at least what mlx_lm.server would.

What mlx_lm.server 0.32 reuses on these models is computed from the tokens: it stores a
conversation's cache where the system prompt ends, a token before each prompt's end,
before a thinking block the generation prompt opens, and at the end of each reply, and
a request resumes from the longest of those its prompt starts with.
"""

from __future__ import annotations

import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_cache_server.prompt_cache.radix import common_prefix_length
from tests.helpers import greedy_alone
from tests.hybrid_models import ARCHS, build_hybrid_model
from tests.live import serving

# Also run with our kernels and the CPU fast path off (README, the portable lane).
pytestmark = pytest.mark.portable

SYSTEM = "You are a careful assistant; answer briefly and cite your sources. " * 5
CONVERSATIONS = [["Hi there.", "Tell me more.", "And then?"], ["What is 2+2?", "Why?"]]
# Qwen3's with thinking off: the generation prompt holds an empty thinking block that the
# turn, written back, does not.
THINK_OFF = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}"
    "{% endif %}"
)


class Peer:
    """What mlx_lm.server has stored, as token sequences, and what it would reuse."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.stored = tokenizer, []

    def render(self, messages, generation=True):
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation))

    def reuse(self, prompt: list[int]) -> int:
        fits = [len(s) for s in self.stored if len(s) < len(prompt) and prompt[: len(s)] == s]
        return max(fits, default=0)

    def answered(self, messages, prompt: list[int], reply: str) -> None:
        system = self.render([*messages[:1], {"role": "user", "content": ""}], generation=False)
        self.stored.append(prompt[: common_prefix_length(system, prompt)])
        self.stored.append(prompt[:-1])
        head = self.render([*messages, {"role": "assistant", "content": ""}], generation=False)
        self.stored.append(prompt[: common_prefix_length(head, prompt)])  # before a think block
        self.stored.append(prompt + self.tokenizer.encode(reply, add_special_tokens=False))


def converse(url: str, peer: Peer | None) -> list[tuple[str, int, int]]:
    """The conversations, a regenerate of each one's last turn and an edit of its second:
    (reply, prompt tokens, cached tokens) for each request, checked against the peer."""
    out = []

    def ask(messages):
        body = {"model": "m", "messages": messages, "max_tokens": 10, "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        r = r.json()
        text, usage = r["choices"][0]["message"]["content"], r["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        out.append((text, usage["prompt_tokens"], cached))
        if peer is not None:
            prompt = peer.render(messages)
            assert usage["prompt_tokens"] == len(prompt)
            assert cached >= peer.reuse(prompt), (len(out), cached, peer.reuse(prompt))
            peer.answered(messages, prompt, text)
        return text

    for questions in CONVERSATIONS:
        messages = [{"role": "system", "content": SYSTEM}]
        for q in questions:
            messages += [{"role": "user", "content": q}]
            messages += [{"role": "assistant", "content": ask(messages)}]
        ask(messages[:-1])  # regenerate
        ask([*messages[:3], {"role": "user", "content": "Something else."}])  # an edit
    return out


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, tmp_path_factory):
    return build_hybrid_model(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_replies_equal_no_cache_and_reuse_is_at_least_the_peers(arch_dir):
    tokenizer = load_tokenizer(arch_dir)
    with serving(str(arch_dir), served_model_name="m") as live:
        assert live.engine.cache_mode == "checkpointed"
        cached = converse(live.url, Peer(tokenizer))
    with serving(str(arch_dir), served_model_name="m", no_cache=True) as live:
        fresh = converse(live.url, None)
    assert [c[0] for c in cached] == [f[0] for f in fresh]
    # Not only as much as the peer: a second conversation starts from the system prompt.
    second = len(CONVERSATIONS[0]) + 2
    assert cached[second][2] >= len(tokenizer.encode(SYSTEM)) > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_a_template_that_writes_the_generation_prompt_back_otherwise(arch, tmp_path):
    import json

    path = build_hybrid_model(tmp_path / arch, arch)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": THINK_OFF}))
    tokenizer = load_tokenizer(path)
    with serving(str(path), served_model_name="m") as live:
        cached = converse(live.url, Peer(tokenizer))
    with serving(str(path), served_model_name="m", no_cache=True) as live:
        fresh = converse(live.url, None)
    assert [c[0] for c in cached] == [f[0] for f in fresh]
    # Each later turn resumed inside the previous one's prompt, past its last message.
    assert all(c[2] > 0 for c in cached[1:3])


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_a_window_model_resumes_where_two_messages_part(arch, tmp_path):
    """Sliding windows are stored by token: a request that shares the start of an earlier
    one's message resumes where the two part, not at the last message end before it."""
    path = build_hybrid_model(tmp_path / arch, arch)
    doc = "Read this: " + "the quick brown fox jumps over the lazy dog. " * 6
    asks = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc + q}]
            for q in ("Who jumps?", "Who is lazy?")]  # fmt: skip

    def run(**settings):
        out = []
        with serving(str(path), served_model_name="m", **settings) as live:
            for messages in asks:
                body = {"model": "m", "messages": messages, "max_tokens": 10, "temperature": 0}
                r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
                cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                out.append((r["choices"][0]["message"]["content"], cached))
        return out

    cached, fresh = run(), run(no_cache=True)
    assert [c[0] for c in cached] == [f[0] for f in fresh]
    peer = Peer(load_tokenizer(path))
    first, second = (peer.render(m) for m in asks)
    assert cached[1][1] == common_prefix_length(first, second) > len(peer.tokenizer.encode(doc))


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_a_warm_prompt_is_where_the_first_request_resumes(arch, tmp_path):
    from mlx_cache_server.serving.warm import warm

    path = build_hybrid_model(tmp_path / arch, arch)
    system = {"role": "system", "content": SYSTEM}
    shared = Peer(load_tokenizer(path)).render([system], generation=False)
    ask = [system, {"role": "user", "content": "Hi there."}]
    body = {"model": "m", "messages": ask, "max_tokens": 10, "temperature": 0}
    with serving(str(path), served_model_name="m") as live:
        assert warm(live.engine, [{"messages": [system]}], [None]) == len(shared)
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
    with serving(str(path), served_model_name="m", no_cache=True) as live:
        fresh = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert r["choices"][0]["message"] == fresh["choices"][0]["message"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared)


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss"])
def test_a_hybrid_sharded_by_heads_equals_one_process(arch, tmp_path):
    """Two ranks under mlx.launch, each with its shard of every layer (linear attention's
    and windows' heads too): the same replies and reuse as one process."""
    from tests.e2e.test_sharded import launched

    path = build_hybrid_model(tmp_path / arch, arch)
    with serving(str(path), served_model_name="m") as one:
        expected = converse(one.url, None)
    with launched(path, "--served-model-name", "m", log=tmp_path / "launch.log") as (_, url):
        got = converse(url, None)
    assert got == expected


def test_the_budget_holds_with_checkpoints(tmp_path):
    path = build_hybrid_model(tmp_path / "gpt_oss", "gpt_oss")
    budget = 300_000
    with serving(str(path), served_model_name="m", cache_max_bytes=budget) as live:
        converse(live.url, None)
        assert 0 < live.engine.cache.nbytes <= budget


def test_quantized_attention_beside_recurrent_layers(tmp_path):
    """--kv-bits quantizes a hybrid model's attention layers; its other layers stay as they
    are, checkpointed as without it."""
    path = build_hybrid_model(tmp_path / "qwen3_5", "qwen3_5", head_dim=32)  # a group's width
    quantized = {"served_model_name": "m", "kv_bits": 8, "kv_group_size": 32}
    with serving(str(path), **quantized) as live:
        cached = converse(live.url, None)
    with serving(str(path), **quantized, no_cache=True) as live:
        fresh = converse(live.url, None)
    assert [c[0] for c in cached] == [f[0] for f in fresh]
    # Each turn resumes past the previous prompt (this path stores a reply without its last
    # token, whose KV was never computed), a new conversation at the system prompt's end.
    assert cached[1][2] > cached[0][1] and cached[2][2] > cached[1][1]
    second = len(CONVERSATIONS[0]) + 2
    assert cached[second][2] >= len(load_tokenizer(path).encode(SYSTEM))


def test_segments_leave_no_one_token_step():
    from mlx_cache_server.engine.batch import segment_cuts

    assert segment_cuts(0, 100, 0, (40, 98, 99)) == [40, 98]  # 99 is one past 98
    assert segment_cuts(0, 100, 50, (49, 51, 60)) == [50, 60]  # the waited-for prefix first
    assert segment_cuts(10, 100, 0, (11, 30)) == [30]  # one token after what was cached


def test_a_batch_of_windows_after_one_token_steps_matches_a_lone_run(tmp_path):
    """A prompt cut into one-token segments beside a padded one: mlx-lm's window mask went
    wrong after such a step, until the adapter's step fixed it (`mlx_adapter.windows`)."""
    import random

    from mlx_lm import load

    from mlx_cache_server.engine.generator import MixedGenerator

    model, _ = load(str(build_hybrid_model(tmp_path / "gemma3_text", "gemma3_text")))

    def alone(prompt: list[int], k: int = 5) -> list[int]:
        return greedy_alone(model, prompt, k)

    rng = random.Random(5)
    b, c = [rng.randint(1, 40) for _ in range(37)], [rng.randint(1, 40) for _ in range(3)]
    gen = MixedGenerator(model, max_tokens=5, prefill_step_size=16)
    first = gen.insert_segments([[b[:16], b[16:17], b[17:24], b[24:36], b[36:]]], max_tokens=[5])
    gen.next()
    second = gen.insert_segments([[c[:1], c[1:2], c[2:]]], max_tokens=[5])
    got = {first[0]: [], second[0]: []}
    while True:
        prompts, responses = gen.next()
        if not prompts and not responses:
            break
        for r in responses:
            got[r.uid].append(r.token)
    gen.close()
    assert got[first[0]] == alone(b) and got[second[0]] == alone(c)
