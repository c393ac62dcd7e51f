"""Workload 3 with RAM at a quarter of what it needs and the disk tier on.

Round-robin conversations (multiturn.py's workload 3) with the cache's RAM
budget at `--factor` (0.25) of what they need with the shared system prompt stored
once: each conversation is evicted from RAM before its next turn. Three servers,
one after the other, the same requests:

  ours-disk  that RAM budget, with --cache-dir: evicted turns come back from disk
  ours-ram   a budget that holds everything (1.5x): the all-RAM reference
  peer       mlx_lm.server at the same RAM budget as ours-disk

Reported per server: turn hits (follow-ups whose whole history was reused), reuse,
warm TTFT median; and ours-disk's warm TTFT over ours-ram's.

    python bench/overflow_disk.py [--factor 0.25] [--conversations 8] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from envelope import write_result
from harness import Server, running
from multiturn import (
    ChatShape,
    Workloads,
    add_ceilings,
    chat_sizes,
    kv_bytes_per_token,
    summarize,
)
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--factor", type=float, default=0.25)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--out", type=Path, default=Path("overflow_disk.json"), help="in bench/results/"
    )
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    workloads = Workloads(quick=False)
    workloads.max_tokens = args.max_tokens
    shape = ChatShape(NAME, NAME, args.conversations, args.turns, False, args.system_words, 13)
    shared, own = chat_sizes(shape, args.max_tokens, tokenizer)
    need = (shared + args.conversations * own) * kv_bytes_per_token(Path(model))
    small, large = int(args.factor * need), int(1.5 * need)
    rows = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        rows["ours-disk"] = run("ours", model, small, workloads, shape, tokenizer,
                                ["--cache-dir", cache_dir])  # fmt: skip
    rows["ours-ram"] = run("ours", model, large, workloads, shape, tokenizer)
    rows["peer"] = run("peer", model, small, workloads, shape, tokenizer)
    keys = ("turn_hits", "reuse", "warm_ttft_median", "cold_ttft_median", "peak_rss")
    summary = {kind: {k: row[k] for k in keys} for kind, row in rows.items()}
    summary["disk_over_ram_warm_ttft"] = (
        rows["ours-disk"]["warm_ttft_median"] / rows["ours-ram"]["warm_ttft_median"]
    )
    summary["budgets"] = {"ram_small": small, "ram_large": large, "need": need}
    write_result(args.out.name, args, started, summary, raw={"rows": rows})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
