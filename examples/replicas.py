"""Replicas behind a router: does each conversation keep finding its prefix?

Workload 2's shape (multiturn.py): conversations sharing one system prompt, each turn of
all of them sent at once, greedy, replies of --max-tokens. Run against:

  one          one server holding everything (the hit rate to match)
  cache_aware  2 replicas behind sglang-router's cache-aware policy (an approximate radix
               tree of each worker's prompts, no help from the client)
  round_robin  2 replicas behind sglang-router's round robin (conversations scatter)
  haproxy      2 replicas behind HAProxy, consistent hashing on the request's
               prompt_cache_key (one per conversation, as OpenAI's docs ask clients to send)

Reported: reuse (cached / prompt tokens), the share of follow-up turns whose previous turn
was cached, each replica's share of requests, TTFT medians and completion tokens/s over the
run's wall time.

    python examples/replicas.py [--convs 32] [--turns 3] [--setups one,cache_aware,...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir

# The servers, clients and result envelope of the benchmark suite (bench/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
RESULTS = Path(__file__).resolve().parent / "results"

from envelope import write_result  # noqa: E402
from harness import (  # noqa: E402
    Call,
    free_port,
    question,
    running,
    send,
    system_prompt,
    turn_hits,
    wait_ready,
)  # fmt: skip

HAPROXY = (Path(__file__).parents[1] / "configs" / "haproxy.cfg").read_text()


@contextmanager
def router(setup: str, ports: list[int], extra: list[str]):
    """The URL to send requests to: the one server, or a router in front of the replicas."""
    if setup == "one":
        yield f"http://127.0.0.1:{ports[0]}"
        return
    port = free_port()
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    if setup == "haproxy":
        config = Path(tempfile.mkstemp(suffix=".cfg")[1])
        servers = "\n".join(f"    server r{i} 127.0.0.1:{p}" for i, p in enumerate(ports))
        text = HAPROXY.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        config.write_text(text.split("    server r1")[0] + servers + "\n")
        cmd = [shutil.which("haproxy") or "haproxy", "-f", str(config)]
    else:
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--policy", setup, "--port", str(port), "--worker-urls", *workers,
            "--log-level", "warn", "--prometheus-port", str(free_port()), *extra,
        ]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix=f"router-{setup}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [proc], setup, seconds=60, log=Path(log.name))
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


async def send_keyed(client: AsyncOpenAI, call: Call, key: str, max_tokens: int) -> None:
    """multiturn's streamed request, with the conversation's key; its reply joins its history."""
    await send(client, "bench", call, max_tokens, {"prompt_cache_key": key})
    call.messages = [*call.messages, {"role": "assistant", "content": call.reply}]


async def workload(url: str, convs: int, turns: int, words: int, max_tokens: int) -> list[Call]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
    system = system_prompt(words, seed=12)
    history = [[{"role": "system", "content": system}] for _ in range(convs)]
    calls: list[Call] = []
    order = list(range(convs))
    for turn in range(turns):
        wave = []
        # Clients do not arrive in the same order every turn: without this, round robin
        # would hand each conversation the same replica every turn by accident.
        random.Random(turn).shuffle(order)
        for conv in order:
            history[conv].append({"role": "user", "content": question(conv, turn)})
            wave.append(Call("2-shared", conv, turn, turn, list(history[conv])))
        await asyncio.gather(*(send_keyed(client, c, f"conv-{c.conv}", max_tokens) for c in wave))
        for c in wave:
            history[c.conv] = list(c.messages)
        calls += wave
    return calls


def requests_served(ports: list[int]) -> list[int]:
    """Each replica's lookups, from its /v1/cache."""
    counts = []
    for p in ports:
        stats = httpx.get(f"http://127.0.0.1:{p}/v1/cache").json()
        counts.append(sum(m["lookups"] for m in stats.get("models", [])))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--convs", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--words", type=int, default=300, help="words of the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--setups", default="one,cache_aware,round_robin,haproxy")
    ap.add_argument(
        "--router-args",
        default="--balance-abs-threshold 1 --balance-rel-threshold 1.1 --cache-threshold 0.05",
        help="more sglang-router flags (default: balance the replicas' loads as soon as "
        "they differ; the router's own defaults send every conversation sharing a system "
        "prompt to one replica)",
    )
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    results = {}
    for setup in args.setups.split(","):
        replicas = 1 if setup == "one" else 2
        with ExitStack() as stack:
            servers = [
                stack.enter_context(running("ours", model, 256, 2 * 1024**3))
                for _ in range(replicas)
            ]
            ports = [s.port for s in servers]
            url = stack.enter_context(router(setup, ports, args.router_args.split()))
            print(f"[{setup}] {replicas} replica(s) behind {url}", flush=True)
            t0 = time.perf_counter()
            calls = asyncio.run(workload(url, args.convs, args.turns, args.words, args.max_tokens))
            wall = time.perf_counter() - t0
            served = requests_served(ports)
        prompt = sum(c.prompt_tokens for c in calls)
        warm = [c.ttft for c in calls if c.turn > 0]
        results[setup] = {
            "replicas": replicas,
            "reuse": sum(c.cached_tokens for c in calls) / prompt,
            "turn_hits": turn_hits(calls),
            "requests_per_replica": served,
            "warm_ttft_median": statistics.median(warm),
            "cold_ttft_median": statistics.median(c.ttft for c in calls if c.turn == 0),
            "completion_tokens_per_s": sum(c.completion_tokens for c in calls) / wall,
            "wall_s": wall,
        }
        r = results[setup]
        print(
            f"[{setup}] reuse {r['reuse']:.3f}, turn hits {r['turn_hits']:.2f}, requests "
            f"{served}, warm TTFT {r['warm_ttft_median']:.2f} s, cold "
            f"{r['cold_ttft_median']:.2f} s, {r['completion_tokens_per_s']:.1f} tokens/s",
            flush=True,
        )
        # After each setup: a later one's failure keeps these.
        write_result("replicas.json", args, started, results, folder=RESULTS)
    if "one" in results:
        for setup, r in results.items():
            print(f"{setup}: reuse {r['reuse'] / results['one']['reuse']:.3f}x one server's")


if __name__ == "__main__":
    main()
