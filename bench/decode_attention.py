"""A decode step's attention through numpy (`decode_attention`) against MLX's kernel.

In-process, on the default model (float32, OpenBLAS preloaded as the CLI does, the
server's CPU fast path installed): `--streams` sequences `--depth` tokens deep (left-padded
to the longest, as mlx-lm's batch holds them) decode `--steps` greedy tokens, the decode
steps' attention either through `cpu_attention.decode_attention` or through mlx-lm's own
kernel; the two alternate for `--rounds` rounds from the same prompts. Reported: median
milliseconds per step of each, their ratio (the medians of rounds), and whether the
greedy tokens were the same.

    python bench/decode_attention.py [--streams 1,8,16] [--depth 160] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", default="1,8,16")
    ap.add_argument("--depth", type=int, default=160)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_attention.json")
    args = ap.parse_args()

    from app.runtime.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv)  # as the CLI does; returns when there is nothing to do

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models import base
    from mlx_lm.models.cache import BatchKVCache

    from app.models.default_model import default_model_dir
    from app.runtime import cpu_attention, cpu_fast_path, cpu_logprobs

    model, _ = load(str(default_model_dir()))
    cpu_fast_path.install(model)  # as the server does
    numpy_path = cpu_attention.decode_attention

    def mlx_path(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: object) -> mx.array:
        return base.scaled_dot_product_attention(q, k, v, cache=None, scale=scale, mask=mask)

    def run(n: int, numpy: bool) -> tuple[float, list]:
        cpu_attention.decode_attention = numpy_path if numpy else mlx_path
        lengths = [args.depth + 7 * i for i in range(n)]
        longest = max(lengths)
        cache = [BatchKVCache(left_padding=[longest - k for k in lengths]) for _ in model.layers]
        vocab = model.args.vocab_size
        prompts = mx.random.randint(0, vocab, (n, longest), key=mx.random.key(1))
        for at in range(0, longest, 512):  # in chunks, as the server prefills
            model(prompts[:, at : at + 512], cache=cache)
            mx.eval([c.state for c in cache])
        y = prompts[:, -1:]
        seconds, tokens = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            logits = model(y, cache=cache)[:, -1, :]
            logprobs = logits - cpu_logprobs.logsumexp(logits, axis=-1, keepdims=True)
            y = mx.argmax(logprobs, axis=-1)[:, None]
            mx.eval(y, logprobs)
            seconds.append(time.perf_counter() - t)
            tokens.append(y[:, 0].tolist())
        return statistics.median(seconds[3:]) * 1000, tokens

    results = {}
    for n in (int(x) for x in args.streams.split(",")):
        ms: dict[str, list[float]] = {"mlx": [], "numpy": []}
        same = True
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            tokens = {}
            for numpy in order:
                step_ms, tokens[numpy] = run(n, numpy)
                ms["numpy" if numpy else "mlx"].append(step_ms)
            same = same and tokens[True] == tokens[False]
        ratios = [a / b for a, b in zip(ms["numpy"], ms["mlx"], strict=True)]
        results[n] = {
            "ms_per_step": {k: statistics.median(v) for k, v in ms.items()},
            "rounds": ms,
            "numpy_over_mlx": statistics.median(ratios),
            "same_tokens": same,
        }
        print(n, json.dumps(results[n]), flush=True)
    args.out.write_text(
        json.dumps({"args": {**vars(args), "out": str(args.out)}, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
