"""A warm turn's TTFT against its physical limit: prefilling its new tokens plus one decode step.

Our server (default model, OpenBLAS preloaded, as `multiturn.start` runs it) gets, for
each N, a conversation whose first turn (a short system prompt and question) is sent
first, then a follow-up carrying about N new tokens; the follow-up's TTFT is taken
through the `openai` SDK, with the tokens it reports as cached and prompt. The limit is
measured afterwards in this process (medians of `--repeat` on both sides), on the same
model set up as the server sets it up (the same CPU fast path): a cache holding that
many tokens, then the new tokens prefilled in the server's chunks (512), then one
decode step, each evaluated.

    LD_PRELOAD=... python bench/ttft_floor.py [--new 100,250,500,2000,8000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import mlx.core as mx
from multiturn import RESULTS, Call, running, send, system_prompt
from openai import AsyncOpenAI

from app.models.default_model import default_model_dir

BUDGET = 4 * 1024**3
CHUNK = 512


async def follow_ups(url: str, sizes: list[int], repeat: int) -> list[Call]:
    """Per size, the follow-up whose TTFT is the median of `repeat` (each its own words)."""
    out = []
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600) as c:
        for n in sizes:
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
            out.append(sorted(calls, key=lambda x: x.ttft)[repeat // 2])
    return out


def floor_seconds(model, cached: int, new: int, repeat: int) -> float:
    """Prefill `new` tokens on `cached` in CHUNK-sized steps, then one decode step."""
    from mlx_lm.models.cache import make_prompt_cache

    times = []
    for _ in range(repeat):
        cache = make_prompt_cache(model)
        held = [100 + (i * 7919) % 40000 for i in range(cached)]
        for at in range(0, cached, CHUNK):
            model(mx.array([held[at : at + CHUNK]]), cache=cache)
            mx.eval([c.state for c in cache])
        tokens = [100 + (i * 104729) % 40000 for i in range(new)]
        t0 = time.perf_counter()
        for at in range(0, new, CHUNK):
            logits = model(mx.array([tokens[at : at + CHUNK]]), cache=cache)
            mx.eval([c.state for c in cache])
        mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        step = model(mx.array([[tokens[-1]]]), cache=cache)
        mx.eval(mx.argmax(step[:, -1, :], axis=-1))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", default="100,250,500,2000,8000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(x) for x in args.new.split(",")]
    model_dir = str(default_model_dir())
    with running("ours", model_dir, 64, BUDGET) as server:
        calls = asyncio.run(follow_ups(f"http://127.0.0.1:{server.port}", sizes, args.repeat))
    from mlx_lm import load

    from app.runtime import cpu_activations, cpu_attention

    model, _ = load(model_dir)
    cpu_attention.install(model)  # as build_engine does on the CPU
    cpu_activations.install(model)
    rows = []
    for n, call in zip(sizes, calls, strict=True):
        new = call.prompt_tokens - call.cached_tokens
        floor = floor_seconds(model, call.cached_tokens, new, args.repeat)
        rows.append({"asked": n, "cached": call.cached_tokens, "new": new, "ttft": call.ttft,
                     "floor": floor, "ratio": call.ttft / floor})  # fmt: skip
        print(rows[-1], flush=True)
    (RESULTS / "ttft_floor.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
