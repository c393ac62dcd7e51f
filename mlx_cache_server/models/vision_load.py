"""A vision checkpoint opened for images: mlx-vlm's processor and vision encoder beside the
language model mlx-lm loaded, its token embedding replaced by `vision.ImageEmbedding`.

mlx-vlm is an optional extra (`pip install "mlx-cache-server[vision]"`); without it, or for
a model family not in `FAMILIES`, a vision checkpoint is served for text as before and a
request with an image gets a 400 saying why.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..engine.positions import Positions
from .vision import Deepstack, Features, Holds, ImageEmbedding, ImageIds, Passes
from .vision_families import FAMILIES, Prepared, token_runs

log = logging.getLogger("mlx_cache_server")

FEATURE_BYTES = 256 * 1024**2  # recent images' features kept, at most (out of the cache's budget)
# Written before each image's part in the messages rendered (`serving.template`), so that
# the image's own marker is told from the same text elsewhere: a private-use character.
IMAGE = "\U000f0000"


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be: the operator's settings (`max_image_pixels`,
    `max_images`, `fetch_image_urls`)."""

    max_pixels: int = 4096 * 4096  # width x height, read from the header before decoding
    max_images: int = 16
    fetch_urls: bool = False  # http(s) image URLs fetched by the server


@dataclass
class Vision:
    """What a served vision model needs to take images: its processor, its placeholder
    token and the tokens framing a run of it, the ids handed to images and their
    features, and the operator's limits."""

    processor: Any
    family: Any  # `vision_families`: how its images are prepared, written and encoded
    ids: ImageIds
    features: Features
    limits: ImageLimits
    encoder: str  # the library that encodes its images, and its release

    @property
    def positions(self) -> Positions:
        """Where a pass's tokens stand for the language model (`engine.positions`)."""
        return self.family.positions

    def prepare(self, images: list[Any]) -> list[Prepared]:
        """`images` (PIL images) through the processor, once for all the renderings of a
        request (its prompt, and the heads `message_ends` renders)."""
        return self.family.prepare(images)

    def tokens(self, text: str, images: list[Prepared], holds: Holds) -> list[int]:
        """The prompt's tokens for `text` (the chat template's output, `IMAGE` before each
        image's marker) with `images`: each image's positions its own ids, each image
        registered and put on `holds` (its caller releases them when the request ends).

        Only the markers the template wrote for images are expanded, and only the runs the
        expansion framed are images: the marker's or the placeholder's text elsewhere (a
        reply that generated the token, a user who typed it) stays the token it is in a
        prompt without images. The text is tokenized whole, as a prompt without images is,
        so both agree wherever no image is."""
        pieces = text.split(IMAGE)
        if len(pieces) != len(images) + 1:
            raise ValueError("the text holds a character this server uses to mark images")
        marker, out = self.family.marker, [pieces[0]]
        for piece, prepared in zip(pieces[1:], images, strict=True):
            at = piece.find(marker)
            if at < 0:
                raise ValueError("the chat template wrote no image marker for an image")
            out.append(piece[:at] + prepared.expansion + piece[at + len(marker) :])
        tokens = self.processor.tokenizer.encode("".join(out), add_special_tokens=False)
        runs = _framed_runs(tokens, self.family.image_token, self.family.frame)
        if [end - start for start, end in runs] != [p.count for p in images]:
            raise ValueError("the text holds the model's own framed image placeholders")
        for prepared, (start, end) in zip(images, runs, strict=True):
            image = self.ids.register(prepared.pixels, end - start, prepared.digest, prepared.grid)
            holds.append(image)
            tokens[start:end] = range(image.first, image.first + image.count)
        return tokens


def vision_family(folder: Path) -> str | None:
    """The model family of a vision checkpoint's folder; None for a text model's."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if "vision_config" in config else None


def open_vision(
    folder: Path, model: nn.Module, limits: ImageLimits | None = None
) -> tuple[Vision | None, str]:
    """The checkpoint in `folder` opened for images, `model` (mlx-lm's load of its language
    model) given `ImageEmbedding`; (None, why) where it cannot take them."""
    family = vision_family(folder)
    if family is None:
        return None, "it is not a vision model"
    if family not in FAMILIES:
        return None, f"images are not supported for the {family!r} family yet"
    kind = FAMILIES[family]
    try:
        from mlx_vlm.utils import load_model, load_processor
    except ImportError:
        return None, 'the vision extra is not installed (pip install "mlx-cache-server[vision]")'
    owner, text = _embedding(model)
    vlm = load_model(folder, lazy=True)
    # Its language model is mlx-lm's: it shares that embedding and loads no weight of its own.
    vlm.language_model.model.embed_tokens = text
    mx.eval([v for k, v in tree_flatten(vlm.parameters()) if not k.startswith("language_model")])
    processor = load_processor(folder)
    images = kind(vlm, processor)
    ids, deepstack, passes = ImageIds(), Deepstack(), Passes()
    images.open(model, ids, deepstack, passes)
    features = Features(images.encode, FEATURE_BYTES)
    owner.embed_tokens = ImageEmbedding(text, ids, features, deepstack, passes)
    encoder = f"mlx-vlm {version('mlx-vlm')}"
    vision = Vision(processor, images, ids, features, limits or ImageLimits(), encoder)
    return vision, ""


def _embedding(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The module holding the language model's token embedding, and that embedding."""
    for _, module in model.named_modules():
        found = module.get("embed_tokens") if isinstance(module, nn.Module) else None
        if isinstance(found, nn.Module):
            return module, found
    raise ValueError("the language model has no token embedding (embed_tokens)")


def _framed_runs(
    tokens: list[int], token: int, frame: tuple[int | None, int | None]
) -> list[tuple[int, int]]:
    """The runs of `token` that `frame`'s tokens enclose (None: any)."""
    before, after = frame
    return [
        (start, end)
        for start, end in token_runs(tokens, token)
        if (before is None or (start > 0 and tokens[start - 1] == before))
        and (after is None or (end < len(tokens) and tokens[end] == after))
    ]
