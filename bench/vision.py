"""Images: a conversation about an image, turn after turn, and the same image in a second
conversation, ours against mlx-vlm's server.

Each server runs alone in turn (harness.py: ours, and `vlm`, python -m mlx_vlm.server), on
the same vision model: a Gemma 3 checkpoint given with --model, or by default the tests'
tiny random Gemma 3 (tests/vision_models.py), where TTFT is the servers' own overhead and
not a model's. For each of --images seeded random PNGs, greedy and streamed through the
openai SDK: a first turn with the image and a question (cold), --turns follow-ups in the
same conversation (warm: the image and the history before), then a second conversation
that opens on the same image with another question (the image's positions reusable, the
text after them not). Reported per server: TTFT medians of each kind of turn, reuse
(cached / prompt tokens, where the server reports them), and ours over mlx-vlm's.

    python bench/vision.py [--model PATH] [--images 4] [--turns 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

from envelope import write_result
from harness import Call, Server, running, send
from openai import AsyncOpenAI

BUDGET = 1 << 30


def png(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def opening(image: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                        {"type": "text", "text": text}]}  # fmt: skip


def tiny_model() -> Path:
    """The tests' tiny random Gemma 3 vision model, built once in the temp folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.vision_models import build_gemma3_vision

    folder = Path(tempfile.gettempdir()) / "bench-gemma3-vision"
    return folder if (folder / "config.json").exists() else build_gemma3_vision(folder)


async def conversations(server: Server, model: str, images: int, turns: int, tokens: int) -> None:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                         max_retries=0, timeout=3600)  # fmt: skip
    async with client:
        for i in range(images):
            image = png(1000 + i)
            messages = [opening(image, f"Image {i}: what do you see?")]
            for turn in range(1 + turns):
                call = Call("turns", i, turn, len(server.calls), list(messages))
                await send(client, model, call, tokens)
                server.calls.append(call)
                follow_up = {"role": "user", "content": f"Turn {turn + 1}: and then?"}
                messages += [{"role": "assistant", "content": call.reply}, follow_up]
            again = Call("again", i, 0, len(server.calls), [opening(image, "Describe it.")])
            await send(client, model, again, tokens)
            server.calls.append(again)


def summarize(calls: list[Call]) -> dict:
    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    prompt = sum(c.prompt_tokens for c in calls)
    return {
        "requests": len(calls),
        "cold_ttft_median": median([c.ttft for c in calls if c.workload == "turns" and not c.turn]),
        "warm_ttft_median": median([c.ttft for c in calls if c.workload == "turns" and c.turn]),
        "second_conversation_ttft_median": median(
            [c.ttft for c in calls if c.workload == "again"]
        ),  # fmt: skip
        "reuse": sum(c.cached_tokens for c in calls) / prompt if prompt else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a Gemma 3 vision checkpoint (default: tiny)")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3, help="follow-ups after the first turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--servers", default="ours,vlm", help="any of ours, vlm, ours@PATH")
    ap.add_argument("--quick", action="store_true", help="2 images, 1 follow-up")
    args = ap.parse_args()
    started = time.time()
    if args.quick:
        args.images, args.turns = 2, 1
    model = args.model or str(tiny_model())
    summary: dict = {}
    raw: dict = {}
    for kind in args.servers.split(","):
        with running(kind, model, 64, BUDGET) as server:
            served = model if kind == "vlm" else "bench"
            asyncio.run(conversations(server, served, args.images, args.turns, args.max_tokens))
        summary[kind] = summarize(server.calls) | {"peak_rss": server.peak_rss}
        raw[kind] = [c.__dict__ | {"messages": None} for c in server.calls]
        print(kind, summary[kind], flush=True)
    if "ours" in summary and "vlm" in summary:
        o, v = summary["ours"], summary["vlm"]
        summary["ours_over_vlm"] = {
            k: o[k] / v[k] for k in ("cold_ttft_median", "warm_ttft_median",
                                     "second_conversation_ttft_median") if o[k] and v[k]
        }  # fmt: skip
    write_result("vision.json", args, started, summary, raw=raw, model_is_tiny=not args.model)


if __name__ == "__main__":
    main()
