"""What differs between vision model families: how an image is prepared, written in the
prompt, encoded and placed.

Each family is a small class answering the same few questions (`vision_load.Vision`
asks them, and never the family's name):

- `prepare(images)`: the processor's pixels of each image, its digest, its positions'
  count and grid, and the text that stands for it in the prompt (`Prepared`);
- `encode(image)`: the image's features, one row a position, by mlx-vlm's encoder;
- `marker` and `frame`: what the chat template writes for an image, and the tokens just
  before and after an image's run in the prompt;
- `positions`: where the pass's tokens stand (`engine.positions`): plain for Gemma 3,
  M-RoPE for the Qwen-VL models (`vision_positions`), installed by `open`, which also
  makes the first layers of a Qwen3-VL model add its deepstack (`vision.Deepstack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.positions import PLAIN, Positions
from .vision import Deepstack, DeepstackLayer, Image, ImageIds, Passes, pixel_digest
from .vision_positions import ImagePositions, PromptPositions, install_mrope


@dataclass(frozen=True)
class Prepared:
    """An image of a request as the processor prepared it: its pixels and their digest,
    its positions (in `grid`, where they form one) and the text standing for it."""

    pixels: np.ndarray
    digest: bytes
    count: int
    expansion: str
    grid: tuple[int, int, int] | None = None


class Gemma3Images:
    """Gemma 3: a fixed run of positions an image, framed by its start and end markers,
    at plain positions."""

    def __init__(self, vlm: Any, processor: Any) -> None:
        self._vlm, self._processor = vlm, processor
        self.image_token = int(vlm.config.image_token_index)
        self.marker = processor.boi_token
        self._expansion = processor.full_image_sequence
        framed = processor.tokenizer.encode(self._expansion, add_special_tokens=False)
        (start, end), *_ = token_runs(framed, self.image_token)
        self.frame = (
            framed[start - 1] if start else None,
            framed[end] if end < len(framed) else None,
        )
        self._count = end - start
        self.positions: Positions = PLAIN

    def open(self, model: nn.Module, ids: ImageIds, deepstack: Deepstack, passes: Passes) -> None:
        """Nothing to change in the language model: its prompt passes are marked as such."""
        self.positions = PromptPositions(passes)

    def prepare(self, images: list[Any]) -> list[Prepared]:
        out = self._processor.image_processor(images, return_tensors="np")["pixel_values"]
        return [
            Prepared(p[None], pixel_digest(p[None]), self._count, self._expansion)
            for p in np.asarray(out)
        ]

    def encode(self, image: Image) -> mx.array:
        ids = mx.array([[self.image_token] * image.count])
        embedded = self._vlm.get_input_embeddings(
            ids, mx.array(image.pixels), mask=mx.ones(ids.shape)
        )
        return embedded.inputs_embeds[0]


VISION_END = "<|vision_end|>"


class QwenImages:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: an image of any size cut in patches, each square
    of `merge` x `merge` patches one position, `<|image_pad|>` repeated once a position
    between `<|vision_start|>` and `<|vision_end|>`, at positions of a grid (M-RoPE, its
    frequencies interleaved in Qwen3-VL); Qwen3-VL's encoder also gives levels its first
    layers add (deepstack)."""

    def __init__(self, vlm: Any, processor: Any) -> None:
        self._vlm, self._processor = vlm, processor
        config = vlm.config
        self.image_token = int(config.image_token_id)
        self.marker = processor.image_token
        # mlx-vlm's Qwen2-VL config names no end token: the tokenizer has it.
        end = getattr(config, "vision_end_token_id", None)
        end = end if end is not None else processor.tokenizer.convert_tokens_to_ids(VISION_END)
        self.frame = (int(config.vision_start_token_id), int(end))
        self._merge = int(config.vision_config.spatial_merge_size)
        text = config.text_config  # Qwen3.5's names its rope settings rope_parameters
        scaling = (
            getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
        )
        self._sections = scaling.get("mrope_section")
        qwen3 = config.model_type.startswith(("qwen3_vl", "qwen3_5"))
        self._interleaved = bool(scaling.get("mrope_interleaved", qwen3))
        levels = getattr(config.vision_config, "deepstack_visual_indexes", None) or []
        self._levels = len(levels)
        self.positions: Positions = PLAIN

    def open(self, model: nn.Module, ids: ImageIds, deepstack: Deepstack, passes: Passes) -> None:
        """The language model's RoPE made M-RoPE (`vision_positions`), and its first
        layers given the deepstack's levels to add."""
        if self._sections is None:
            raise ValueError("the model's rope_scaling gives no mrope_section")
        positions = ImagePositions(ids, passes)
        layers = model.layers  # the language model's own list: changed in place
        install_mrope(layers, positions, self._sections, self._interleaved)
        for level in range(self._levels):
            layers[level] = DeepstackLayer(layers[level], level, deepstack)
            if model.layers[level] is not layers[level]:  # a copy: the model runs its own
                raise ValueError("this model's layers cannot take the deepstack")
        self.positions = positions

    def prepare(self, images: list[Any]) -> list[Prepared]:
        out = self._processor.image_processor(images, return_tensors="np")
        pixels, grids = np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])
        prepared, at = [], 0
        for t, h, w in grids.tolist():
            patches = pixels[at : at + t * h * w]
            at += t * h * w
            grid = (t, h // self._merge, w // self._merge)
            count = grid[0] * grid[1] * grid[2]
            # The digest is of the patches laid out in their grid: the same patches in
            # another grid are another image.
            digest = pixel_digest(patches.reshape(t, h, w, -1))
            prepared.append(Prepared(patches, digest, count, self.marker * count, grid))
        return prepared

    def encode(self, image: Image) -> mx.array:
        if image.grid is None:  # registered by a request, which gives its grid: a bug if not
            raise ValueError("an image of this prompt has no grid")
        t, h, w = image.grid
        grid = mx.array([[t, h * self._merge, w * self._merge]])
        tower = self._vlm.vision_tower
        pixels = mx.array(image.pixels).astype(tower.patch_embed.proj.weight.dtype)
        out = tower(pixels, grid)
        if not isinstance(out, tuple):
            return out
        features, levels = out  # Qwen3-VL: the deepstack's levels beside the features
        return mx.stack([features, *levels]) if levels else features


FAMILIES: dict[str, type] = {
    "gemma3": Gemma3Images,
    "qwen2_vl": QwenImages,
    "qwen2_5_vl": QwenImages,
    "qwen3_vl": QwenImages,
    "qwen3_vl_moe": QwenImages,
    "qwen3_5": QwenImages,
    "qwen3_5_moe": QwenImages,
}


def token_runs(tokens: list[int], token: int) -> list[tuple[int, int]]:
    """The [start, end) of each run of `token` in `tokens`."""
    runs, start = [], None
    for i, t in enumerate([*tokens, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs
