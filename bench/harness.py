"""What every workload shares: starting and stopping the servers it compares, a streaming
client that records one request's timings, percentiles and the prompts the chat workloads
are built from. The result envelope and where results go are in envelope.py.

A server is named by its kind:

  ours          this checkout's server
  ours-nocache  the same with --no-cache
  ours@PATH     our server from another checkout (say, the previous commit), run from PATH
  peer          mlx_lm.server with the same cache limits
  vlm           mlx-vlm's server (python -m mlx_vlm.server), for the image workload
  llama.cpp     llama.cpp's llama-server (the binary in $LLAMA_SERVER or on PATH; the model
                is a GGUF file), where a workload is given one
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx
from openai import APIConnectionError, AsyncOpenAI

from mlx_cache_server.runtime.blas import find_openblas

RESULTS = Path(__file__).parent / "results"
WORDS = (
    "system careful answer question concise helpful detail example context reason clear "
    "brief accurate friendly polite expert language model user assistant guideline rule"
).split()


@dataclass
class Call:
    workload: str
    conv: int
    turn: int
    wave: int  # requests of one wave are sent together
    messages: list[dict]
    ttft: float = 0.0
    total: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reply: str = ""
    ceiling: int = 0
    retries: int = 0  # attempts lost to a dropped connection before this one succeeded


@dataclass
class Server:
    kind: str  # see the module's docstring
    port: int
    proc: subprocess.Popen | None = None
    peak_rss: int = 0
    cache_bytes_peak: int = 0  # ours: /v1/cache after each wave; the peer: its own log
    log: Path | None = None
    calls: list[Call] = field(default_factory=list)


# Every kind started in this process, with its command line: the envelope's `servers`.
STARTED: dict[str, list[str]] = {}


class ServerFailed(RuntimeError):
    """A server that did not start. It says what this machine lacks (a model not found
    offline, a binary, a module), so a run ends on that one line, not on a traceback."""


def _one_line(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if isinstance(exc, ServerFailed):
        print(f"{Path(sys.argv[0]).stem}: {exc}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, exc, tb)


# Every workload imports this module: its uncaught ServerFailed is printed as one line.
sys.excepthook = _one_line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_ours(kind: str) -> bool:
    return kind.startswith("ours")


def peer_env(kind: str) -> dict[str, str]:
    """The environment a server of `kind` starts in. All get the same BLAS: ours loads
    OpenBLAS itself (an older tree of ours, `ours@`, preloaded it), mlx_lm.server and
    mlx-vlm's server are given it in LD_PRELOAD, where it serves MLX's matmuls the same way."""
    env = dict(os.environ)
    if not is_ours(kind) and kind != "llama.cpp" and (openblas := find_openblas()):
        env["LD_PRELOAD"] = openblas
    return env


def package(tree: str | None) -> str:
    """The server's import package in `tree` (this one if None): `app` before it had a name
    of its own."""
    root = Path(tree) if tree else Path(__file__).resolve().parents[1]
    return "mlx_cache_server" if (root / "mlx_cache_server").is_dir() else "app"


def command(
    kind: str, model: str, port: int, max_sequences: int, max_bytes: int, extra: Sequence[str]
) -> list[str]:
    """The command line that serves `model` on `port` as a server of `kind`."""
    if kind == "peer":
        # INFO: its "Prompt Cache: N sequences, X GB" lines give the bytes it holds.
        return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port),
                "--prompt-cache-size", str(max_sequences), "--prompt-cache-bytes",
                str(max_bytes), "--log-level", "INFO"]  # fmt: skip
    if kind == "vlm":
        return [sys.executable, "-m", "mlx_vlm.server", "--model", model, "--port", str(port),
                "--log-level", "WARNING", *extra]  # fmt: skip
    if kind == "llama.cpp":
        binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
        if binary is None:
            raise RuntimeError("llama.cpp: set LLAMA_SERVER or put llama-server on PATH")
        return [binary, "-m", model, "--port", str(port), "--alias", "bench", *extra]
    cmd = [sys.executable, "-m", package(kind.partition("@")[2] or None), "serve",
           "--model", model, "--port", str(port), "--served-model-name", "bench",
           "--cache-max-sequences", str(max_sequences), "--cache-max-bytes", str(max_bytes),
           "--log-level", "warning"]  # fmt: skip
    if kind == "ours-nocache":
        cmd.append("--no-cache")
    return cmd + list(extra)


def start(
    kind: str, model: str, max_sequences: int, max_bytes: int, extra: Sequence[str] = ()
) -> Server:
    port = free_port()
    # "ours@PATH" runs from its folder so that `-m` imports that tree's code.
    cwd = kind.partition("@")[2] or None
    cmd = command(kind, model, port, max_sequences, max_bytes, extra)
    # A kind started twice with other flags (say ours with and without a header) keeps both.
    key = kind if kind not in STARTED else f"{kind}#{sum(k.startswith(kind) for k in STARTED) + 1}"
    STARTED[key] = [Path(cmd[0]).name, *cmd[1:]]
    log = Path(tempfile.mkstemp(prefix=f"bench-{kind.replace('/', '_')}-", suffix=".log")[1])
    with log.open("wb") as err:
        proc = subprocess.Popen(
            cmd, env=peer_env(kind), cwd=cwd, stdout=subprocess.DEVNULL, stderr=err
        )
    path = "/health" if kind == "llama.cpp" else "/v1/models"
    try:
        wait_ready(f"http://127.0.0.1:{port}", [proc], f"{kind} server", path=path, log=log)
    except RuntimeError:
        proc.kill()
        raise
    return Server(kind, port, proc, log=log)


def wait_ready(
    url: str,
    procs: Sequence[subprocess.Popen],
    what: str,
    seconds: float = 300,
    path: str = "/v1/models",
    log: Path | None = None,
) -> None:
    """Return once `url` answers `path` with a 200; ServerFailed (with the last thing `log`
    says) if one of `procs` exits first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        exited = [p.returncode for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            why = f"exited with {exited[0]}" if exited else "did not start"
            said = f": {last_words(log)} (its log: {log})" if log is not None else ""
            raise ServerFailed(f"{what} {why}{said}")
        time.sleep(0.5)


def last_words(log: Path) -> str:
    """The last line of a server's log that is not a traceback's frame or heading: what
    stopped it (an exception's message, or the text that explains it)."""
    headings = ("Traceback", "The above exception", "During handling")
    lines = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if line.strip() and not line[0].isspace() and not line.startswith(headings)
    ]
    return lines[-1][:400] if lines else "nothing in its log"


