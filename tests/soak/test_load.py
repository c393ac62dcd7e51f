"""Load and soak test: many streaming clients, with disconnects, bad requests and flushes.

Starts our server (the default model, or $SOAK_MODEL) on a free loopback port and runs
$SOAK_CLIENTS async clients (32) for $SOAK_SECONDS (180). Each client loops: a streaming
chat turn (most of the time), a stream it drops after a few chunks, or a bad request
(malformed, or out of a parameter's bounds). A flusher empties the cache every
$SOAK_FLUSH_EVERY seconds (10; 0: never) while inserts run; a monitor polls /v1/cache and
the server's RSS every second. Afterwards: the server must still answer, the cache must
have stayed within its budget, every request that stayed connected must have got its
whole answer (lost: 0), no response may be a 5xx, and RSS must be back near the baseline
plus what the cache holds. Errors are counted by class in the report, written outside the
repository. Behind the `soak` marker, which the default run leaves out:

    python -m pytest -m soak tests/soak -s
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import pytest

from mlx_cache_server.models.default_model import NAME, default_model_dir

SYSTEM = "You are a helpful assistant. Keep answers short and friendly. " * 6
BAD = [
    b'{"model": "m", "messages": [',
    json.dumps({"model": NAME, "messages": []}).encode(),
    json.dumps({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
    json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
    json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}], "n": 3}).encode(),
    json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}
    ).encode(),
    # Out of bounds that once failed every running stream, or gave a 500.
    json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_k": 10**9}
    ).encode(),
    json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "seed": 2**70}
    ).encode(),
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}
    ).encode(),
]


@dataclass
class Tally:
    completed: int = 0
    lost: int = 0  # stayed connected but got no complete answer
    dropped: int = 0  # disconnected on purpose
    bad_4xx: int = 0
    bad_not_4xx: int = 0
    busy_429: int = 0
    server_5xx: int = 0
    ttft: list[float] = field(default_factory=list)
    cache_over_budget: int = 0
    cache_bytes_max: int = 0
    flushes: int = 0
    errors: Counter = field(default_factory=Counter)  # by class: status, error event, transport
    rss_samples: list[int] = field(default_factory=list)


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def chat_turn(client: httpx.AsyncClient, tally: Tally, history: list, drop: bool) -> None:
    body = {"model": NAME, "messages": history, "max_tokens": 24, "temperature": 0,
            "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    text, done, finish, first = [], False, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            tally.errors[f"chat {r.status_code}"] += 1
        if r.status_code == 429:
            tally.busy_429 += 1
            return
        if r.status_code >= 500:
            tally.server_5xx += 1
            return
        if r.status_code != 200:
            tally.lost += 1
            return
        n = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            n += 1
            if drop and n >= random.randint(2, 6):
                tally.dropped += 1
                return  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                tally.errors[f"stream error event: {payload['error']['type']}"] += 1
                break
            choice = payload["choices"][0] if payload["choices"] else None
            if choice and choice["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(choice["delta"]["content"])
            if choice and choice["finish_reason"]:
                finish = choice["finish_reason"]
    if done and finish in ("stop", "length"):
        tally.completed += 1
        if first:
            tally.ttft.append(first - t0)
        history.append({"role": "assistant", "content": "".join(text)})
    else:
        tally.lost += 1


async def bad_request(client: httpx.AsyncClient, tally: Tally) -> None:
    r = await client.post(
        "/v1/chat/completions",
        content=random.choice(BAD),
        headers={"content-type": "application/json"},
    )
    tally.errors[f"bad request {r.status_code}"] += 1
    if 400 <= r.status_code < 500:
        tally.bad_4xx += 1
    else:
        tally.bad_not_4xx += 1
        tally.server_5xx += r.status_code >= 500


async def user(client: httpx.AsyncClient, tally: Tally, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    history = [{"role": "system", "content": SYSTEM}]
    turn = 0
    while time.monotonic() < deadline:
        roll = rng.random()
        try:
            if roll < 0.15:
                await bad_request(client, tally)
                continue
            if len(history) > 9:  # start a new conversation now and then
                history = [{"role": "system", "content": SYSTEM}]
            history.append({"role": "user", "content": f"User {seed} asks question {turn}."})
            turn += 1
            await chat_turn(client, tally, history, drop=roll > 0.85)
            if history[-1]["role"] == "user":
                history.pop()
        except httpx.HTTPError as e:
            tally.errors[f"transport {type(e).__name__}"] += 1
            tally.lost += 1


async def monitor(client: httpx.AsyncClient, tally: Tally, pid: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        report = (await client.get("/v1/cache")).json()
        tally.cache_bytes_max = max(tally.cache_bytes_max, report["bytes"])
        budget = report["max_bytes"]
        tally.cache_over_budget += budget is not None and report["bytes"] > budget
        tally.rss_samples.append(rss(pid))
        await asyncio.sleep(1)


async def flusher(client: httpx.AsyncClient, tally: Tally, every: float, deadline: float) -> None:
    """Flushes the cache now and then while clients' turns are being inserted."""
    while every > 0 and time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        r = await client.delete("/v1/cache")
        tally.flushes += r.status_code == 200
        if r.status_code != 200:
            tally.errors[f"flush {r.status_code}"] += 1


