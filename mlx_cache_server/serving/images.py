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
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..models.vision import Holds
from ..models.vision_load import ImageLimits
from .api_errors import APIError

MAX_IMAGE_BYTES = 20 * 1024**2  # one image's encoded bytes
FETCH_SECONDS = 10.0  # a fetch's connection and each of its reads
FETCH_DEADLINE = 20.0  # a fetch's whole download, however slowly it arrives
MAX_REDIRECTS = 3
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")  # what Pillow may open: not every format it knows


class ImageReader:
    """A request's images read under the served model's limits."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        self.read = 0  # images read: one reader per request, counted before each is decoded
        # The data URLs a translation (Messages, Responses) checked, with their images: the
        # render that follows takes them from here rather than decoding them again.
        self.checked: dict[str, Image.Image] = {}

    def image(self, url: Any, param: str) -> Image.Image:
        """The image a URL names (`data:` or, where allowed, `http(s)`); one this reader has
        checked already is not read again."""
        if isinstance(url, str) and url in self.checked:
            return self.checked[url]
        self._count()
        return self._opened(self._bytes(url, param), param)

    def data_url(self, url: Any, param: str) -> str:
        """A data URL of the image `url` names, its image checked here (so a bad one's 400
        names the client's own field, and a fetched one is fetched once)."""
        self._count()
        raw = self._bytes(url, param)
        image = self._opened(raw, param)
        if not url.startswith("data:"):  # `_bytes` took it: a string
            # The opened image is its RGB copy, which has no format: read it off the header.
            media = Image.MIME.get(Image.open(io.BytesIO(raw), formats=FORMATS).format or "",
                                   "image/png")  # fmt: skip
            url = f"data:{media};base64,{base64.b64encode(raw).decode()}"
        self.checked[url] = image
        return url

    def base64_data_url(self, media_type: Any, data: Any, param: str) -> str:
        """The data URL of base64 image `data` of `media_type` (Anthropic's), checked."""
        if media_type not in MEDIA_TYPES:
            raise APIError(
                400, "An image's media_type must be image/jpeg, image/png, image/gif or "
                "image/webp.", param=param.rsplit(".", 1)[0] + ".media_type",
            )  # fmt: skip
        self._count()
        url = f"data:{media_type};base64,{data}"
        self.checked[url] = self._opened(_decoded(data, param), param)
        return url

    def _count(self) -> None:
        """A 400 past the limit of images in a request, before the next one is decoded."""
        self.read += 1
        if self.read > self.limits.max_images:
            raise APIError(
                400,
                f"A request may carry at most {self.limits.max_images} images.",
                param="messages",
            )

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
                image = Image.open(io.BytesIO(raw), formats=FORMATS)
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
    """The bytes at `url`, at most `MAX_IMAGE_BYTES` within `FETCH_DEADLINE` seconds, over
    http(s) only (redirects too, at most `MAX_REDIRECTS`); a 400 saying why not (the client
    named the URL: its failure is the client's to fix)."""
    deadline = time.monotonic() + FETCH_DEADLINE
    request = urllib.request.Request(url, headers={"User-Agent": "mlx-cache-server"})
    chunks, size = [], 0
    try:
        with _OPENER.open(request, timeout=FETCH_SECONDS) as response:
            while size <= MAX_IMAGE_BYTES:
                if time.monotonic() > deadline:
                    raise APIError(400, f"The image URL took over {FETCH_DEADLINE:g} s to fetch.",
                                   param=param)  # fmt: skip
                chunk = response.read(64 * 1024)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except APIError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise APIError(400, f"The image URL could not be fetched: {e}", param=param) from None
    if size > MAX_IMAGE_BYTES:
        raise APIError(400, f"The image is over {MAX_IMAGE_BYTES} bytes.", param=param)
    return b"".join(chunks)


class _HttpRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only, and a few."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        if not newurl.startswith(("http://", "https://")):
            raise urllib.error.URLError(f"a redirect to {newurl.split(':')[0]} is not followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpRedirects)


def held_until(on_release: Callable[[Callable[[], None]], None], vision: Any) -> Holds | None:
    """The holds of a request on a vision model's images (`Engine.vision`), released by
    `on_release` (a request's slot: however the request ends); None for a model that
    takes no images."""
    if vision is None:
        return None
    holds = Holds(vision.ids)
    on_release(holds.release)
    return holds


def reader_for(vision: Any) -> ImageReader | None:
    """The reader of a served model's images (`Engine.vision`); None for a model that takes
    none."""
    return ImageReader(vision.limits) if vision is not None else None
