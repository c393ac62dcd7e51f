"""Multi-turn chat workloads, ours against mlx_lm.server, same model, machine and requests.

Each server runs alone in turn (ours, ours with --no-cache, the peer), started
by this script on a free loopback port with OpenBLAS preloaded and the same
cache limits. A client using the official `openai` SDK (streaming, with
stream_options.include_usage) drives five workloads, greedy:

  1 sequential  a few conversations, many turns, long system prompt
  2 shared      many chats sharing one system prompt, all concurrent, several turns
  3 overflow    more conversations than the byte budget holds, round-robin
  4 branching   regenerate the last answer, then edit the last user message
  5 unique      no reuse possible: what the cache itself costs

Reported per workload and server: TTFT (median, p95), wall time, completion
tokens/s, reuse = sum(cached)/sum(prompt) and its share of the ceiling (the
tokens a perfect cache could have reused, computed from the token streams),
peak RSS, and whether greedy outputs match across servers.

    python bench/multiturn.py            # full run (tens of minutes on 2 CPU cores)
    python bench/multiturn.py --quick    # a smaller run
    python bench/multiturn.py --hybrid gemma3_text   # a tiny random hybrid model instead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx
from openai import APIConnectionError, AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir
from mlx_cache_server.prompt_cache.radix import common_prefix_length
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


class ChatShape(NamedTuple):
    number: str
    name: str
    convs: int
    turns: int
    concurrent: bool
    words: int  # of the system prompt they share
    seed: int  # of the system prompt's words


@dataclass
class Server:
    kind: str  # "ours", "ours-nocache", "peer" or "ours@PATH"
    port: int
    proc: subprocess.Popen | None = None
    peak_rss: int = 0
    cache_bytes_peak: int = 0  # ours: /v1/cache after each wave; the peer: its own log
    log: Path | None = None
    calls: list[Call] = field(default_factory=list)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_env(kind: str) -> dict[str, str]:
    """The environment a server of `kind` starts in. Both get the same BLAS: ours loads
    OpenBLAS itself (an older tree of ours, `ours@`, preloaded it), mlx_lm.server is given
    it in LD_PRELOAD, where it serves MLX's matmuls the same way."""
    env = dict(os.environ)
    if not kind.startswith("ours") and (openblas := find_openblas()):
        env["LD_PRELOAD"] = openblas
    return env


def package(tree: str | None) -> str:
    """The server's import package in `tree` (this one if None): `app` before it had a name
    of its own."""
    root = Path(tree) if tree else Path(__file__).resolve().parents[1]
    return "mlx_cache_server" if (root / "mlx_cache_server").is_dir() else "app"


def start(
    kind: str, model: str, max_sequences: int, max_bytes: int, extra: Sequence[str] = ()
) -> Server:
    port = free_port()
    # "ours@PATH": our server from another checkout (say, the previous commit), run from
    # its folder so that `-m` imports that tree's code.
    cwd = kind.partition("@")[2] or None
    if kind == "peer":
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            model,
            "--port",
            str(port),
            "--prompt-cache-size",
            str(max_sequences),
            "--prompt-cache-bytes",
            str(max_bytes),
            "--log-level",
            "INFO",  # its "Prompt Cache: N sequences, X GB" lines give the bytes it holds
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            package(cwd),
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--served-model-name",
            "bench",
            "--cache-max-sequences",
            str(max_sequences),
            "--cache-max-bytes",
            str(max_bytes),
            "--log-level",
            "warning",
        ]
        if kind == "ours-nocache":
            cmd.append("--no-cache")
        cmd += extra
    env = peer_env(kind)
    log = Path(tempfile.mkstemp(prefix=f"bench-{kind.replace('/', '_')}-", suffix=".log")[1])
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_ready(f"http://127.0.0.1:{port}", [proc], f"{kind} server")
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
    """Return once `url` answers `path` with a 200; RuntimeError (with the end of `log`)
    if one of `procs` exits first or `seconds` pass."""
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
            tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
            raise RuntimeError(f"{what} {why}" + (f": {tail}" if tail else ""))
        time.sleep(0.5)


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


