"""A warm turn's TTFT against its physical limit: prefilling its new tokens plus one decode step.

Our server (default model, OpenBLAS preloaded, as `harness.start` runs it) gets, for
each N, a conversation whose first turn (a short system prompt and question) is sent
first, then follow-ups carrying about N new tokens; a follow-up's TTFT is taken
through the `openai` SDK, with the tokens it reports as cached and prompt. With
`--ours-at`, our server from that checkout runs too, and the two take turns at each N.

The limit, as the issue defines it, is the new tokens' prefill plus one decode step;
it is measured right after each N's follow-ups, in this process while the servers
idle (this host's speed drifts over minutes: the two sides of a ratio are measured
together), on the same model with the same CPU fast path (attention and SwiGLU) and
MLX's buffer pool limited as the server limits it (MLX's default pool prefills long
prompts more slowly: bench/README.md): a cache holding that many tokens, the
new tokens prefilled in the server's chunks (512; their logits never computed), then
one decode step. Medians of `--repeat` on both sides. A prompt of one chunk the server
prefills whole and samples from its last position (`prefill_alone`), with no decode
step: it can come in under 1.0x.

    python bench/ttft_floor.py [--new 100,250,500,2000,8000] [--repeat 3]
        [--ours-at PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import ExitStack
from typing import Any

from mlx_cache_server.runtime.blas import use_openblas

use_openblas()  # as the server does, before MLX is imported

import mlx.core as mx
from envelope import write_result
from harness import Call, running, send, system_prompt
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 4 * 1024**3
CHUNK = 512


async def follow_up(url: str, n: int, repeat: int) -> Call:
    """The follow-up of about `n` new tokens whose TTFT is the median of `repeat` (each its
    own words)."""
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600) as c:
        first = [{"role": "system", "content": system_prompt(150, n)},
                 {"role": "user", "content": "Hello."}]  # fmt: skip
        call = Call("floor", 0, 0, 0, first)
        await send(c, "bench", call, 8)
        calls = []
        for r in range(repeat):
            new = {"role": "user", "content": system_prompt(int(n * 0.77), n + 1 + r)}
            follow = [*first, {"role": "assistant", "content": call.reply}, new]
            calls.append(Call("floor", 0, 1, 0, follow))
            await send(c, "bench", calls[-1], 4)
    return sorted(calls, key=lambda x: x.ttft)[repeat // 2]


def cache_holding(model: Any, cached: int) -> list[Any]:
    """A prompt cache holding `cached` made-up tokens, prefilled in CHUNK-sized steps."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prefill_chunks(model, cache, [100 + (i * 7919) % 40000 for i in range(cached)])
    return cache


def new_tokens(n: int) -> list[int]:
    """`n` made-up tokens unlike those `cache_holding` put in."""
    return [100 + (i * 104729) % 40000 for i in range(n)]


def prefill_chunks(model: Any, cache: list[Any], tokens: list[int]) -> None:
    """Run `tokens` into `cache` in CHUNK-sized steps, as the server does; their logits are
    never evaluated, so never computed."""
    for at in range(0, len(tokens), CHUNK):
        model(mx.array([tokens[at : at + CHUNK]]), cache=cache)
        mx.eval([c.state for c in cache])


def floor_seconds(model: Any, cached: int, new: int, repeat: int) -> float:
    """Prefill `new` tokens on `cached` in CHUNK-sized steps, then one decode step."""
    times = []
    for _ in range(repeat):
        cache, tokens = cache_holding(model, cached), new_tokens(new)
        t0 = time.perf_counter()
        prefill_chunks(model, cache, tokens)
        step = model(mx.array([[tokens[-1]]]), cache=cache)
        mx.eval(mx.argmax(step[:, -1, :], axis=-1))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_size(model: Any, urls: dict[str, str], n: int, repeat: int, flip: bool) -> dict:
    """Each server's follow-up of about `n` new tokens, then the floor of each distinct
    (cached, new) pair they reported (their replies to the first turn may differ)."""
    row: dict = {"asked": n}
    for name in list(urls)[:: -1 if flip else 1]:  # neither always first
        call = asyncio.run(follow_up(urls[name], n, repeat))
        new = call.prompt_tokens - call.cached_tokens
        row[name] = {"cached": call.cached_tokens, "new": new, "ttft": call.ttft}
    floors: dict[tuple[int, int], float] = {}
    for name in urls:
        pair = (row[name]["cached"], row[name]["new"])
        if pair not in floors:
            floors[pair] = floor_seconds(model, *pair, repeat)
        row[name]["floor"] = floors[pair]
        row[name]["ratio"] = row[name]["ttft"] / floors[pair]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", default="100,250,500,2000,8000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ours-at", help="also run our server from this checkout, side by side")
    args = ap.parse_args()
    started = time.time()
    from mlx_lm import load

    from mlx_cache_server.runtime import cpu_activations, cpu_attention
    from mlx_cache_server.runtime.blas import describe
    from mlx_cache_server.runtime.memory import limit_buffer_pool

    blas, fast = describe()
    if not fast:
        print(f"warning: this process's matmuls use {blas}: the floor is too slow", flush=True)
    model_dir = str(default_model_dir())
    limit_buffer_pool()  # as the server, before the model's buffers: faster on long prompts
    model, _ = load(model_dir)
    cpu_attention.install(model)  # as build_engine does on the CPU
    cpu_activations.install(model)
    floor_seconds(model, 64, 64, 1)  # the first forward passes in a process pay for warming up
    kinds = {"ours": "ours"}
    if args.ours_at:
        kinds["ours (before)"] = f"ours@{args.ours_at}"
    rows = []
    with ExitStack() as stack:
        urls = {}
        for name, kind in kinds.items():
            server = stack.enter_context(running(kind, model_dir, 64, BUDGET))
            urls[name] = f"http://127.0.0.1:{server.port}"
        for i, n in enumerate(int(x) for x in args.new.split(",")):
            rows.append(measure_size(model, urls, n, args.repeat, flip=i % 2 == 1))
            print(rows[-1], flush=True)
            write_result("ttft_floor.json", args, started, rows)  # after each size: kept so far


if __name__ == "__main__":
    main()
