"""A step that decodes streams and prefills a chunk: two forward passes against one.

In-process, on the default model (float32, OpenBLAS preloaded as the CLI does): `--streams`
(4) sequences of 20-50 tokens decode one token each, and a prompt already `--depth` (300)
tokens deep takes a chunk of `--chunk` (128) tokens, either as mlx-lm's `BatchGenerator`
runs them (the streams' pass, then the chunk's) or in one pass (`forward_together`, as
the engine's `MixedGenerator` does). Each variant starts from copies of the same caches;
the variants alternate for `--rounds` rounds and the medians are reported, with the
streams' pass alone and the chunk's pass alone for reference.

    python bench/one_pass.py [--streams 4] [--depth 300] [--chunk 128] [--rounds 16]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--depth", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS / "one_pass.json")
    args = ap.parse_args()

    from app.runtime.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv)  # as the CLI does; returns when there is nothing to do

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache

    from app.models.default_model import default_model_dir
    from app.runtime import cpu_fast_path
    from app.runtime.forward_together import forward_together, logits

    model, _ = load(str(default_model_dir()))
    cpu_fast_path.install(model)  # as the server does
    vocab = model.args.vocab_size

    def filled(lengths: list[int], seed: int) -> list[BatchKVCache]:
        longest = max(lengths)
        cache = [BatchKVCache(left_padding=[longest - n for n in lengths]) for _ in model.layers]
        prompts = mx.random.randint(0, vocab, (len(lengths), longest), key=mx.random.key(seed))
        mx.eval(model(prompts, cache=cache), [c.state for c in cache])
        return cache

    lengths = [20 + (30 * i) // max(1, args.streams - 1) for i in range(args.streams)]
    streams, prompt = filled(lengths, 1), filled([args.depth], 2)
    step = mx.random.randint(0, vocab, (args.streams, 1), key=mx.random.key(3))
    chunk = mx.random.randint(0, vocab, (1, args.chunk), key=mx.random.key(4))

    def two_passes(s: list, p: list) -> None:
        mx.eval(model(step, cache=s))
        model(chunk, cache=p)
        mx.eval([c.state for c in p])

    def one_pass(s: list, p: list) -> None:
        hidden, _ = forward_together(model, [(step, s), (chunk, p)], wanted=[True, False])
        mx.eval(logits(model, hidden), [c.state for c in p])

    def streams_alone(s: list, p: list) -> None:
        mx.eval(model(step, cache=s))

    def chunk_alone(s: list, p: list) -> None:
        model(chunk, cache=p)
        mx.eval([c.state for c in p])

    variants = {"two_passes": two_passes, "one_pass": one_pass,
                "streams_pass": streams_alone, "chunk_pass": chunk_alone}  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants.items())
        for name, run in order if r % 2 == 0 else order[::-1]:
            s, p = copy.deepcopy(streams), copy.deepcopy(prompt)
            mx.eval([c.state for c in s + p])
            start = time.perf_counter()
            run(s, p)
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    result = {
        "median_seconds": medians,
        "one_pass_over_two": medians["one_pass"] / medians["two_passes"],
        "saved_of_streams_pass": (medians["two_passes"] - medians["one_pass"])
        / medians["streams_pass"],
        "seconds": seconds,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))


if __name__ == "__main__":
    main()