class Workloads:
    """The requests of each workload; each turn's messages depend on the server's replies."""

    def __init__(
        self, quick: bool, only: set[str] | None = None, unique: int | None = None
    ) -> None:
        self.quick = quick
        self.only = only  # workload numbers to run; None: all
        self.n_unique = unique or (3 if quick else 8)
        self.max_tokens = 16 if quick else 32
        self.wave = 0  # counts across workloads: the server's cache outlives each workload

    def next_wave(self) -> int:
        self.wave += 1
        return self.wave

    async def run(self, server: Server, model: str) -> None:
        client = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=3600
        )
        async with client:
            await self._run(server, client, model)

    def chat_workloads(self) -> list[ChatShape]:
        """Workloads 1-3 (bench/overflow_disk.py runs workload 3 with the disk tier).

        Each has a system prompt of its own, so no workload replays another's conversations.
        """
        q = self.quick
        words = 200 if q else 400
        return [
            ChatShape("1", "1-sequential", 2, 3 if q else 6, False, words, seed=11),
            ChatShape("2", "2-shared", 4 if q else 16, 2 if q else 3, True, words, seed=12),
            ChatShape("3", "3-overflow", 4 if q else 8, 3 if q else 4, False, words, seed=13),
        ]

    async def _run(self, server: Server, client: AsyncOpenAI, model: str) -> None:
        for w in self.chat_workloads():
            if self.wants(w.number):
                await self.chats(server, client, model, w)
        if self.wants("4"):
            await self.branching(server, client, model)
        if self.wants("5"):
            await self.unique(server, client, model, n=self.n_unique)

    def wants(self, number: str) -> bool:
        return self.only is None or number in self.only

    async def chats(self, server, client, model, shape: ChatShape) -> None:
        """Conversations turn by turn; sequential ones go round-robin across conversations."""
        name, convs, turns, concurrent = shape.name, shape.convs, shape.turns, shape.concurrent
        system = system_prompt(shape.words, shape.seed)
        history = [[{"role": "system", "content": system}] for _ in range(convs)]
        for turn in range(turns):
            calls = []
            wave = self.next_wave()
            for conv in range(convs):
                history[conv].append({"role": "user", "content": question(conv, turn)})
                calls.append(Call(name, conv, turn, wave, list(history[conv])))
                if not concurrent:
                    wave = self.next_wave()
            if concurrent:
                await asyncio.gather(*(send(client, model, c, self.max_tokens) for c in calls))
            else:
                for c in calls:  # round-robin: conversation after conversation, turn by turn
                    await send(client, model, c, self.max_tokens)
            for conv, c in enumerate(calls):
                history[conv].append({"role": "assistant", "content": c.reply})
            server.calls += calls
            observe(server)

    async def branching(self, server, client, model) -> None:
        system = system_prompt(200 if self.quick else 400, seed=2)
        messages = [{"role": "system", "content": system}]
        for turn in range(3):
            messages.append({"role": "user", "content": question(0, turn)})
            c = Call("4-branching", 0, turn, self.next_wave(), list(messages))
            await send(client, model, c, self.max_tokens)
            messages.append({"role": "assistant", "content": c.reply})
            server.calls.append(c)
            observe(server)
        # The same last turn again, then the last user message edited.
        regenerate = Call("4-branching", 0, 3, self.next_wave(), messages[:-1])
        await send(client, model, regenerate, self.max_tokens)
        edited = messages[:-2] + [{"role": "user", "content": question(0, 99)}]
        edit = Call("4-branching", 0, 4, self.next_wave(), edited)
        await send(client, model, edit, self.max_tokens)
        server.calls += [regenerate, edit]
        observe(server)

    async def unique(self, server, client, model, n) -> None:
        for i in range(n):
            system = f"Session {random.Random(i).getrandbits(64):x}. " + system_prompt(150, 100 + i)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question(i, 0)},
            ]
            c = Call("5-unique", i, 0, self.next_wave(), messages)
            await send(client, model, c, self.max_tokens)
            server.calls.append(c)
            observe(server)


def observe(server: Server) -> None:
    """Track the most bytes our cache has held (the peer's come from its log at stop)."""
    if server.kind == "ours" or server.kind.startswith("ours@"):
        report = httpx.get(f"http://127.0.0.1:{server.port}/v1/cache", timeout=10).json()
        server.cache_bytes_peak = max(server.cache_bytes_peak, report["bytes"])


def peer_cache_bytes(log: Path) -> int:
    """The most bytes mlx_lm.server reported holding (logged in GB, to 10 MB)."""
    found = re.findall(rb"Prompt Cache: \d+ sequences, ([\d.]+) GB", log.read_bytes())
    return max((int(float(gb) * 1e9) for gb in found), default=0)


