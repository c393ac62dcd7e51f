"""Images in a request: decoded, checked and opened, or a 400 that names the part.

A client sends an image as a data URL (chat completions' `image_url`, Responses'
`input_image`) or as base64 with its media type (Anthropic's `image` block). Whatever it
sends is untrusted: a file that is no image, a truncated one, or one whose header claims
more pixels than the server takes (a decompression bomb) is refused before its pixels are
decoded, and so are more images than a request may carry. An `http(s)` URL is fetched only
where the operator said so (`--fetch-image-urls`): fetching is a request the server makes
on a client's behalf, to wherever the client names.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
import warnings
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..models.vision_load import ImageLimits
from .api_errors import APIError

MAX_IMAGE_BYTES = 20 * 1024**2  # one image's encoded bytes
FETCH_SECONDS = 10.0  # a fetch's connection and each of its reads (the request's budget bounds all)
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class ImageReader:
    """A request's images read under the served model's limits."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits

    def image(self, url: Any, param: str) -> Image.Image:
        """The image a URL names (`data:` or, where allowed, `http(s)`)."""
        return self._opened(self._bytes(url, param), param)

    def data_url(self, url: Any, param: str) -> str:
        """A data URL of the image `url` names, its image checked here (so a bad one's 400
        names the client's own field, and a fetched one is fetched once)."""
        raw = self._bytes(url, param)
        image = self._opened(raw, param)
        if isinstance(url, str) and url.startswith("data:"):
            return url
        media = Image.MIME.get(image.format or "", "image/png")
        return f"data:{media};base64,{base64.b64encode(raw).decode()}"

    def base64_data_url(self, media_type: Any, data: Any, param: str) -> str:
        """The data URL of base64 image `data` of `media_type` (Anthropic's), checked."""
        if media_type not in MEDIA_TYPES:
            raise APIError(
                400, "An image's media_type must be image/jpeg, image/png, image/gif or "
                "image/webp.", param=param.rsplit(".", 1)[0] + ".media_type",
            )  # fmt: skip
        self._opened(_decoded(data, param), param)
        return f"data:{media_type};base64,{data}"

    def counted(self, images: list[Image.Image]) -> list[Image.Image]:
        """`images`, or a 400 past the limit of images in a request."""
        if len(images) > self.limits.max_images:
            raise APIError(
                400,
                f"A request may carry at most {self.limits.max_images} images; got {len(images)}.",
                param="messages",
            )
        return images

    def _bytes(self, url: Any, param: str) -> bytes:
        if not isinstance(url, str):
            raise APIError(400, "An image URL must be a string.", param=param)
        if url.startswith(("http://", "https://")):
            if not self.limits.fetch_urls:
                raise APIError(
                    400,
                    "This server does not fetch image URLs; send the image as a data URL "
                    "(data:image/png;base64,...).",
                    param=param,
                )
            return _fetched(url, param)
        header, comma, data = url.partition(",")
        if not (header.startswith("data:image/") and header.endswith(";base64") and comma):
            raise APIError(
                400, "An image must be a base64 data URL (data:image/png;base64,...).",
                param=param,
            )  # fmt: skip
        return _decoded(data, param)

    def _opened(self, raw: bytes, param: str) -> Image.Image:
        """`raw` decoded as an RGB image; a 400 for anything that is not a whole image within
        the pixel limit, checked on its header before its pixels are decoded."""
        most = self.limits.max_pixels
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(raw))
                width, height = image.size
                if width * height > most or width < 1 or height < 1:
                    raise APIError(
                        400,
                        f"The image is {width}x{height} pixels; at most {most} are taken.",
                        param=param,
                    )
                image.load()
                return image.convert("RGB")
        except APIError:
            raise
        except (
            UnidentifiedImageError,
            Image.DecompressionBombError,
            Image.DecompressionBombWarning,
        ):
            raise APIError(400, "The data is not an image this server can read.",
                           param=param) from None  # fmt: skip
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise APIError(400, f"The image cannot be decoded: {e}", param=param) from None


def _decoded(data: Any, param: str) -> bytes:
    if not isinstance(data, str):
        raise APIError(400, "An image's data must be a base64 string.", param=param)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(400, f"The image is over {MAX_IMAGE_BYTES} bytes.", param=param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "The image's data is not valid base64.", param=param) from None


def _fetched(url: str, param: str) -> bytes:
    """The bytes at `url`, at most `MAX_IMAGE_BYTES`; a 400 saying why not (the client named
    the URL: its failure is the client's to fix)."""
    request = urllib.request.Request(url, headers={"User-Agent": "mlx-cache-server"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_SECONDS) as response:
            raw = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise APIError(400, f"The image URL could not be fetched: {e}", param=param) from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise APIError(400, f"The image is over {MAX_IMAGE_BYTES} bytes.", param=param)
    return raw


def reader_for(vision: Any) -> ImageReader | None:
    """The reader of a served model's images (`Engine.vision`); None for a model that takes
    none."""
    return ImageReader(vision.limits) if vision is not None else None
