"""Prefill tokens/s of the default model with and without OpenBLAS preloaded (Linux CPU).

Each variant runs in its own process (a BLAS can only be chosen at load time):
median of 3 timed prefills of a 512-token prompt after a warm-up.

    python bench/prefill_blas.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import statistics, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
model, tok = load(sys.argv[1])
ids = mx.array([(tok.encode("The quick brown fox jumps over the lazy dog. " * 80))[:512]])
mx.eval(model(ids[:, :32], cache=make_prompt_cache(model)))
times = []
for _ in range(3):
    cache = make_prompt_cache(model)
    t = time.perf_counter()
    mx.eval(model(ids, cache=cache))
    times.append(time.perf_counter() - t)
print(ids.shape[1] / statistics.median(times))
"""


def run(model: str, preload: str | None) -> float:
    env = dict(os.environ, MLX_CACHE_SERVER_BLAS_CHECKED="1")
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from app.models.default_model import default_model_dir
    from app.runtime.blas import find_openblas

    model = str(default_model_dir())
    lib = find_openblas()
    if lib is None:
        sys.exit("OpenBLAS is not installed: apt-get install libopenblas0-pthread")
    bundled = run(model, None)
    openblas = run(model, lib)
    print(f"prefill, 512 tokens, {Path(model).name}:")
    print(f"  bundled reference BLAS: {bundled:8.1f} tokens/s")
    print(f"  OpenBLAS preloaded:     {openblas:8.1f} tokens/s  ({openblas / bundled:.1f}x)")
    out = Path(__file__).parent / "results" / "prefill_blas.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bundled": bundled, "openblas": openblas}, indent=2))


if __name__ == "__main__":
    main()
