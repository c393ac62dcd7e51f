"""Cold prompts arriving together: their TTFTs against the best order's, ours and the peer's.

Each server runs alone in turn (ours, optionally ours from another checkout, and
mlx_lm.server), on the default model, greedy, through the `openai` SDK. Eight
unique prompts of very different lengths (system prompts of 30 to 2,000 words; `--words`)
are first sent one at a time, each prompt's TTFT alone on the idle server; then
eight other prompts of the same lengths (new words: nothing to reuse) are sent
at once, and each one's TTFT is taken.

The best achievable median: run one after another shortest first, the i-th
prompt's first token comes after the alone TTFTs of the i shortest ones (their
cumulative sum); no order has a lower median on one machine whose prefill time
grows with tokens. Reported per server: median and mean TTFT of the arrivals,
and the median against that bound.

    python bench/arrivals.py [--rounds 2] [--words 30,80,...,2000] [--ours-at PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from envelope import write_result
from harness import running, system_prompt
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 4 * 1024**3
WORDS = [30, 80, 150, 300, 600, 1000, 1500, 2000]


def messages(words: int, seed: int) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(words, seed)},
        {"role": "user", "content": "Summarize the rules above in one line."},
    ]


async def ttft(client: AsyncOpenAI, model: str, msgs: list[dict]) -> float:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, temperature=0, stream=True
    )
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


async def measure(url: str, model: str, seed: int, words: list[int]) -> dict:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600) as c:
        alone = [await ttft(c, model, messages(w, seed + i)) for i, w in enumerate(words)]
        together = await asyncio.gather(
            *(ttft(c, model, messages(w, seed + 100 + i)) for i, w in enumerate(words))
        )
    best = [sum(sorted(alone)[: i + 1]) for i in range(len(alone))]
    return {"alone": alone, "together": list(together), "best_order": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--words",
        default=",".join(map(str, WORDS)),
        help="the prompts' system prompt lengths in words, one prompt each",
    )
    ap.add_argument(
        "--ours-at",
        help="also run our server from this checkout folder (say, a worktree of HEAD~1)",
    )
    args = ap.parse_args()
    words = [int(w) for w in args.words.split(",")]
    started = time.time()
    model = str(default_model_dir())
    servers = {"ours": "ours", "peer": "peer"}
    if args.ours_at:
        servers = {"ours": "ours", "ours (before)": f"ours@{args.ours_at}", "peer": "peer"}
    results: dict[str, list[dict]] = {}
    for name, kind in servers.items():
        with running(kind, model, 64, BUDGET) as server:
            url = f"http://127.0.0.1:{server.port}"
            served = model if kind == "peer" else "bench"
            for r in range(args.rounds):
                out = asyncio.run(measure(url, served, 1000 * (r + 1), words))
                results.setdefault(name, []).append(out)
                print(name, r, {k: [round(x, 2) for x in v] for k, v in out.items()}, flush=True)
    summary = {}
    for name, rounds in results.items():
        together = [x for r in rounds for x in r["together"]]
        best = [statistics.median(r["best_order"]) for r in rounds]
        summary[name] = {
            "median_ttft": statistics.median(together),
            "mean_ttft": statistics.mean(together),
            "best_order_median": statistics.median(best),
            "median_over_best": statistics.median(
                statistics.median(r["together"]) / statistics.median(r["best_order"])
                for r in rounds
            ),
            "alone_total": statistics.median(sum(r["alone"]) for r in rounds),
        }
    write_result("arrivals.json", args, started, summary, raw={"rounds": results}, words=words)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
