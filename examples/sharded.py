"""One model sharded over 2 processes under `mlx.launch` (ring backend, loopback) against 1.

This machine has 2 cores and no second host, so 2 ranks are slower than 1 here: the point
is that they answer the same, and what a step costs beyond one process's. mlx_lm.server,
sharded the same way, runs beside ours: its steps carry no cache decisions to share.

The model: the default model's shape (30 layers, 576 wide, its tokenizer) as a qwen2 with
8 attention and 2 KV heads and random weights, since mlx-lm splits neither the default
model's 9 and 3 heads over 2 processes nor a llama's layers; float32.

Setups (each rank's OpenBLAS gets 2 / ranks threads, so no setup has more than the cores):

  ours-1, peer-1     one process
  ours-2, peer-2     2 ranks on the ring backend, tensor parallel, each started as
                     `mlx.launch --backend ring -n 2 -- ...` starts it (MLX_RANK,
                     MLX_HOSTFILE) but without the launcher's process, which took most of
                     a core here forwarding output
  ours-2p, peer-2p   the same with `--pipeline` (15 layers each)

Workload, greedy, streamed through the openai SDK:
  sequential  --convs conversations of --turns turns sharing a system prompt, one request
              at a time: TTFT of first turns (the system prompt cached after the first
              conversation's) and of later ones (a reply and a question new), and decode
              tokens/s of each reply after its first token
  concurrent  --streams requests at once: their completion tokens/s together

    python examples/sharded.py [--setups ours-1,ours-2,ours-2p,peer-1,peer-2,peer-2p] [--convs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir

# The servers, clients and result envelope of the benchmark suite (bench/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
RESULTS = Path(__file__).resolve().parent / "results"

from envelope import write_result  # noqa: E402
from harness import (  # noqa: E402
    Call,
    free_port,
    peer_env,
    question,
    send,
    system_prompt,
    wait_ready,
)


@contextmanager
def started(setup: str, model: str):
    """The setup's URL once it answers; everything it started is stopped after."""
    kind, ranks = setup.split("-")
    pipeline = ["--pipeline"] if ranks.endswith("p") else []
    ranks = ranks.removesuffix("p")
    port = free_port()
    if kind == "ours":
        serve = ["-m", "mlx_cache_server", "serve", "--model", model,
                 "--served-model-name", "bench",
                 "--log-level", "warning", "--port", str(port), *pipeline]  # fmt: skip
    else:
        serve = ["-m", "mlx_lm.server", "--model", model, "--port", str(port), *pipeline]
    env = peer_env(kind)  # the same BLAS for both
    env["OPENBLAS_NUM_THREADS"] = str(max(1, 2 // int(ranks)))
    hosts = Path(tempfile.mkstemp(prefix="bench-hosts-", suffix=".json")[1])
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(int(ranks))]))
    log = Path(tempfile.mkstemp(prefix=f"bench-{setup}-", suffix=".log")[1])
    procs = []
    with log.open("wb") as out:
        for rank in range(int(ranks)):
            # As `mlx.launch --backend ring` starts each rank, without the launcher's own
            # process, whose forwarding of output took most of a core here.
            if int(ranks) > 1:
                env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts))
            procs.append(subprocess.Popen([sys.executable, *serve], env=dict(env), stdout=out,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs, setup, log=log)
        yield url
    finally:
        for proc in procs:  # rank 0 first: it tells the others to stop
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.unlink(missing_ok=True)
        hosts.unlink(missing_ok=True)


def client_of(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)


async def sequential(url: str, model: str, args: argparse.Namespace) -> list[Call]:
    system = system_prompt(args.words, seed=1)
    calls = []
    async with client_of(url) as client:
        for conv in range(args.convs):
            messages = [{"role": "system", "content": system}]
            for turn in range(args.turns):
                messages.append({"role": "user", "content": question(conv, turn)})
                call = Call("sequential", conv, turn, 0, list(messages))
                await send(client, model, call, args.max_tokens)
                messages.append({"role": "assistant", "content": call.reply})
                calls.append(call)
    return calls


async def concurrent(url: str, model: str, args: argparse.Namespace) -> tuple[float, list[Call]]:
    calls = [
        Call("concurrent", i, 0, 0, [{"role": "user", "content": question(100 + i, 0)}])
        for i in range(args.streams)
    ]
    async with client_of(url) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(send(client, model, c, args.max_tokens) for c in calls))
        wall = time.perf_counter() - t0
    return sum(c.completion_tokens for c in calls) / wall, calls