def add_ceilings(calls: list[Call], tokenizer) -> int:
    """Tokens a perfect cache could have reused for each call, from the token streams.

    Everything sent earlier in the run counts, as the server's cache keeps it across
    workloads: a request of an earlier wave has ended, so its reply could be reused too;
    one of the same wave (sent together) offers its prompt only. Returns the distinct
    tokens of the run (every prefix counted once).
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    seen: list[tuple[int, list[int], int]] = []  # (wave, prompt + reply, prompt length)
    for c in calls:
        prompt = tokenizer.apply_chat_template(c.messages, add_generation_prompt=True)
        best = 0
        for wave, tokens, n_prompt in seen:
            usable = tokens if wave < c.wave else tokens[:n_prompt]
            best = max(best, common_prefix_length(prompt, usable))
        c.ceiling = min(best, len(prompt) - 1)
        reply = tokenizer.encode(c.reply, add_special_tokens=False)
        seen.append((c.wave, prompt + reply + eos, len(prompt)))
    streams = sorted(tokens for _, tokens, _ in seen)
    # Tokens a store sharing every prefix once holds: each stream's own past the one before.
    pairs = zip([[], *streams[:-1]], streams, strict=True)
    return sum(len(b) - common_prefix_length(a, b) for a, b in pairs)


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def summarize(servers: dict[str, Server]) -> dict:
    out: dict = {}
    workloads = sorted({c.workload for s in servers.values() for c in s.calls})
    for w in workloads:
        out[w] = {}
        for kind, s in servers.items():
            calls = [c for c in s.calls if c.workload == w]
            warm = [c.ttft for c in calls if c.turn > 0] or [c.ttft for c in calls]
            cold = [c.ttft for c in calls if c.turn == 0]
            prompt = sum(c.prompt_tokens for c in calls)
            cached = sum(c.cached_tokens for c in calls)
            ceiling = sum(c.ceiling for c in calls)
            wall = sum(c.total for c in calls) if w != "2-shared" else None
            out[w][kind] = {
                "requests": len(calls),
                "turn_hits": turn_hits(calls),
                "ttft_median": statistics.median(c.ttft for c in calls),
                "ttft_p95": percentile([c.ttft for c in calls], 0.95),
                "warm_ttft_median": statistics.median(warm),
                "cold_ttft_median": statistics.median(cold) if cold else None,
                "completion_tokens_per_s": sum(c.completion_tokens for c in calls)
                / max(1e-9, sum(c.total - c.ttft for c in calls)),
                "reuse": cached / prompt if prompt else 0.0,
                "ceiling": ceiling / prompt if prompt else 0.0,
                "reuse_of_ceiling": cached / ceiling if ceiling else 1.0,
                "sequential_wall_s": wall,
            }
    return out


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


def compare_outputs(servers: dict[str, Server]) -> dict[str, int]:
    ours = servers["ours"].calls
    out = {}
    for kind in servers:
        if kind != "ours":
            other = servers[kind].calls
            out[kind] = sum(a.reply != b.reply for a, b in zip(ours, other, strict=True))
    return out


def plot(summary: dict, servers: dict[str, Server], path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, w in zip(axes, ("1-sequential", "2-shared"), strict=True):
        for kind, s in servers.items():
            turns = sorted({c.turn for c in s.calls if c.workload == w})
            med = [
                statistics.median(c.ttft for c in s.calls if c.workload == w and c.turn == t)
                for t in turns
            ]
            ax.plot(turns, med, marker="o", label=kind)
        ax.set_title(f"workload {w}: TTFT by turn (median)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    files.append(path / "ttft_by_turn.png")
    fig.savefig(files[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(9, 4))
    workloads = list(summary)
    kinds = [k for k in servers if k != "ours-nocache"]
    width = 0.8 / (len(kinds) + 1)
    for i, kind in enumerate(kinds):
        ax.bar(
            [j + i * width for j in range(len(workloads))],
            [summary[w][kind]["reuse"] for w in workloads],
            width,
            label=f"{kind} reuse",
        )
    ax.bar(
        [j + len(kinds) * width for j in range(len(workloads))],
        [summary[w]["ours"]["ceiling"] for w in workloads],
        width,
        label="ceiling",
        color="grey",
    )
    ax.set_xticks([j + width for j in range(len(workloads))], workloads)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("Reuse against the ceiling")
    ax.legend()
    fig.tight_layout()
    files.append(path / "reuse.png")
    fig.savefig(files[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(servers), [s.peak_rss / 2**20 for s in servers.values()])
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("Server memory over the whole run")
    fig.tight_layout()
    files.append(path / "memory.png")
    fig.savefig(files[-1], dpi=110)
    plt.close("all")
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    ap.add_argument("--hybrid", default=None, metavar="ARCH",
                    help="a random-weight hybrid model of this mlx-lm architecture "
                         "(tests/hybrid_models.py: gemma3_text, gpt_oss, qwen3_5, nemotron_h, "
                         "lfm2, ...), 8 layers wide 256")  # fmt: skip
    ap.add_argument(
        "--servers",
        default="ours,ours-nocache,peer",
        help="any of ours, ours-nocache, peer, and ours@PATH (our server from that checkout)",
    )
    ap.add_argument("--workloads", default=None, help="e.g. 1,2 (default: all five)")
    ap.add_argument("--report", type=Path, default=None,
                    help="summarize and plot a saved results JSON instead of running")  # fmt: skip
    ap.add_argument("--unique", type=int, default=None, help="requests in workload 5")
    ap.add_argument("--cache-max-sequences", type=int, default=32)
    ap.add_argument(
        "--cache-max-bytes",
        type=int,
        default=None,
        help="byte budget for both caches (default: workload 3 with its prefix stored once)",
    )
    args = ap.parse_args()
    if args.report is not None:
        report(args.report)
        return
    model = args.model or str(default_model_dir())
    if args.hybrid:
        model = str(hybrid_model(args.hybrid))
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model))  # renders chat templates as the servers do
    per_token = kv_bytes_per_token(Path(model))
    only = set(args.workloads.split(",")) if args.workloads else None
    workloads = Workloads(args.quick, only, args.unique)
    budget = args.cache_max_bytes or per_token * overflow_budget_tokens(workloads, tokenizer)
    tag = ("quick" if args.quick else "full") + (f"_w{''.join(sorted(only))}" if only else "")
    tag += f"_{args.hybrid}" if args.hybrid else ""
    servers: dict[str, Server] = {}
    for kind in args.servers.split(","):
        print(f"[{kind}] starting", flush=True)
        name = "bench" if kind != "peer" else model
        with running(kind, model, args.cache_max_sequences, budget) as server:
            asyncio.run(workloads.run(server, name))
        distinct = add_ceilings(server.calls, tokenizer)
        servers[kind] = server
        print(f"[{kind}] done: {len(server.calls)} requests, peak RSS {server.peak_rss >> 20} MiB")
        # Saved after each server, so a later server's failure keeps the runs done so far.
        summary, mismatches = save(RESULTS / f"multiturn_{tag}.json", budget, servers)
    print_table(summary, servers, mismatches, budget)
    llama = per_token * distinct  # every token once, every layer full attention
    print(
        "cache bytes at most, against a llama of the same attention width holding every "
        f"token of the run once ({llama / 2**20:.1f} MiB): "
        + ", ".join(f"{k} {s.cache_bytes_peak / llama:.2f}x" for k, s in servers.items())
    )
    if only is None and "peer" in servers:  # the plots compare all workloads with the peer
        for f in plot(summary, servers, RESULTS):
            print(f"wrote {f}")


def hybrid_model(arch: str) -> Path:
    """A tiny random hybrid model folder (8 layers, hidden 256), built once per arch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.hybrid_models import CONFIGS, build_hybrid_model

    folder = Path(tempfile.gettempdir()) / f"bench-hybrid-{arch}"
    if (folder / "config.json").exists():
        return folder
    wider = {"hidden_size": 256, "intermediate_size": 512}
    if "hybrid_override_pattern" in CONFIGS[arch]:
        wider["hybrid_override_pattern"] = "M-M*-M*-"  # 8 blocks: Mamba, MLP and attention
    elif "layer_types" in CONFIGS[arch]:
        kinds = CONFIGS[arch]["layer_types"]
        wider["num_hidden_layers"] = 8
        wider["layer_types"] = (kinds * 8)[:8]
        if "full_attn_idxs" in CONFIGS[arch]:
            wider["full_attn_idxs"] = [i for i, k in enumerate(wider["layer_types"])
                                       if k == "full_attention"]  # fmt: skip
    else:
        wider["num_hidden_layers"] = 8
    if arch == "lfm2":
        wider.update(block_dim=256, block_ff_dim=512)
    return build_hybrid_model(folder, arch, **wider)


