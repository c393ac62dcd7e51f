"""The benchmark suite: each workload behind a figure in README.md or docs/performance.md.

    python -m bench                 # list the workloads
    python -m bench NAME [ARGS...]  # run one; ARGS go to its script (see `--help`)
    python -m bench all             # run every workload one after the other (hours)

Each workload is a script in this folder that starts what it compares (our server,
mlx_lm.server, our server from another checkout with `ours@PATH` where a script takes
it) and writes one result file to bench/results/; `python -m bench NAME` runs it with
the arguments that produced the figures. Install the extras first:
`pip install -c requirements.lock -e ".[bench]"`.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Workload:
    script: str
    args: tuple[str, ...]
    result: str  # in bench/results/
    what: str


HYBRID = ("--workloads", "1,2,4", "--servers", "ours,peer", "--cache-max-bytes", "268435456")

WORKLOADS = {
    "multiturn": Workload("multiturn.py", (), "multiturn_full.json",
                          "five chat workloads against mlx_lm.server (sequential, 16 chats "
                          "sharing a system prompt, overflow, branching, unique); the plots"),
    "sharegpt": Workload("sharegpt.py", ("--rounds", "3"), "sharegpt.json",
                         "real conversations (ShareGPT users' messages), 4 chats at a time"),
    "agent": Workload("agent.py", (), "agent.json",
                      "Claude Code and Codex sessions through /v1/messages and /v1/responses"),
    "decode": Workload("decode.py", ("--rounds", "3"), "decode.json",
                       "decode throughput with 8 and 16 streams"),
    "vision": Workload("vision.py", (), "vision.json",
                       "a screenshot's conversation against mlx-vlm's server: TTFT per turn"),
    "speculation": Workload("speculation.py", (), "speculation.json",
                            "prompt-lookup drafts: edit-style turns and chat, on and off"),
    "speculation-batches": Workload("speculation.py", (
        "--rounds", "1", "--sharegpt", "8", "--servers", "ours,ours-plain",
        "--out", "bench/results/speculation_ours.json"), "speculation_ours.json",
        "prompt-lookup drafts in batches: a mixed batch, ShareGPT questions, on and off"),
    "mixed": Workload("mixed.py", ("--rounds", "3"), "mixed.json",
                      "running streams beside a long prompt's prefill"),
    "cache-ops": Workload("cache_ops.py", (), "cache_ops.json",
                          "the cache library against mlx-lm's LRUPromptCache, in-process"),
    "cache-cost": Workload("cache_cost.py", (), "cache_cost.json",
                           "the cache's own cost: ours against ours with --no-cache"),
    "warm-paired": Workload("warm_paired.py", (), "warm_paired.json",
                            "warm turns sent to both servers, both up"),
    "restart": Workload("restart.py", (), "restart.json",
                        "continuing a long conversation after a restart (the disk tier)"),
    "overflow-disk": Workload("overflow_disk.py", (), "overflow_disk.json",
                              "round-robin conversations with RAM at a quarter of their need"),
    "structured": Workload("structured.py", (), "structured.json",
                           "constrained decoding's cost, a tool conversation, apply_patch calls"),
    "schema-bounds": Workload("schema_bounds.py", (), "schema_bounds.json",
                              "how deep each schema construct goes before a stack overflows"),
    "kv-bits": Workload("kv_bits.py", (), "kv_bits.json", "quantized KV: bytes, replies, TTFT"),
    "arrivals": Workload("arrivals.py", (), "arrivals.json",
                         "eight cold prompts arriving together"),
    "ttft-floor": Workload("ttft_floor.py", (), "ttft_floor.json",
                           "a warm turn's TTFT against prefilling its new tokens in-process"),
    "cpu-attention": Workload("cpu_attention.py", (), "cpu_attention.json",
                              "attention on the Linux CPU: the fast path against MLX's kernel"),
    "models": Workload("models.py", (), "models.json",
                       "several models: a cold load, and what an unload gives back"),
    "sharded": Workload("sharded.py", (), "sharded.json", "one model sharded over 2 processes"),
    "replicas": Workload("replicas.py", (), "replicas.json",
                         "2 replicas behind sglang-router or HAProxy, against one server"),
    "load": Workload("load.py", (), "load.json",
                     "32 clients for 180 s: drops, bad requests, flushes; errors by class"),
    **{f"hybrid-{arch}": Workload("multiturn.py", ("--hybrid", arch, *HYBRID),
                                  f"multiturn_full_w124_{arch}.json",
                                  f"workloads 1, 2 and 4 on a tiny random {arch}")
       for arch in ("gemma3_text", "gpt_oss", "qwen3_5", "nemotron_h")},
}  # fmt: skip


def listing() -> str:
    width = max(map(len, WORKLOADS))
    rows = [f"  {name:<{width}}  {w.what}  -> results/{w.result}" for name, w in WORKLOADS.items()]
    return "workloads (python -m bench NAME [ARGS...]):\n" + "\n".join(rows)


def run(name: str, extra: list[str]) -> int:
    w = WORKLOADS[name]
    cmd = [sys.executable, str(HERE / w.script), *w.args, *extra]
    print("+ " + " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, cwd=HERE.parent)


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
