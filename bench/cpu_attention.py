"""Attention on the Linux CPU: where a forward pass's time goes, and the numpy fast path.

Part 1, in this process (default model, float32, OpenBLAS loaded as the server loads
it):
  - one layer's attention at 4,100 keys (a 100-token chunk: q 1x9x100x64, k/v 1x3x4100x64):
    MLX's fused kernel, the numpy path (runtime/cpu_attention.py), and its two matmuls
    alone (QK^T and PV) as the floor;
  - a forward pass of 100 new tokens on 0, 1k, 4k and 8k cached tokens, timed per op kind
    (each module evaluated on its own: matmuls, attention, norms, RoPE, the MLP's
    activation, the rest), with MLX's own kernels and with the CPU fast path (the
    softmax and SwiGLU through numpy).
Part 2, servers side by side (ours, ours --no-cpu-fast-path, mlx_lm.server), each
alone in turn, greedy, through the `openai` SDK:
  - warm TTFT of ~100 new tokens on 1k, 2k, 4k and 8k cached tokens;
  - an agent-shaped session: a 1,200-word system prompt, then turns that each add a
    200-word tool result, until the context passes 3,800 tokens; warm TTFT median;
  - greedy agreement of our two attention paths over all those replies.

    python bench/cpu_attention.py [--part 1|2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from mlx_cache_server.runtime.blas import use_openblas

use_openblas()  # as the server does, before MLX is imported

import mlx.core as mx
import mlx.nn as nn
from envelope import RESULTS, write_result
from harness import Call, running, send, system_prompt
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir
from mlx_cache_server.runtime import cpu_activations, cpu_attention, fast_path

BUDGET = 4 * 1024**3


def median_ms(fn, repeat: int = 7) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def layer_attention() -> dict:
    mx.random.seed(0)
    q = mx.random.normal((1, 9, 100, 64))
    k, v = mx.random.normal((1, 3, 4100, 64)), mx.random.normal((1, 3, 4100, 64))
    mx.eval(q, k, v)
    kr, vr = mx.repeat(k, 3, axis=1), mx.repeat(v, 3, axis=1)
    p = mx.softmax(q @ kr.swapaxes(-1, -2), axis=-1)
    mx.eval(kr, vr, p)
    out = {
        "mlx_fused_ms": median_ms(
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        ),
        "numpy_path_ms": median_ms(lambda: cpu_attention.attention(q, k, v, 0.125, "causal")),
        "matmuls_ms": median_ms(lambda: q @ kr.swapaxes(-1, -2)) + median_ms(lambda: p @ vr),
        "mlx_exp_ms": median_ms(lambda: mx.exp(p)),
    }
    out["numpy_over_matmuls"] = out["numpy_path_ms"] / out["matmuls_ms"]
    return out


class Timed(nn.Module):
    """A submodule evaluated on its own, its time added to its kind's."""

    def __init__(self, inner: Any, kind: str, times: dict) -> None:
        super().__init__()
        self.inner, self.kind, self.times = inner, kind, times

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mx.eval([a for a in args if isinstance(a, mx.array)])
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        self.times[self.kind] += time.perf_counter() - t0
        return out


