"""What the cache costs when nothing can be reused: ours against ours --no-cache, paired.

Both servers run side by side (same model, OpenBLAS preloaded). The cached one
is first filled to its byte budget, so every new insert also evicts. Then
unique prompts (nothing shared beyond the template's first tokens) go to one
server and then the other, one request at a time, so both see the same machine
state; the TTFT ratio of each pair is the cost. Target: under 2%.

    python bench/cache_cost.py [--pairs 24]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx
from envelope import write_result
from harness import Call, running, send, system_prompt
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir


def unique_messages(i: int, words: int = 150) -> list[dict]:
    system = f"Session {random.Random(i).getrandbits(64):x}. " + system_prompt(words, 500 + i)
    return [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]


async def pairs(cached_port: int, plain_port: int, n: int) -> list[tuple]:
    def client(port: int) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    cached, plain = client(cached_port), client(plain_port)
    async with cached, plain:
        for i in range(200):  # fill the cache until inserts evict
            await send(cached, "bench", Call("fill", i, 0, 0, unique_messages(10_000 + i, 400)), 16)
            report = httpx.get(f"http://127.0.0.1:{cached_port}/v1/cache").json()
            if sum(m["evictions"] for m in report["models"]) > 0:
                break
        out = []
        for i in range(n):
            a = Call("cost", i, 0, 0, unique_messages(i))
            b = Call("cost", i, 0, 0, unique_messages(i))
            order = [(cached, a), (plain, b)] if i % 2 == 0 else [(plain, b), (cached, a)]
            for c, call in order:
                await send(c, "bench", call, 8)
            out.append((a.ttft, b.ttft, a.reply == b.reply))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--cache-max-bytes", type=int, default=92 * 2**20)
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    with (
        running("ours", model, 32, args.cache_max_bytes) as cached,
        running("ours-nocache", model, 32, args.cache_max_bytes) as plain,
    ):
        results = asyncio.run(pairs(cached.port, plain.port, args.pairs))
    ratios = [a / b for a, b, _ in results]
    report = {
        "pairs": len(results),
        "ttft_cached_median_s": statistics.median(a for a, _, _ in results),
        "ttft_uncached_median_s": statistics.median(b for _, b, _ in results),
        "cost_median_pct": (statistics.median(ratios) - 1) * 100,
        "same_outputs": all(same for _, _, same in results),
    }
    write_result("cache_cost.json", args, started, report)
    for key, value in report.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
