"""Continuing a long conversation after a restart: ours with --cache-dir against mlx_lm.server.

A conversation of about `--tokens` prompt tokens is sent to a server (a cold
prefill), the server is stopped with SIGTERM and started again, the page cache is
dropped (when this user may, so the files are really read from the disk), and the
next turn is sent. Ours loads the conversation's KV from its disk tier;
mlx_lm.server, which has none, prefills it all again. The same next-turn prompt is
also sent to ours with --no-cache: its cold prefill, the reference.

Reported: TTFT of the turn after the restart, ours and the peer's, against that
cold prefill; the disk tier's load bandwidth (from /v1/cache) against this disk's
sequential read speed (a file of the same size read after dropping the page cache);
and whether the greedy replies match.

    python bench/restart.py [--tokens 7000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from envelope import write_result
from harness import start, stop, system_prompt
from openai import OpenAI
from transformers import AutoTokenizer

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 4 * 1024**3


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def conversation(model: str, tokens: int) -> list[dict]:
    """A system prompt and a question, about `tokens` long in the model's template."""
    tok = AutoTokenizer.from_pretrained(model)
    lo, hi = 10, tokens
    while lo < hi:  # the most words that stay within `tokens`
        mid = (lo + hi + 1) // 2
        msgs = [{"role": "system", "content": system_prompt(mid, 5)}]
        msgs.append({"role": "user", "content": "Summarize the rules above in one line."})
        if len(tok.apply_chat_template(msgs, add_generation_prompt=True)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return [
        {"role": "system", "content": system_prompt(lo, 5)},
        {"role": "user", "content": "Summarize the rules above in one line."},
    ]


def ask(port: int, model: str, messages: list[dict]) -> dict:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=3600)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    ttft, parts, usage = None, [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details
    return {
        "ttft": ttft or time.perf_counter() - t0,
        "reply": "".join(parts),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
    }


def across_restart(kind: str, model: str, first: list[dict], extra: list[str]) -> dict:
    name = "bench" if kind != "peer" else model
    server = start(kind, model, 64, BUDGET, extra)
    try:
        before = ask(server.port, name, first)
    finally:
        stop(server)
    turn = [*first, {"role": "assistant", "content": before["reply"]}]
    turn.append({"role": "user", "content": "And in one word?"})
    server = start(kind, model, 64, BUDGET, extra)
    try:
        dropped = drop_page_cache()
        after = ask(server.port, name, turn)
        report = {}
        if kind != "peer":
            report = httpx.get(f"http://127.0.0.1:{server.port}/v1/cache").json()
    finally:
        stop(server)
    return {"before": before, "after": after, "page_cache_dropped": dropped,
            "disk": report.get("disk"), "next_turn": turn}  # fmt: skip


def read_speed(nbytes: int) -> float:
    """Bytes per second reading a fresh file of `nbytes` after dropping the page cache."""
    with tempfile.NamedTemporaryFile(dir=tempfile.gettempdir()) as f:
        block = os.urandom(1 << 20)
        for _ in range(max(1, nbytes >> 20)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        drop_page_cache()
        t0 = time.perf_counter()
        with open(f.name, "rb") as g:
            while g.read(8 << 20):
                pass
        return max(1, nbytes >> 20) * (1 << 20) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--out", type=Path, default=Path("restart.json"), help="in bench/results/")
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    first = conversation(model, args.tokens)
    with tempfile.TemporaryDirectory() as cache_dir:
        ours = across_restart("ours", model, first, ["--cache-dir", cache_dir])
    peer = across_restart("peer", model, first, [])
    cold_server = start("ours-nocache", model, 64, BUDGET)
    try:
        cold = ask(cold_server.port, "bench", ours["next_turn"])
    finally:
        stop(cold_server)
    disk = ours["disk"] or {}
    loaded, seconds = disk.get("bytes_loaded", 0), disk.get("load_seconds", 0.0)
    raw = read_speed(loaded or 1 << 28)
    summary = {
        "prompt_tokens_after_restart": ours["after"]["prompt_tokens"],
        "cached_after_restart": ours["after"]["cached_tokens"],
        "ttft_cold": cold["ttft"],
        "ttft_ours_after_restart": ours["after"]["ttft"],
        "ttft_peer_after_restart": peer["after"]["ttft"],
        "ratio_ours_to_cold": ours["after"]["ttft"] / cold["ttft"],
        "ratio_ours_to_peer": ours["after"]["ttft"] / peer["after"]["ttft"],
        "load_mb_per_s": loaded / seconds / 1e6 if seconds else None,
        "disk_read_mb_per_s": raw / 1e6,
        "page_cache_dropped": ours["page_cache_dropped"],
        "replies_match": ours["after"]["reply"] == peer["after"]["reply"] == cold["reply"],
    }
    for run in (ours, peer):
        run.pop("next_turn")
    write_result(args.out.name, args, started, summary,
                 raw={"ours": ours, "peer": peer, "cold": cold})  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
