"""Quantized KV (`--kv-bits`): what it saves, what it costs, how far its output drifts.

Servers run one at a time on the default model: ours with full-precision KV, ours
with `--kv-bits 8` and `--kv-bits 4`, and mlx_lm.server with `--kv-bits 8
--quantized-kv-start 0` (its default starts quantizing at 5,000 tokens: this
workload would never reach it). Each gets, through the `openai` SDK, greedy:

  agreement      single-turn questions, replies of up to `--tokens` tokens: how much
                 of each reply equals the full-precision reply (tokens up to the
                 first difference), and how many are identical throughout
  conversations  a few chats of several turns on a long system prompt: warm TTFT
                 (turns after the first), decode tokens/s, cached tokens, and the
                 cache's bytes per token held (ours, from /v1/cache)

    python bench/kv_bits.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from envelope import write_result
from harness import Call, running, send, system_prompt
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 4 * 1024**3
SERVERS = {
    "ours": ("ours", []),
    "ours --kv-bits 8": ("ours", ["--kv-bits", "8"]),
    "ours --kv-bits 4": ("ours", ["--kv-bits", "4"]),
    "peer --kv-bits 8": ("peer", ["--kv-bits", "8", "--quantized-kv-start", "0"]),
}
QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "Name three prime numbers and say why they are prime.", "What causes the seasons?",
    "Give me a recipe for pancakes.", "What is a black hole?",
    "Summarize the plot of Romeo and Juliet.", "How does a bicycle stay upright?",
    "What is the difference between a virus and a bacterium?", "Tell me a short joke.",
    "How many legs does a spider have?", "What is machine learning?",
    "Describe the water cycle.", "Why is the sky blue?",
]  # fmt: skip


async def ask(url: str, model: str, messages: list[dict], tokens: int) -> Call:
    call = Call("kv_bits", 0, 0, 0, messages)
    async with AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600
    ) as client:
        await send(client, model, call, tokens)
    return call


async def workload(url: str, model: str, args: argparse.Namespace) -> dict:
    singles = []
    for q in QUESTIONS[: args.questions]:
        singles.append(await ask(url, model, [{"role": "user", "content": q}], args.tokens))
    turns: list[tuple[int, Call]] = []
    for c in range(args.conversations):
        messages = [{"role": "system", "content": system_prompt(args.system_words, c)}]
        for t in range(args.turns):
            messages = [*messages, {"role": "user", "content": QUESTIONS[(c + t) % 16]}]
            call = await ask(url, model, messages, args.tokens)
            messages = [*messages, {"role": "assistant", "content": call.reply}]
            turns.append((t, call))
    return {"singles": singles, "turns": turns}


def agreement(tok, reference: list[Call], other: list[Call]) -> dict:
    shares, identical = [], 0
    for a, b in zip(reference, other, strict=True):
        x, y = tok.encode(a.reply), tok.encode(b.reply)
        pairs = enumerate(zip(x, y, strict=False))
        same = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
        shares.append(same / max(len(x), 1))
        identical += x == y
    return {"token_agreement": statistics.mean(shares), "identical_replies": identical,
            "replies": len(reference)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    started = time.time()
    args.questions, args.conversations, args.turns = (4, 2, 3) if args.quick else (16, 3, 4)
    args.tokens, args.system_words = 64, 600
    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    results: dict[str, dict] = {}
    for name, (kind, extra) in SERVERS.items():
        with running(kind, model, 64, BUDGET, extra) as server:
            url = f"http://127.0.0.1:{server.port}"
            served = "bench" if kind == "ours" else model
            out = asyncio.run(workload(url, served, args))
            report = httpx.get(url + "/v1/cache").json() if kind == "ours" else None
        warm = [c for t, c in out["turns"] if t > 0]
        # Tokens the cache holds: every single reply's sequence, and each conversation's
        # last turn (its earlier turns are its prefixes, stored once).
        ends = [*out["singles"], *(c for t, c in out["turns"] if t == args.turns - 1)]
        held = sum(c.prompt_tokens + c.completion_tokens for c in ends)
        results[name] = {
            "warm_ttft_median": statistics.median(c.ttft for c in warm),
            "cold_ttft_median": statistics.median(c.ttft for t, c in out["turns"] if t == 0),
            "decode_tokens_per_s": statistics.median(
                (c.completion_tokens - 1) / (c.total - c.ttft) for c in out["singles"]
            ),
            "cached_share_warm": sum(c.cached_tokens for c in warm)
            / sum(c.prompt_tokens for c in warm),
            "cache_bytes_per_token": report["bytes"] / held if report else None,
            "calls": out,
        }
        print(name, {k: v for k, v in results[name].items() if k != "calls"}, flush=True)
    reference = results["ours"]["calls"]["singles"]
    summary = {}
    for name, r in results.items():
        calls = r.pop("calls")
        if name != "ours":
            r.update(agreement(tok, reference, calls["singles"]))
        summary[name] = r
    write_result("kv_bits_quick.json" if args.quick else "kv_bits.json", args, started, summary)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
