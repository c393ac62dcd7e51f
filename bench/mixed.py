"""Running streams while a long prompt prefills: ours against mlx_lm.server.

Each server runs alone in turn (same model, OpenBLAS, same cache limits), for `--rounds`
rounds. Each round, a long unique prompt (`--words`, 2000) is sent to the idle server.
Then `--streams` (4) streams start decoding (greedy, up to 400 tokens), and once each
has sent a few tokens, another long unique prompt of the same length arrives; once the
streams are done, a third goes to the idle server again. The reference, a long prompt's
TTFT alone, is the mean of the first and the third: this host's speed drifts over
minutes, and the two bracket the prompt measured beside the streams. Reported per round:
the longest gap between two tokens of any running stream while the long prompt
prefills and joins them (from its arrival to its fourth and last token), the streams'
inter-token latency p50/p99 over that window, and the long prompt's TTFT beside the
streams against the round's TTFT alone; overall, the median of the rounds' figures and
the longest gap of any round.

    python bench/mixed.py [--words 2000] [--streams 4] [--rounds 1] [--servers ours,peer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from envelope import write_result
from harness import WORDS, running
from openai import OpenAI

from mlx_cache_server.models.default_model import default_model_dir

BUDGET = 2 * 1024**3


def long_prompt(words: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "user", "content": f"{text}\n\nSummarize the text above in one line."}]


def first_token(client: OpenAI, model: str, messages: list[dict], ban: dict) -> tuple[float, float]:
    """The reply's TTFT, and when its last token came: the end of the reply is banned
    (`ban`, this model often answers these prompts with it at once), so the reply runs to
    its fourth token and joins the running streams' batch first."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"logit_bias": ban},
    )
    ttft = None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
    return ttft or time.perf_counter() - t0, time.perf_counter()


# A stream's story is new to the server every round (for up to 16 streams in all): a prompt
# asked again would be drafted from its earlier reply (`engine/drafting.py`), decoding
# faster than a new one.
SUBJECTS = ["the sea", "a lighthouse", "a mountain village", "a desert caravan", "a clockmaker",
            "a lost dog", "a winter forest", "a space station", "a river barge", "an old library",
            "a night train", "a beekeeper", "a volcano island", "a chess tournament",
            "a city garden", "a storm at sea"]  # fmt: skip


def stories(r: int, streams: int) -> list[str]:
    """Round `r`'s streams' prompts."""
    ids = range(r * streams, (r + 1) * streams)
    return [f"Stream {i}: write a long story about {SUBJECTS[i % len(SUBJECTS)]}." for i in ids]


def stream_times(client: OpenAI, model: str, text: str, out: list[float], ready: threading.Event):
    messages = [{"role": "user", "content": text}]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=400, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(time.perf_counter())
            if len(out) == 5:
                ready.set()
    ready.set()


def measure(kind: str, model: str, args) -> dict:
    """`--rounds` rounds on one server: each a fresh long prompt alone, then another beside
    the streams; the figures of each round, and the median of the rounds'."""
    name = "bench" if kind != "peer" else model
    rounds = []
    with running(kind, model, 64, BUDGET) as server:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=3600)
        first_token(client, name, [{"role": "user", "content": "Hi."}], args.ban)  # warm up
        for r in range(args.rounds):
            rounds.append(one_round(client, name, args, r))
            print(kind, r, {k: round(v, 3) for k, v in rounds[-1].items() if v is not None})
    # A round in which no stream sent a token has no gaps (None): left out, not a crash.
    out = {key: _median([x[key] for x in rounds]) for key in rounds[0]}
    gaps = [x["longest_gap"] for x in rounds if x["longest_gap"] is not None]
    out["longest_gap"] = max(gaps) if gaps else None
    return out | {"rounds": rounds}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def one_round(client: OpenAI, name: str, args, r: int) -> dict:
    """Round `r`: a long prompt's TTFT alone, another's beside the streams (and their gaps),
    and a third's alone again."""
    seeds = (10 * r + 1, 10 * r + 2, 10 * r + 3)
    first, _ = first_token(client, name, long_prompt(args.words, seeds[0]), args.ban)
    times: list[list[float]] = [[] for _ in range(args.streams)]
    readies = [threading.Event() for _ in range(args.streams)]
    threads = [
        threading.Thread(target=stream_times, args=(client, name, text, times[i], readies[i]))
        for i, text in enumerate(stories(r, args.streams))
    ]
    for t in threads:
        t.start()
    for r in readies:
        r.wait()
    arrival = time.perf_counter()
    beside, end = first_token(client, name, long_prompt(args.words, seeds[1]), args.ban)
    for t in threads:
        t.join()
    last, _ = first_token(client, name, long_prompt(args.words, seeds[2]), args.ban)
    alone = (first + last) / 2
    gaps = []
    for ts in times:
        window = [t for t in ts if arrival <= t <= end]
        before = [t for t in ts if t < arrival][-1:]
        after = [t for t in ts if t > end][:1]
        marks = before + window + after
        gaps += [b - a for a, b in zip(marks, marks[1:], strict=False)]
    gaps.sort()
    return {
        "ttft_alone": alone,
        "ttft_alone_before": first,
        "ttft_alone_after": last,
        "ttft_beside_streams": beside,
        "ttft_ratio": beside / alone,
        "longest_gap": max(gaps) if gaps else None,
        "itl_p50": statistics.median(gaps) if gaps else None,
        "itl_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--words", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--servers", default="ours,peer", help="ours, peer, ours@PATH (a checkout)")
    ap.add_argument("--out", type=Path, default=Path("mixed.json"), help="in bench/results/")
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    args.ban = {} if eos is None else {str(eos): -100}
    result = {kind: measure(kind, model, args) for kind in args.servers.split(",")}
    write_result(args.out.name, args, started, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
