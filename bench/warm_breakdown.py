"""Where a warm turn's time to first token goes when chats arrive together.

Our server alone (default model, OpenBLAS, `multiturn.start`): --convs chats sharing a
--words-word system prompt, each turn of all of them sent at once, greedy, streamed,
replies of --max-tokens. For every later (warm) turn, its TTFT seen by the client is split
with the server's request log into:

  before the engine   the client's TTFT less the server's (HTTP, the template, tokenizing,
                      handing the stream back)
  waiting             from the engine's intake to admission: the inbox, then the queue
                      while other prompts prefill (`queued_ms`)
  prefill             from admission to the first token: the uncached tokens' prefill and
                      its step, shared with the streams decoding (`ttft_ms - queued_ms`)

Reported as medians over the warm turns, with the uncached tokens each prefilled.

    python bench/warm_breakdown.py [--convs 8] [--turns 3] [--words 300] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from multiturn import RESULTS, question, running, system_prompt
from openai import AsyncOpenAI

from app.models.default_model import default_model_dir


async def turn(client: AsyncOpenAI, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model="bench", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    out = {"id": None, "ttft": None, "text": ""}
    async for chunk in stream:
        out["id"] = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            if out["ttft"] is None:
                out["ttft"] = time.perf_counter() - t0
            out["text"] += chunk.choices[0].delta.content
    return out


async def conversations(url: str, args: argparse.Namespace) -> list[dict]:
    system = system_prompt(args.words, seed=3)
    chats = [[{"role": "system", "content": system}] for _ in range(args.convs)]
    seen = []
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600) as c:
        for t in range(args.turns):
            for i, chat in enumerate(chats):
                chat.append({"role": "user", "content": question(i, t)})
            replies = await asyncio.gather(*(turn(c, chat, args.max_tokens) for chat in chats))
            for chat, reply in zip(chats, replies, strict=True):
                chat.append({"role": "assistant", "content": reply["text"]})
                seen.append({**reply, "turn": t})
    return seen


def server_lines(log: str) -> dict[str, dict]:
    lines = {}
    for line in log.splitlines():
        start = line.find('{"event": "request"')
        if start >= 0:
            entry = json.loads(line[start:])
            lines[entry["id"]] = entry
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    model = str(default_model_dir())
    with running("ours", model, 64, 2 * 1024**3, ["--log-level", "info"]) as server:
        url = f"http://127.0.0.1:{server.port}"
        asyncio.run(conversations(url, argparse.Namespace(**{**vars(args), "turns": 1,
                                                                "convs": 1})))  # fmt: skip
        seen = asyncio.run(conversations(url, args))
        logged = server_lines(server.log.read_text())
    rows = []
    for reply in seen:
        entry = logged.get(reply["id"])
        if reply["turn"] == 0 or entry is None or reply["ttft"] is None:
            continue
        rows.append({
            "client_ttft_ms": reply["ttft"] * 1000,
            "before_engine_ms": reply["ttft"] * 1000 - entry["ttft_ms"],
            "waiting_ms": entry["queued_ms"],
            "prefill_ms": entry["ttft_ms"] - entry["queued_ms"],
            "uncached_tokens": entry["prompt_tokens"] - entry["cached_tokens"],
        })  # fmt: skip
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    summary["warm_turns"] = len(rows)
    (RESULTS / "warm_breakdown.json").write_text(
        json.dumps({"args": vars(args), "median": summary, "turns": rows}, indent=1)
    )
    for k, v in summary.items():
        print(f"{k:20} {v:10.1f}")


if __name__ == "__main__":
    main()
