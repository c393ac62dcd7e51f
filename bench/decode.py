"""Decode throughput with many streams: ours against mlx_lm.server.

Each server runs alone in turn (default model, OpenBLAS, `harness.start`). For each
stream count (8, 16), that many unique short chats stream at once through the `openai`
SDK, greedy, `--tokens` tokens each (the end token banned with logit_bias so every
stream runs to the end); each server once a round, in alternating order. Reported:
output tokens per second over the window in which all streams decode (the last first
token to the first last token), and the streams' inter-token latency p50/p99 in that
window; ours over the peer's.

    python bench/decode.py [--streams 8,16] [--tokens 128] [--rounds 1] [--ours-at PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from envelope import write_result
from harness import running, system_prompt
from openai import OpenAI

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 2 * 1024**3


def stream(url: str, model: str, i: int, tokens: int, ban: dict, out: list) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)
    messages = [{"role": "user", "content": f"Story {i}: " + system_prompt(20, i)}]
    times = []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True,
        logit_bias=ban,
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    out.append(times)


def run(url: str, model: str, n: int, tokens: int, ban: dict) -> dict:
    out: list[list[float]] = []
    threads = [
        threading.Thread(target=stream, args=(url, model, i + 100 * n, tokens, ban, out))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(out):
        return {}
    start = max(times[0] for times in out)  # every stream decoding from here...
    end = min(times[-1] for times in out)  # ...to here
    inside = [[t for t in times if start <= t <= end] for times in out]
    count = sum(max(0, len(times) - 1) for times in inside)
    gaps = [b - a for times in inside for a, b in zip(times, times[1:], strict=False)]
    if not gaps:  # the streams never all decoded at once (a warm-up's short replies)
        return {}
    return {
        "tokens_per_s": count / (end - start) if end > start else 0.0,
        "itl_p50_ms": statistics.median(gaps) * 1000,
        "itl_p99_ms": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="8,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="each server started once a round")
    ap.add_argument(
        "--ours-at",
        help="also run our server from this checkout folder (say, a worktree of HEAD~1)",
    )
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    ban = {str(eos): -100}
    servers = {"ours": "ours", "peer": "peer"}
    if args.ours_at:
        servers = {"ours": "ours", "ours (before)": f"ours@{args.ours_at}", "peer": "peer"}
    rounds: dict[str, dict[int, list[dict]]] = {}
    for r in range(args.rounds):
        order = list(servers.items())
        for name, kind in order if r % 2 == 0 else order[::-1]:  # neither always first
            with running(kind, model, 64, BUDGET) as server:
                url = f"http://127.0.0.1:{server.port}"
                served = model if kind == "peer" else "bench"
                run(url, served, 2, 8, ban)  # warm-up: the first requests pay for loading
                for n in (int(x) for x in args.streams.split(",")):
                    out = run(url, served, n, args.tokens, ban)
                    rounds.setdefault(name, {}).setdefault(n, []).append(out)
                    print(r, name, n, out, flush=True)
    summary = {
        name: {n: summarize(runs, rounds["peer"][n]) for n, runs in by_n.items()}
        for name, by_n in rounds.items()
    }
    write_result("decode.json", args, started, summary, raw={"rounds": rounds})
    print(json.dumps(summary, indent=2))


def summarize(runs: list[dict], peer: list[dict]) -> dict:
    """Medians over the rounds; over_peer: of the rounds' ratios (each round's runs were
    minutes apart, so a ratio within a round is less exposed to the host's drift)."""
    keys = ("tokens_per_s", "itl_p50_ms", "itl_p99_ms")
    out = {k: statistics.median(run[k] for run in runs) for k in keys}
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs, peer, strict=True)]
    out["over_peer"] = statistics.median(ratios)
    out["over_peer_by_round"] = ratios
    return out


if __name__ == "__main__":
    main()