def decode_rate(c: Call) -> float:
    return (c.completion_tokens - 1) / (c.total - c.ttft) if c.total > c.ttft else 0.0


def bench_model(folder: Path) -> Path:
    """The default model's shape and tokenizer as a qwen2 both servers can split either way."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    default = default_model_dir()
    config = json.loads((default / "config.json").read_text())
    config.update(model_type="qwen2", num_attention_heads=8, num_key_value_heads=2,
                  tie_word_embeddings=True)  # fmt: skip
    config.pop("head_dim", None)
    mx.random.seed(0)
    weights = dict(tree_flatten(qwen2.Model(qwen2.ModelArgs.from_dict(config)).parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))  # mlx-lm's pipeline
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default / name, folder / name)
    return folder


def run(setup: str, model: str, args: argparse.Namespace) -> dict:
    name = "bench" if setup.startswith("ours") else model
    with started(setup, model) as url:
        asyncio.run(concurrent(url, name, argparse.Namespace(**{**vars(args), "streams": 1})))
        calls = asyncio.run(sequential(url, name, args))
        throughput, together = asyncio.run(concurrent(url, name, args))
    first = [c.ttft for c in calls if c.turn == 0]  # the system prompt cached after the first
    later = [c.ttft for c in calls if c.turn > 0]
    return {
        "first_turn_ttft_median_s": statistics.median(first),
        "later_turn_ttft_median_s": statistics.median(later),
        "decode_tokens_per_s_median": statistics.median(map(decode_rate, calls)),
        "step_ms_median": 1000 / statistics.median(map(decode_rate, calls)),
        "concurrent_tokens_per_s": throughput,
        "cached_tokens": sum(c.cached_tokens for c in calls),
        "prompt_tokens": sum(c.prompt_tokens for c in calls),
        "replies": [c.reply for c in calls] + [c.reply for c in together],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default="ours-1,ours-2,ours-2p,peer-1,peer-2,peer-2p")
    p.add_argument("--convs", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=300, help="of the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=4)
    args = p.parse_args()
    began = time.time()
    model = str(bench_model(Path(tempfile.gettempdir()) / "mlx-cache-server-bench-qwen2"))
    results = {}
    for setup in args.setups.split(","):
        print(f"{setup} ...", file=sys.stderr, flush=True)
        results[setup] = run(setup, model, args)
    base = results.get("ours-1")
    for r in results.values():
        r["replies_equal_ours_1"] = base is not None and r["replies"] == base["replies"]
    summary = {s: {k: v for k, v in r.items() if k != "replies"} for s, r in results.items()}
    write_result("sharded.json", args, began, summary, folder=RESULTS,
                 raw={s: r["replies"] for s, r in results.items()})  # fmt: skip
    keys = ["first_turn_ttft_median_s", "later_turn_ttft_median_s", "decode_tokens_per_s_median",
            "step_ms_median", "concurrent_tokens_per_s", "replies_equal_ours_1"]  # fmt: skip
    print(f"{'setup':8}" + "".join(f"{k[:24]:>26}" for k in keys))
    for setup, r in results.items():
        row = "".join(
            f"{r[k]:>26.3f}" if isinstance(r[k], float) else f"{r[k]!s:>26}" for k in keys
        )
        print(f"{setup:8}{row}")


if __name__ == "__main__":
    main()
