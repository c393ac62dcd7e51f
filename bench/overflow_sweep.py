"""Workload 3 (round-robin conversations that overflow the cache) across byte budgets.

multiturn.py runs workload 3 at one budget. How far storing a shared prefix once pays
off depends on where that budget falls, so this runs it at several, ours against
mlx_lm.server, each server restarted per budget with the same limits. Budgets are
multiples of what workload 3 needs with its system prompt stored once (S + N * own
turns); stored whole, one system prompt per conversation, it needs N * (S + own turns).

Two measures per budget and server:
  reuse      sum(cached) / sum(prompt) tokens
  turn hits  share of follow-up turns whose previous turn's whole prompt was reused

Both caches are least-recently-used and the conversations go round-robin, so either
keeps its conversations until the working set overflows, then loses each one just
before it is needed again. The peer's trie still serves the shared system prompt from
any entry it holds, so its reuse never falls below S per request: ours / peer reuse is
at most 1 + (mean history reused) / S, highest with short system prompts.

    python bench/overflow_sweep.py                   # 8 conversations x 5 turns, 150-word prompt
    python bench/overflow_sweep.py --system-words 400 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from multiturn import (
    RESULTS,
    ChatShape,
    Server,
    Workloads,
    add_ceilings,
    chat_sizes,
    kv_bytes_per_token,
    running,
    summarize,
)
from openai import AsyncOpenAI

from app.models.default_model import default_model_dir

NAME = "3-overflow"


async def drive(server: Server, model: str, workloads: Workloads, shape: ChatShape) -> None:
    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=3600
    )
    async with client:
        await workloads.chats(server, client, model, shape)


def run(
    kind: str,
    model: str,
    budget: int,
    workloads: Workloads,
    shape: ChatShape,
    tokenizer,
    extra: Sequence[str] = (),
) -> dict:
    with running(kind, model, 64, budget, extra) as server:
        asyncio.run(drive(server, "bench" if kind != "peer" else model, workloads, shape))
    add_ceilings(server.calls, tokenizer)
    return summarize({kind: server})[NAME][kind] | {
        "peak_rss": server.peak_rss,
        "cache_bytes_peak": server.cache_bytes_peak,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["budget_factor"] for r in rows]
    for ax, key, label in (
        (axes[0], "reuse", "cached / prompt tokens"),
        (axes[1], "turn_hits", "turns reusing their whole history"),
    ):
        for kind in ("ours", "peer"):
            ax.plot(x, [r[kind][key] for r in rows], marker="o", label=kind)
        if key == "reuse":
            ax.plot(x, [r["ours"]["ceiling"] for r in rows], ls="--", color="grey", label="ceiling")
        ax.axvline(rows[0]["whole_factor"], color="grey", lw=0.8)
        ax.set_xlabel("budget / (S + N x own turns)   (grey line: N x (S + own turns))")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("Workload 3 across cache budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--factors", default="0.6,0.8,0.9,1,1.2,1.5")
    ap.add_argument("--out", type=Path, default=RESULTS / "overflow_sweep.json")
    args = ap.parse_args()
    model = str(default_model_dir())
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    per_token = kv_bytes_per_token(Path(model))
    workloads = Workloads(quick=False)
    workloads.max_tokens = args.max_tokens
    shape = ChatShape(NAME, NAME, args.conversations, args.turns, False, args.system_words, 13)
    shared, own = chat_sizes(shape, args.max_tokens, tokenizer)
    deduplicated = shared + args.conversations * own
    whole = args.conversations * (shared + own)
    rows = []
    print(f"S = {shared} tokens, N = {args.conversations}, own turns ~{own} tokens each")
    print(
        f"{'budget':>7} {'MiB':>5} {'reuse ours':>10} {'peer':>6} {'ratio':>6} "
        f"{'turn hits ours':>14} {'peer':>6}"
    )
    for factor in (float(f) for f in args.factors.split(",")):
        budget = int(factor * deduplicated * per_token)
        row = {
            "budget_factor": factor,
            "budget_bytes": budget,
            "whole_factor": whole / deduplicated,
        }
        for kind in ("ours", "peer"):
            row[kind] = run(kind, model, budget, workloads, shape, tokenizer)
        o, p = row["ours"], row["peer"]
        ratio = o["reuse"] / p["reuse"] if p["reuse"] else float("inf")
        print(
            f"{factor:>7.2f} {budget >> 20:>5} {o['reuse']:>10.2f} {p['reuse']:>6.2f} "
            f"{ratio:>5.2f}x {o['turn_hits']:>14.2f} {p['turn_hits']:>6.2f}",
            flush=True,
        )
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"shape": shape._asdict(), "shared_tokens": shared, "rows": rows}, indent=2)
    )
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