def save(path: Path, budget: int, servers: dict[str, Server]) -> tuple[dict, dict]:
    summary = summarize(servers)
    mismatches = compare_outputs(servers) if "ours" in servers else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "budget_bytes": budget,
                "summary": summary,
                "mismatches_vs_ours": mismatches,
                "peak_rss": {k: s.peak_rss for k, s in servers.items()},
                "cache_bytes_peak": {k: s.cache_bytes_peak for k, s in servers.items()},
                "calls": {k: [asdict(c) for c in s.calls] for k, s in servers.items()},
            },
            indent=2,
        )
    )
    return summary, mismatches


def kv_bytes_per_token(model: Path) -> int:
    """KV cache bytes one token takes in a float32 model."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4


def chat_sizes(shape: ChatShape, max_tokens: int, tokenizer) -> tuple[int, int]:
    """(S, own): tokens of the shared system prompt, and of each conversation's own turns.

    With the prefix stored once the conversations need S + N * own tokens; stored
    whole, one copy of the system prompt each, N * (S + own).
    """
    system = [{"role": "system", "content": system_prompt(shape.words, shape.seed)}]
    shared = len(tokenizer.apply_chat_template(system))
    return shared, shape.turns * (max_tokens + 35)  # each turn: question, reply, markers


def overflow_budget_tokens(workloads: Workloads, tokenizer) -> int:
    """Workload 3 with its system prompt stored once: whole, only some conversations fit.

    That is the case where storing a shared prefix once has to pay off.
    """
    shape = workloads.chat_workloads()[2]
    shared, own = chat_sizes(shape, workloads.max_tokens, tokenizer)
    return shared + shape.convs * own


def report(path: Path) -> None:
    """The table and plots of a saved run, recomputed from its requests."""
    saved = json.loads(path.read_text())
    servers = {}
    for kind, calls in saved["calls"].items():
        peak = saved.get("cache_bytes_peak", {}).get(kind, 0)
        servers[kind] = Server(kind, 0, peak_rss=saved["peak_rss"][kind], cache_bytes_peak=peak)
        servers[kind].calls = [Call(**c) for c in calls]
    summary = summarize(servers)
    print_table(summary, servers, compare_outputs(servers), saved["budget_bytes"])
    if "peer" in servers and len(summary) == 5:
        for f in plot(summary, servers, path.parent):
            print(f"wrote {f}")


def print_table(summary: dict, servers: dict[str, Server], mismatches: dict, budget: int) -> None:
    print(f"\ncache budget for both: {budget / 2**20:.0f} MiB; medians in seconds")
    head = f"{'workload':<13} {'server':<13} {'TTFT':>7} {'p95':>7} {'warm':>7} {'cold':>7} "
    print(head + f"{'tok/s':>6} {'reuse':>6} {'ceil':>6} {'of ceil':>7} {'turn hits':>9}")
    for w, by_kind in summary.items():
        for kind, r in by_kind.items():
            cold = f"{r['cold_ttft_median']:7.2f}" if r["cold_ttft_median"] is not None else " " * 7
            print(
                f"{w:<13} {kind:<13} {r['ttft_median']:7.2f} {r['ttft_p95']:7.2f} "
                f"{r['warm_ttft_median']:7.2f} {cold} {r['completion_tokens_per_s']:6.1f} "
                f"{r['reuse']:6.2f} {r['ceiling']:6.2f} {r['reuse_of_ceiling']:7.2f} "
                + (f"{r['turn_hits']:9.2f}" if r["turn_hits"] is not None else "")
            )
        if "peer" in by_kind and "ours" in by_kind:
            o, p = by_kind["ours"], by_kind["peer"]
            ratio = o["warm_ttft_median"] / p["warm_ttft_median"]
            line = f"{'':<13} ours/peer     warm TTFT {ratio:.2f}x"
            if o["cold_ttft_median"] and p["cold_ttft_median"]:
                line += f", cold TTFT {o['cold_ttft_median'] / p['cold_ttft_median']:.2f}x"
            if p["reuse"]:
                line += f", reuse {o['reuse'] / p['reuse']:.2f}x"
            print(line)
    if "5-unique" in summary and "ours-nocache" in summary["5-unique"]:
        u = summary["5-unique"]
        cost = u["ours"]["ttft_median"] / u["ours-nocache"]["ttft_median"] - 1
        print(f"cost of the cache with no reuse (workload 5): {cost * 100:+.1f}% TTFT")
    print("peak RSS: " + ", ".join(f"{k} {s.peak_rss >> 20} MiB" for k, s in servers.items()))
    print(
        "most bytes held by the cache: "
        + ", ".join(f"{k} {s.cache_bytes_peak / 2**20:.0f} MiB" for k, s in servers.items())
    )
    print(f"greedy outputs differing from ours: {mismatches}")
    retries = {k: sum(c.retries for c in s.calls) for k, s in servers.items()}
    print(f"requests retried after a dropped connection: {retries}")


if __name__ == "__main__":
    main()