@contextmanager
def running(
    kind: str, model: str, max_sequences: int, max_bytes: int, extra: Sequence[str] = ()
) -> Iterator[Server]:
    """A started server, stopped (peak RSS and cache bytes read) however the block ends."""
    server = start(kind, model, max_sequences, max_bytes, extra)
    try:
        yield server
    finally:
        stop(server)


def stop(server: Server) -> None:
    try:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        server.peak_rss = next(
            int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM")
        )
    except (OSError, StopIteration):
        server.peak_rss = 0
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
    if server.log is not None:
        if server.kind == "peer":
            server.cache_bytes_peak = peer_cache_bytes(server.log)
        server.log.unlink(missing_ok=True)


def observe(server: Server) -> None:
    """Track the most bytes our cache has held (the peer's come from its log at stop)."""
    if server.kind == "ours" or server.kind.startswith("ours@"):
        report = httpx.get(f"http://127.0.0.1:{server.port}/v1/cache", timeout=10).json()
        server.cache_bytes_peak = max(server.cache_bytes_peak, report["bytes"])


def peer_cache_bytes(log: Path) -> int:
    """The most bytes mlx_lm.server reported holding (logged in GB, to 10 MB)."""
    found = re.findall(rb"Prompt Cache: \d+ sequences, ([\d.]+) GB", log.read_bytes())
    return max((int(float(gb) * 1e9) for gb in found), default=0)


async def send(
    client: AsyncOpenAI, model: str, call: Call, max_tokens: int, extra: dict | None = None
) -> None:
    """One streamed request; a dropped connection is retried (and counted), not fatal.

    mlx_lm.server has dropped a connection under concurrent streams: one lost request
    must not cost a run of tens of minutes. The retry's TTFT is the one recorded.
    """
    for attempt in range(3):
        try:
            await _send_once(client, model, call, max_tokens, extra)
            return
        except (APIConnectionError, httpx.TransportError):
            if attempt == 2:
                raise
            call.retries += 1
            await asyncio.sleep(1)


async def _send_once(
    client: AsyncOpenAI, model: str, call: Call, max_tokens: int, extra: dict | None
) -> None:
    call.ttft = 0.0
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=call.messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not parts:
                call.ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            call.prompt_tokens = chunk.usage.prompt_tokens
            call.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            call.cached_tokens = (details.cached_tokens or 0) if details else 0
    call.total = time.perf_counter() - t0
    call.ttft = call.ttft or call.total
    call.reply = "".join(parts)


def system_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def question(conv: int, turn: int) -> str:
    n = turn * 7 + conv
    return f"Conversation {conv}, turn {turn}: tell me one short fact about the number {n}."


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def turn_hits(calls: list[Call]) -> float | None:
    """Share of follow-up turns whose previous turn's whole prompt came from the cache.

    Token reuse alone hides whether a conversation's own history survived: a cache
    that only kept the shared system prompt still reuses most tokens.
    """
    previous: dict[int, Call] = {}
    hits = total = 0
    for c in calls:
        p = previous.get(c.conv)
        if p is not None and c.turn == p.turn + 1:
            total += 1
            hits += c.cached_tokens >= p.prompt_tokens
        previous[c.conv] = c
    return hits / total if total else None
