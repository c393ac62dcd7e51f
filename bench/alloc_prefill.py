"""A warm prompt's prefill under each allocator setting the server has used (Linux, glibc).

Each setting runs in a fresh process (glibc's and MLX's allocation settings are
process-wide), on the default model with the server's CPU fast path, OpenBLAS
preloaded as the server has it, on a thread of its own as the server's engine: a
cache of C tokens, then N new tokens prefilled in
the server's 512-token chunks and the first token from the last position's logits
(`prefill_alone`'s work). Settings:

  default    MLX's buffer pool and glibc's adaptive mmap threshold
  server     MLX's pool limited to 4 MiB (what the server sets on the CPU)
  pinned     that, and glibc's mmap threshold pinned at 1 MiB (the server before)

Rounds alternate the settings' order; reported: per setting and size, the median
over rounds of each round's median of 3.

    python bench/alloc_prefill.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from app.runtime.blas import find_openblas

SIZES = ((600, 20), (174, 200), (170, 1550))  # (cached, new)
CHILD = r"""
import ctypes, json, os, statistics, sys, threading, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generation_stream
from app.engine.last_logits import last_logits
from app.models.default_model import default_model_dir
from app.runtime import cpu_activations, cpu_attention
from app.runtime.memory import limit_buffer_pool
from ttft_floor import CHUNK, cache_holding, new_tokens, prefill_chunks

setting, sizes = sys.argv[1], json.loads(sys.argv[2])
if setting == "pinned":  # what app.runtime.memory.unmap_large_blocks did, before the load
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 1 << 20) and libc.mallopt(-4, 32768)
if setting != "default":  # as the server: before the model's buffers are allocated
    assert limit_buffer_pool(4 << 20)
model, _ = load(str(default_model_dir()))
cpu_attention.install(model)
cpu_activations.install(model)

def once(cached, new):  # prefill_alone's work: the last chunk's last position's logits
    cache, tokens = cache_holding(model, cached), new_tokens(new)
    t = time.perf_counter()
    last = (new - 1) // CHUNK * CHUNK
    prefill_chunks(model, cache, tokens[:last])
    mx.eval(mx.argmax(last_logits(model, mx.array([tokens[last:]]), cache), axis=-1))
    return time.perf_counter() - t

out = {}
def measure():  # on a thread of its own, as the server's engine (its own glibc arena)
    with mx.stream(generation_stream):
        out.update({str(n): statistics.median(once(c, n) for _ in range(3)) for c, n in sizes})
worker = threading.Thread(target=measure)
worker.start()
worker.join()
print(json.dumps(out), flush=True)
os._exit(0 if out else 1)  # MLX's stream threads can abort the interpreter's teardown
"""
SETTINGS = ("default", "server", "pinned")


def run(setting: str) -> dict[str, float]:
    env = dict(os.environ, MLX_CACHE_SERVER_BLAS_CHECKED="1")
    bench = str(Path(__file__).parent)  # the child imports ttft_floor's prefill helpers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bench, env.get("PYTHONPATH")) if p)
    if lib := find_openblas():
        env["LD_PRELOAD"] = lib
    out = subprocess.run(
        [sys.executable, "-c", CHILD, setting, json.dumps(SIZES)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the {setting} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            rounds[setting].append(run(setting))
            print(r, setting, rounds[setting][-1], flush=True)
    summary = {
        s: {n: statistics.median(x[n] for x in runs) for n in runs[0]} for s, runs in rounds.items()
    }
    results = Path(__file__).parent / "results" / "alloc_prefill.json"
    results.write_text(json.dumps({"sizes": SIZES, "summary": summary, "rounds": rounds}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
