"""Images: a conversation about a screenshot, turn after turn, and the same screenshot in a
second conversation, ours against mlx-vlm's server.

Each server runs alone in turn (harness.py: ours, and `vlm`, python -m mlx_vlm.server), on
the same vision model: a checkpoint given with --model, or by default each of --families'
tiny random models that tests/vision_models.py builds at a screenshot model's scale (Gemma
3: 896x896 pixels in 14x14 patches, 256 positions an image; Qwen3-VL: 16x16 patches, 2x2 a
position, so a 1280x800 screenshot takes 1,000), where TTFT is the servers' own work around
the model and the image's prefill, not a real model's. For each of --images 1280x800
screenshots (made-up windows and text lines), greedy and streamed through the openai SDK:
a first turn with the screenshot and a question (cold), --turns follow-ups in the same
conversation (warm: the image and the history before), then a second conversation that
opens on the same screenshot with another question (the image's positions reusable, the
text after them not). Reported per family and server: TTFT medians of each kind of turn,
reuse (cached / prompt tokens, where the server reports them), and ours over mlx-vlm's.

    python bench/vision.py [--families gemma3,qwen3_vl | --model PATH] [--images 4]
                           [--turns 3] [--quick]
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


def screenshot(seed: int) -> str:
    """A 1280x800 PNG of made-up windows and text lines, as a data URL."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (1280, 800), tuple(int(x) for x in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = int(rng.integers(0, 1100)), int(rng.integers(0, 650))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw.rectangle([x, y, x + 180, y + 140], fill=fill)
        for line in range(6):
            draw.text((x + 8, y + 8 + 20 * line), "".join(rng.choice(list("abcdefgh "), 20)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def opening(image: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                        {"type": "text", "text": text}]}  # fmt: skip


def tiny_model(family: str) -> Path:
    """A tiny random vision model of `family` at a screenshot model's scale, built once in
    the temp folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.vision_models import build_gemma3_vision, build_qwen_vl_vision

    folder = Path(tempfile.gettempdir()) / f"bench-vision-{family}"
    if (folder / "config.json").exists():
        return folder
    if family == "gemma3":
        return build_gemma3_vision(folder, image_size=896, patch_size=14, positions=256,
                                   hidden=256, layers=4)  # fmt: skip
    return build_qwen_vl_vision(folder, family, patch_size=16, hidden=256, max_pixels=1280 * 800)


async def conversations(server: Server, model: str, images: int, turns: int, tokens: int) -> None:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                         max_retries=0, timeout=3600)  # fmt: skip
    async with client:
        for i in range(images):
            image = screenshot(1000 + i)
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
    ap.add_argument("--model", default=None, help="a vision checkpoint (default: the tiny ones)")
    ap.add_argument("--families", default="gemma3,qwen3_vl",
                    help="the tiny models' families, without --model")  # fmt: skip
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3, help="follow-ups after the first turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--servers", default="ours,vlm", help="any of ours, vlm, ours@PATH")
    ap.add_argument("--quick", action="store_true", help="2 images, 1 follow-up")
    args = ap.parse_args()
    started = time.time()
    if args.quick:
        args.images, args.turns = 2, 1
    models = {"model": args.model} if args.model else {
        family: str(tiny_model(family)) for family in args.families.split(",")
    }  # fmt: skip
    summary: dict = {}
    raw: dict = {}
    for name, model in models.items():
        summary[name], raw[name] = compare(model, args)
    write_result("vision.json", args, started, summary, raw=raw, model_is_tiny=not args.model)


def compare(model: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """Each server's summary on `model`, and ours over mlx-vlm's; their raw calls."""
    summary: dict = {}
    raw: dict = {}
    for kind in args.servers.split(","):
        with running(kind, model, 64, BUDGET) as server:
            served = model if kind == "vlm" else "bench"
            asyncio.run(conversations(server, served, args.images, args.turns, args.max_tokens))
        summary[kind] = summarize(server.calls) | {"peak_rss": server.peak_rss}
        raw[kind] = [c.__dict__ | {"messages": None} for c in server.calls]
        print(Path(model).name, kind, summary[kind], flush=True)
    if "ours" in summary and "vlm" in summary:
        o, v = summary["ours"], summary["vlm"]
        summary["ours_over_vlm"] = {
            k: o[k] / v[k] for k in ("cold_ttft_median", "warm_ttft_median",
                                     "second_conversation_ttft_median") if o[k] and v[k]
        }  # fmt: skip
    return summary, raw


if __name__ == "__main__":
    main()
