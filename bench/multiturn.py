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
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from envelope import RESULTS, quick, read_raw, write_result
from harness import (
    Call,
    Server,
    observe,
    percentile,
    question,
    running,
    send,
    system_prompt,
    turn_hits,
)
from openai import AsyncOpenAI
from plots import plot

from mlx_cache_server.models.default_model import default_model_dir
from mlx_cache_server.prompt_cache.radix import common_prefix_length


class ChatShape(NamedTuple):
    number: str
    name: str
    convs: int
    turns: int
    concurrent: bool
    words: int  # of the system prompt they share
    seed: int  # of the system prompt's words


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


def compare_outputs(servers: dict[str, Server]) -> dict[str, int]:
    ours = servers["ours"].calls
    out = {}
    for kind in servers:
        if kind != "ours":
            other = servers[kind].calls
            out[kind] = sum(a.reply != b.reply for a, b in zip(ours, other, strict=True))
    return out


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
    ap.add_argument("--report", default=None, metavar="NAME",
                    help="summarize and plot a saved run's raw records (say multiturn_full) "
                         "instead of running")  # fmt: skip
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
    started = time.time()
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
        summary, mismatches = save(f"multiturn_{tag}.json", args, started, budget, servers)
    print_table(summary, servers, mismatches, budget)
    llama = per_token * distinct  # every token once, every layer full attention
    print(
        "cache bytes at most, against a llama of the same attention width holding every "
        f"token of the run once ({llama / 2**20:.1f} MiB): "
        + ", ".join(f"{k} {s.cache_bytes_peak / llama:.2f}x" for k, s in servers.items())
    )
    # The plots compare all workloads with the peer; a quick run leaves the docs' plots be.
    if only is None and "peer" in servers and not (quick() or args.quick):
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


def save(
    name: str, args: argparse.Namespace, started: float, budget: int, servers: dict[str, Server]
) -> tuple[dict, dict]:
    """The result `name` (summary and envelope); each request's record goes to the raw file."""
    summary = summarize(servers)
    mismatches = compare_outputs(servers) if "ours" in servers else {}
    write_result(
        name, args, started, summary,
        raw={"budget_bytes": budget, "peak_rss": {k: s.peak_rss for k, s in servers.items()},
             "cache_bytes_peak": {k: s.cache_bytes_peak for k, s in servers.items()},
             "calls": {k: [asdict(c) for c in s.calls] for k, s in servers.items()}},
        budget_bytes=budget, mismatches_vs_ours=mismatches,
        peak_rss={k: s.peak_rss for k, s in servers.items()},
        cache_bytes_peak={k: s.cache_bytes_peak for k, s in servers.items()},
    )  # fmt: skip
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


def report(name: str) -> None:
    """The table and plots of a saved run, recomputed from its raw records."""
    saved = read_raw(name)
    servers = {}
    for kind, calls in saved["calls"].items():
        peak = saved.get("cache_bytes_peak", {}).get(kind, 0)
        servers[kind] = Server(kind, 0, peak_rss=saved["peak_rss"][kind], cache_bytes_peak=peak)
        servers[kind].calls = [Call(**c) for c in calls]
    summary = summarize(servers)
    print_table(summary, servers, compare_outputs(servers), saved["budget_bytes"])
    if "peer" in servers and len(summary) == 5:
        for f in plot(summary, servers, RESULTS):
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