def profile_forward(model: Any, cached: int, fast: bool) -> dict:
    """Seconds per op kind of one forward pass of 100 tokens after `cached` tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    times: dict[str, float] = defaultdict(float)
    cache = make_prompt_cache(model)
    if cached:
        for at in range(0, cached, 512):
            model(mx.array([[(i * 7919) % 40000 + 100 for i in range(at, min(cached, at + 512))]]),
                  cache=cache)  # fmt: skip
            mx.eval([c.state for c in cache])
    module = sys.modules[type(model).__module__]
    real_attention = module.scaled_dot_product_attention
    # MLX's own attention and SwiGLU, or the fast path's: the one switch
    fast_path.FAST_PATH.on = fast

    def attention(*args: Any, **kwargs: Any) -> mx.array:
        mx.eval([a for a in args if isinstance(a, mx.array)])
        t0 = time.perf_counter()
        out = cpu_attention.scaled_dot_product_attention(*args, **kwargs)
        mx.eval(out)
        times["attention (scores, softmax, values)"] += time.perf_counter() - t0
        return out

    saved = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        for owner, name, kind in [
            (a, "q_proj", "matmul"), (a, "k_proj", "matmul"), (a, "v_proj", "matmul"),
            (a, "o_proj", "matmul"), (a, "rope", "RoPE"), (m, "gate_proj", "mlp matmul"),
            (m, "up_proj", "mlp matmul"), (m, "down_proj", "mlp matmul"),
            (layer, "input_layernorm", "norms"), (layer, "post_attention_layernorm", "norms"),
        ]:  # fmt: skip
            inner = getattr(owner, name)
            saved.append((owner, name, inner))
            setattr(owner, name, Timed(inner, kind, times))
    module.scaled_dot_product_attention = attention
    for layer in model.layers:  # the MLP as a whole: its activation is what is not a matmul
        saved.append((layer, "mlp", layer.mlp))
        layer.mlp = Timed(layer.mlp, "mlp", times)
    tokens = mx.array([[(i * 104729) % 40000 + 100 for i in range(100)]])
    try:
        mx.eval(model(tokens, cache=cache))  # warm-up: the timed pass follows on a fresh copy
        for c in cache:
            c.trim(100)
        times.clear()
        t0 = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        total = time.perf_counter() - t0
    finally:
        for owner, name, inner in saved:
            setattr(owner, name, inner)
        module.scaled_dot_product_attention = real_attention
        fast_path.FAST_PATH.on = True
    mlp = times.pop("mlp")
    times["activation (SwiGLU)"] = mlp - times.pop("mlp matmul")
    times["matmul"] += mlp - times["activation (SwiGLU)"]
    out = {kind: round(seconds * 1000, 1) for kind, seconds in sorted(times.items())}
    out["rest (residuals, embedding, head, cache writes)"] = round(
        (total - sum(times.values())) * 1000, 1
    )
    out["total"] = round(total * 1000, 1)
    return out


def part1(quick: bool) -> dict:
    from mlx_lm import load

    fast_path.MIN_SCORES = 0
    model, _ = load(str(default_model_dir()))
    cpu_attention.install(model)
    cpu_activations.install(model)
    result = {"layer_attention_4k": layer_attention(), "forward_100_tokens_ms": {}}
    print(result["layer_attention_4k"], flush=True)
    for cached in [0, 1000] if quick else [0, 1000, 4000, 8000]:
        for fast in (False, True):
            name = f"{cached} cached, {'fast path' if fast else 'MLX'}"
            result["forward_100_tokens_ms"][name] = profile_forward(model, cached, fast)
            print(name, result["forward_100_tokens_ms"][name], flush=True)
    return result


# ------------------------------------------------------------------ part 2: servers


def words(n: int, seed: int) -> str:
    return system_prompt(n, seed)


async def ask(client: AsyncOpenAI, model: str, messages: list[dict], max_tokens: int) -> Call:
    call = Call("cpu_attention", 0, 0, 0, messages)
    await send(client, model, call, max_tokens)
    return call


async def server_workload(url: str, model: str, contexts: list[int], turns: int) -> dict:
    out: dict[str, Any] = {"context": {}, "agent": []}
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600) as c:
        for n in contexts:  # ~0.77 words per token for these words in SmolLM2's tokenizer
            base = [{"role": "system", "content": words(int(n * 0.77), n)},
                    {"role": "user", "content": "Remember these rules."}]  # fmt: skip
            first = await ask(c, model, base, 8)
            follow = [*base, {"role": "assistant", "content": first.reply},
                      {"role": "user", "content": words(75, n + 1)}]  # fmt: skip
            second = await ask(c, model, follow, 16)
            out["context"][n] = {"ttft": second.ttft, "cached": second.cached_tokens,
                                 "prompt": second.prompt_tokens, "reply": second.reply}  # fmt: skip
        messages = [{"role": "system", "content": words(1200, 7)}]
        for t in range(turns):
            messages = [
                *messages,
                {"role": "user", "content": "Tool result:\n" + words(200, 100 + t)},
            ]
            call = await ask(c, model, messages, 24)
            messages = [*messages, {"role": "assistant", "content": call.reply}]
            out["agent"].append({"ttft": call.ttft, "prompt": call.prompt_tokens,
                                 "cached": call.cached_tokens, "reply": call.reply})  # fmt: skip
            if call.prompt_tokens > 3800:
                break
    return out


def part2(quick: bool) -> dict:
    model = str(default_model_dir())
    contexts = [1000] if quick else [1000, 2000, 4000, 8000]
    servers = {
        "ours": ("ours", []),
        "ours (MLX attention)": ("ours", ["--no-cpu-fast-path"]),
        "peer": ("peer", []),
    }
    results = {}
    for name, (kind, extra) in servers.items():
        with running(kind, model, 64, BUDGET, extra) as server:
            served = model if kind == "peer" else "bench"
            results[name] = asyncio.run(
                server_workload(f"http://127.0.0.1:{server.port}", served, contexts, 20)
            )
        print(name, json.dumps(results[name])[:400], flush=True)
    summary: dict[str, Any] = {"warm_ttft_100_new": {}, "agent_warm_ttft_median": {}}
    for name, r in results.items():
        summary["warm_ttft_100_new"][name] = {n: v["ttft"] for n, v in r["context"].items()}
        summary["agent_warm_ttft_median"][name] = statistics.median(
            a["ttft"] for a in r["agent"][1:]
        )
    fast, slow = results["ours"], results["ours (MLX attention)"]
    pairs = [(fast["context"][n]["reply"], slow["context"][n]["reply"]) for n in contexts]
    for a, b in zip(fast["agent"], slow["agent"], strict=False):
        pairs.append((a["reply"], b["reply"]))
        if a["reply"] != b["reply"]:
            break  # the conversations differ from here on
    summary["identical_replies_fast_vs_mlx"] = [sum(a == b for a, b in pairs), len(pairs)]
    summary["runs"] = results
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["1", "2"], default=None, help="default: both")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    started = time.time()
    name = "cpu_attention_quick.json" if args.quick else "cpu_attention.json"
    # One part run alone keeps the other's figures from the result before.
    path = RESULTS / name
    result = json.loads(path.read_text()).get("summary", {}) if path.exists() else {}
    if args.part in (None, "1"):
        result["profile"] = part1(args.quick)
    if args.part in (None, "2"):
        result["servers"] = part2(args.quick)
    write_result(name, args, started, result)
    print(json.dumps({k: v for k, v in result.get("servers", {}).items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
