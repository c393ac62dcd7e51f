"""Warm-turn TTFT, ours against mlx_lm.server, paired: both up, each turn sent to both.

multiturn.py runs one server after the other, and single runs on this 2-core machine
swing by tens of percent between them: workload 1's warm TTFT ratio came out 1.33x,
1.24x and 0.98x in three runs. Here both servers run side by side (same model,
OpenBLAS preloaded, same cache limits) and every request goes to one and then the
other, the order alternating, so each pair sees the same machine state. The
conversations are workload 1's and 4's: a long system prompt, several turns, then a
regenerated answer and an edited last question. Reported: the median of the per-pair
TTFT ratios (ours / peer) over the warm turns, and whether greedy replies matched.

    python bench/warm_paired.py [--conversations 5] [--turns 6] [--against ours@PATH]

With --against ours@PATH the other server is ours from that checkout (a previous
commit, say) instead of mlx_lm.server: a change measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from envelope import write_result
from harness import Call, question, running, send, system_prompt
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir


async def paired(ours_port: int, peer_port: int, peer_model: str, convs: int, turns: int) -> list:
    def client(port: int) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    ours, peer = client(ours_port), client(peer_port)
    pairs = []

    async def both(kind: str, conv: int, turn: int, messages: list[dict]) -> str:
        a, b = Call(kind, conv, turn, 0, messages), Call(kind, conv, turn, 0, messages)
        order = [(ours, "bench", a), (peer, peer_model, b)]
        for c, name, call in order if len(pairs) % 2 == 0 else order[::-1]:
            await send(c, name, call, 32)
        pairs.append(
            {
                "kind": kind,
                "conv": conv,
                "turn": turn,
                "ours": a.ttft,
                "peer": b.ttft,
                "prompt_tokens": a.prompt_tokens,
                "cached": [a.cached_tokens, b.cached_tokens],
                "same_reply": a.reply == b.reply,
            }
        )
        return a.reply

    async with ours, peer:
        for conv in range(convs):
            messages = [{"role": "system", "content": system_prompt(400, 21 + conv)}]
            for turn in range(turns):
                messages.append({"role": "user", "content": question(conv, turn)})
                reply = await both("turn", conv, turn, list(messages))
                messages.append({"role": "assistant", "content": reply})
            await both("regenerate", conv, turns, messages[:-1])
            edited = messages[:-2] + [{"role": "user", "content": question(conv, 99)}]
            await both("edit", conv, turns + 1, edited)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--cache-max-bytes", type=int, default=256 * 2**20)
    ap.add_argument("--against", default="peer", help="peer, or ours@PATH (another checkout)")
    ap.add_argument("--out", default="warm_paired.json", help="file name in bench/results")
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    peer_model = model if args.against == "peer" else "bench"
    with (
        running("ours", model, 32, args.cache_max_bytes) as ours,
        running(args.against, model, 32, args.cache_max_bytes) as peer,
    ):
        pairs = asyncio.run(
            paired(ours.port, peer.port, peer_model, args.conversations, args.turns)
        )
    warm = [p for p in pairs if p["turn"] > 0]
    ratios = [p["ours"] / p["peer"] for p in warm]
    report = {
        "against": args.against,
        "warm_pairs": len(warm),
        "warm_ttft_ours_median_s": statistics.median(p["ours"] for p in warm),
        "warm_ttft_peer_median_s": statistics.median(p["peer"] for p in warm),
        "warm_ratio_median": statistics.median(ratios),
        "warm_ratio_quartiles": statistics.quantiles(ratios, n=4),
        "branch_ratio_median": statistics.median(
            p["ours"] / p["peer"] for p in pairs if p["kind"] != "turn"
        ),
        "same_replies": all(p["same_reply"] for p in pairs),
    }
    write_result(args.out, args, started, report, raw={"pairs": pairs})
    for key, value in report.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