async def run(url: str, pid: int, clients: int, seconds: float, flush_every: float) -> Tally:
    tally = Tally()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            monitor(client, tally, pid, deadline),
            flusher(client, tally, flush_every, deadline),
            *(user(client, tally, deadline, seed) for seed in range(clients)),
        )
    return tally


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start (exit status {proc.poll()})")


@pytest.mark.soak
def test_load() -> None:
    clients = int(os.environ.get("SOAK_CLIENTS", "32"))
    seconds = float(os.environ.get("SOAK_SECONDS", "180"))
    flush_every = float(os.environ.get("SOAK_FLUSH_EVERY", "10"))
    model = os.environ.get("SOAK_MODEL") or str(default_model_dir())
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_cache_server", "serve", "--model", model, "--port", str(port),
           "--served-model-name", NAME, "--cache-max-bytes", "256MiB",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        ask(url, "hi").raise_for_status()
        baseline = rss(proc.pid)
        tally = asyncio.run(run(url, proc.pid, clients, seconds, flush_every))
        time.sleep(3)  # let cancelled generations wind down
        after = rss(proc.pid)
        healthy = httpx.get(url + "/health").json()
        final = ask(url, "still ok?")
        cache = httpx.get(url + "/v1/cache").json()
    finally:
        proc.terminate()
        proc.wait(60)
    ttft = sorted(tally.ttft)
    report = {
        "clients": clients,
        "seconds": seconds,
        "flush_every_s": flush_every,
        **{k: v for k, v in asdict(tally).items() if k not in ("ttft", "rss_samples", "errors")},
        "errors_by_class": dict(sorted(tally.errors.items())),
        "ttft_median_s": ttft[len(ttft) // 2] if ttft else None,
        "rss_baseline_mib": baseline >> 20,
        "rss_peak_mib": max(tally.rss_samples or [0]) >> 20,
        "rss_after_mib": after >> 20,
        "cache_bytes_after": cache["bytes"],
        "cache_budget": cache["max_bytes"],
        "healthy_after": healthy["status"] == "ok" and final.status_code == 200,
        # Back near the baseline: what the cache holds, plus 15% slack for the allocator.
        "memory_back": after <= baseline + cache["bytes"] + 0.15 * baseline,
        "running_after": healthy["running"],
    }
    out = Path(tempfile.gettempdir()) / "mlx-cache-server-soak.json"
    out.write_text(json.dumps(report, indent=2))
    for key, value in report.items():
        print(f"{key:>20}: {value}")
    assert report["healthy_after"], report
    assert report["memory_back"], report
    assert tally.lost == 0, report["errors_by_class"]
    assert tally.server_5xx == 0, report["errors_by_class"]
    assert tally.bad_not_4xx == 0, report["errors_by_class"]
    assert tally.cache_over_budget == 0, report


def ask(url: str, text: str) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
