"""With the CPU fast path (attention's softmax and the logits' normalization through numpy;
a few queries' attention, RoPE, RMSNorm, SwiGLU, a Llama block's work around attention
and a decode step's other products as our primitives; on by default on the CPU), greedy
output with the cache equals output without it, through the `openai` SDK."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from openai import OpenAI

from mlx_cache_server.mlx_adapter.model_patches import GENERATE
from mlx_cache_server.runtime import fast_path, native
from mlx_cache_server.runtime.fast_path import FAST_PATH, Route
from mlx_cache_server.runtime.kernel_attention import MAX_QUERIES
from tests.live import serving

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a CPU-only path")


def routes(monkeypatch, family: str) -> list[tuple[Route, tuple[int, ...]]]:
    """The routes `FAST_PATH` picks for `family` from now on, call by call, each with its
    first operand's shape."""
    taken, rule = [], getattr(FAST_PATH, family)

    def recording(*args):
        taken.append((rule(*args), args[0].shape))
        return taken[-1][0]

    monkeypatch.setattr(FAST_PATH, family, recording)
    return taken


def test_cached_equals_uncached_with_the_cpu_fast_path_everywhere(tiny_model_dir, monkeypatch):
    layers, primitives = native.layers(), []
    if layers is not None:  # the servers' models take the primitives from this
        counted = type("Counted", (), {})()
        names = ("rope", "rms_norm", "inv_freq", "attention", "has_attention", "has_block",
                 "block_input", "block_output", "swiglu", "linear")  # fmt: skip
        for name in names:
            real_op = getattr(layers, name)
            setattr(counted, name, lambda *a, op=real_op, n=name: primitives.append(n) or op(*a))
        monkeypatch.setattr(native, "_module", counted)

    monkeypatch.setattr(fast_path, "MIN_SCORES", 0)  # every call, decode steps too
    monkeypatch.setattr(fast_path, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(fast_path, "MIN_ROWS", 0)  # one stream's steps too
    attention, swiglu = routes(monkeypatch, "attention"), routes(monkeypatch, "swiglu")
    normalized = routes(monkeypatch, "logsumexp")
    monkeypatch.setattr(GENERATE, "mx", mx)  # installed afresh, then undone
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    with (
        serving(str(tiny_model_dir), served_model_name="tiny") as cached,
        serving(str(tiny_model_dir), served_model_name="tiny", no_cache=True) as uncached,
    ):
        messages, generated = [system], 0
        for question in ("Hello.", "Tell me more.", "And then?"):
            messages.append({"role": "user", "content": question})
            replies = []
            for live in (cached, uncached):
                client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
                r = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=16, temperature=0
                )
                replies.append((r.choices[0].message.content, r.usage))
                generated += r.usage.completion_tokens
            (text, usage), (plain, _) = replies
            assert text == plain
            messages.append({"role": "assistant", "content": text})
    assert usage.prompt_tokens_details.cached_tokens > 0
    calls = [shape for route, shape in attention if route is Route.NUMPY]
    kernel = [shape for route, shape in attention if route is Route.KERNEL]
    if FAST_PATH.kernels("attention") is not None:
        assert any(shape[2] > MAX_QUERIES for shape in calls)
        assert any(shape[2] == 1 for shape in kernel)  # decode steps and short prompts
    else:
        assert any(shape[2] > 1 for shape in calls) and any(shape[2] == 1 for shape in calls)
    if layers is not None:
        # the blocks' work around attention as two nodes each, the last norm as one
        assert {"block_input", "block_output", "rms_norm"} <= set(primitives)
        assert "linear" in primitives  # the output head's product, a step's few rows
        if FAST_PATH.kernels("attention") is not None:  # as a node of the graph
            assert "attention" in primitives
        # any SwiGLU outside a block is our node, not numpy's
        assert all(route is Route.KERNEL for route, _ in swiglu)
    else:
        assert swiglu and all(route is Route.NUMPY for route, _ in swiglu)  # every one numpy's
    # each token's, through numpy
    assert len(normalized) >= generated and all(route is Route.NUMPY for route, _ in normalized)


@pytest.mark.portable
def test_a_server_takes_our_modules_only_with_the_fast_path_on(tiny_model_dir):
    """What the portable lane (README) rests on: with MLX_CACHE_SERVER_CPU_FAST_PATH=0 in
    the environment a server's model keeps mlx-lm's modules, as on a Mac or a GPU."""
    off = os.environ.get("MLX_CACHE_SERVER_CPU_FAST_PATH", "").lower() in ("0", "false", "no")
    with serving(str(tiny_model_dir), served_model_name="tiny") as live:
        ours = [
            type(m).__name__
            for m in live.engine.model.modules()
            if type(m).__module__.startswith("mlx_cache_server.runtime")
        ]
    if off or native.layers() is None:
        assert ours == []
    else:  # RoPE and norms, the blocks and the output head's product
        assert {"Block", "RMSNorm", "Embedding"} <= set(ours)
