"""Several models: the TTFT of a request whose model must be loaded first, against one whose
model is loaded, and the memory an unload gives back. Ours against mlx_lm.server (which swaps
its one model when a request names another), each alone in turn, same requests.

The second model is the default model under a second folder (links to the same files), so
both servers load the same weights. Ours serves both with a memory budget that holds one, so
alternating requests unload one and load the other, as the peer's swap does.

    python bench/models.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from envelope import write_result
from harness import running
from openai import OpenAI

from mlx_cache_server.models.default_model import default_model_dir

CACHE_BYTES = 256 * 1024**2
WORKING = 256 * 1024**2


def ttft(url: str, model: str, i: int) -> float:
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Question {i}: name a colour."}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line[:6] == "VmRSS:")


def measure(url: str, pid: int, first: str, second: str, rounds: int) -> dict:
    ttft(url, first, -1)  # the first request's one-time costs, on the loaded model
    loaded = [ttft(url, first, i) for i in range(rounds)]
    cold = []
    for i in range(rounds):  # each request names the model not loaded
        cold.append(ttft(url, second, 100 + i))
        cold.append(ttft(url, first, 200 + i))
    time.sleep(3)  # as in `unload_memory`: past the servers' idle release
    return {
        "loaded_ttft": statistics.median(loaded),
        "cold_ttft": statistics.median(cold),
        "loaded_runs": loaded,
        "cold_runs": cold,
        "rss_one_model": rss(pid),
    }


def unload_memory(url: str, pid: int, first: str, second: str) -> dict:
    """Ours without a budget: both loaded, then one unloaded through the admin route."""
    ttft(url, first, 300)
    ttft(url, second, 301)
    time.sleep(3)
    both = rss(pid)
    counted = {m["id"]: m["memory_bytes"] for m in httpx.get(url + "/v1/models").json()["data"]}
    r = httpx.post(f"{url}/v1/models/{second}/unload", timeout=60)
    r.raise_for_status()
    time.sleep(3)
    return {"rss_both": both, "rss_after_unload": rss(pid), "counted": counted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    started = time.time()
    folder = default_model_dir()
    copy = Path(tempfile.mkdtemp(prefix="bench-models-")) / "smol-second"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    one = weights + CACHE_BYTES + WORKING
    budget = one * 3 // 2
    ours_flags = [
        "--model", str(copy), "--working-memory", str(WORKING), "--log-level", "warning",
    ]  # fmt: skip
    results = {"weights_bytes": weights, "budget": budget}
    with running(
        "ours", str(folder), 64, CACHE_BYTES, [*ours_flags, "--memory-budget", str(budget)]
    ) as s:
        results["ours"] = measure(
            f"http://127.0.0.1:{s.port}", s.proc.pid, "bench", copy.name, args.rounds
        )
    with running("ours", str(folder), 64, CACHE_BYTES, ours_flags) as s:
        results["ours_unload"] = unload_memory(
            f"http://127.0.0.1:{s.port}", s.proc.pid, "bench", copy.name
        )
    with running("peer", str(folder), 64, CACHE_BYTES) as s:
        results["peer"] = measure(
            f"http://127.0.0.1:{s.port}", s.proc.pid, str(folder), str(copy), args.rounds
        )
    write_result("models.json", args, started, results)
    mib = 1024**2
    print(f"weights {weights / mib:.0f} MiB; our budget {budget / mib:.0f} MiB (one model)")
    for name in ("ours", "peer"):
        r = results[name]
        print(
            f"{name}: TTFT loaded {r['loaded_ttft']:.3f} s, needing a load {r['cold_ttft']:.3f} s; "
            f"RSS with one model {r['rss_one_model'] / mib:.0f} MiB"
        )
    u = results["ours_unload"]
    print(
        f"ours, both loaded: RSS {u['rss_both'] / mib:.0f} MiB; after unloading one "
        f"{u['rss_after_unload'] / mib:.0f} MiB"
    )


if __name__ == "__main__":
    main()
