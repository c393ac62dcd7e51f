"""Images: TTFT of each turn of a conversation that opens with a screenshot, against
mlx-vlm's own server on the same tiny vision model.

Each round sends a new 1280x800 picture with a question, two text follow-ups, then a
second conversation with the same picture and another question. Our server
(`mlx-cache-server serve`) and mlx-vlm's (`python -m mlx_vlm.server`, as it starts, and
with its prefix cache on: `APC_ENABLED=1`) run one at a time on the model
`tests/vision_models.py` builds at a screenshot model's scale (896x896 pixels in 14x14
patches, 256 positions per image). TTFT is taken through the `openai` SDK, streamed, with
the cached tokens each server reports. Medians over `--rounds`.

    python bench/vision.py [--rounds 3] [--servers ours,peer,peer-apc]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from multiturn import RESULTS, free_port, peer_env, wait_ready
from openai import OpenAI
from PIL import Image, ImageDraw

FOLLOW_UPS = ["What colours does it use?", "Say that again, shorter."]


def model_folder() -> Path:
    """The benchmark's model, built once."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.vision_models import build_gemma3_vision

    folder = Path(tempfile.gettempdir()) / "bench-vision-gemma3"
    if not (folder / "config.json").exists():
        build_gemma3_vision(folder, image_size=896, patch_size=14, positions=256,
                            hidden=256, layers=4)  # fmt: skip
    return folder


def screenshot(seed: int) -> str:
    """A 1280x800 PNG of made-up windows and text lines, as a data URL."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (1280, 800), tuple(int(x) for x in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = int(rng.integers(0, 1100)), int(rng.integers(0, 650))
        draw.rectangle(
            [x, y, x + 180, y + 140], fill=tuple(int(v) for v in rng.integers(0, 256, 3))
        )
        for line in range(6):
            draw.text((x + 8, y + 8 + 20 * line), "".join(rng.choice(list("abcdefgh "), 20)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def start(kind: str, model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "ours":
        cmd = [sys.executable, "-m", "mlx_cache_server", "serve", "--model", str(model),
               "--port", str(port), "--log-level", "warning"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", str(model),
               "--port", str(port), "--host", "127.0.0.1", "--log-level", "WARNING"]  # fmt: skip
    env = peer_env(kind)
    if kind == "peer-apc":
        env["APC_ENABLED"] = "1"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, [proc], kind)
    return proc, url


def turn(client: OpenAI, model: str, messages: list) -> dict:
    """One streamed turn: its TTFT, reply and the tokens the server reports."""
    sent = time.perf_counter()
    first, reply, usage = None, [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            reply.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft": (first or time.perf_counter()) - sent,
        "reply": "".join(reply),
        "prompt": usage.prompt_tokens if usage else None,
        "cached": getattr(details, "cached_tokens", None) if details else None,
    }


def round_of(client: OpenAI, model: str, seed: int) -> list[dict]:
    picture = screenshot(seed)
    content = [{"type": "image_url", "image_url": {"url": picture}},
               {"type": "text", "text": "What is on this screen?"}]  # fmt: skip
    messages, out = [{"role": "user", "content": content}], []
    for follow_up in [None, *FOLLOW_UPS]:
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        out.append(turn(client, model, messages))
        messages.append({"role": "assistant", "content": out[-1]["reply"] or "."})
    again = [{"role": "user", "content": [content[0], {"type": "text", "text": "Describe it."}]}]
    out.append(turn(client, model, again))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="ours,peer,peer-apc")
    args = ap.parse_args()
    model = model_folder()
    names = ["turn 1 (image)", "turn 2", "turn 3", "same image, new conversation"]
    summary: dict = {}
    for kind in args.servers.split(","):
        proc, url = start(kind, model)
        try:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
            served = client.models.list().data[0].id
            round_of(client, served, 999)  # warm-up: first calls compile and load
            rounds = [round_of(client, served, seed) for seed in range(args.rounds)]
        finally:
            proc.terminate()
            proc.wait(30)
        summary[kind] = {
            name: {
                "ttft_median_s": statistics.median(r[i]["ttft"] for r in rounds),
                "prompt_tokens": rounds[0][i]["prompt"],
                "cached_tokens": [r[i]["cached"] for r in rounds],
            }
            for i, name in enumerate(names)
        }
    ratios = {}
    for kind in [k for k in summary if k != "ours" and "ours" in summary]:
        ours, peer = summary["ours"], summary[kind]
        ratios[f"ours/{kind}"] = {
            n: ours[n]["ttft_median_s"] / peer[n]["ttft_median_s"] for n in names
        }
    summary.update(ratios)
    out = RESULTS / "vision.json"
    out.write_text(json.dumps({"rounds": args.rounds, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
