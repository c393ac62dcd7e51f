"""Images in a request: decoded, checked and opened, or a 400 that names the part.

A client sends an image as a data URL (chat completions' `image_url`, Responses'
`input_image`) or as base64 with its media type (Anthropic's `image` block). Whatever it
sends is untrusted: a file that is no image, a truncated one, or one whose header claims
more pixels than the server will hold (a decompression bomb) is refused before its pixels
are decoded, and so are more images than a request may carry. Fetching an `http(s)` URL
would be a request the server makes on a client's behalf: it is not done.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from PIL import Image, UnidentifiedImageError

from .api_errors import APIError

MAX_PIXELS = 40_000_000  # an image's width x height, read from its header before decoding
MAX_IMAGES = 16  # images in one request
MAX_IMAGE_BYTES = 20 * 1024**2  # one image's encoded bytes


def from_data_url(url: Any, param: str) -> Image.Image:
    """The image of a `data:image/...;base64,` URL."""
    if not isinstance(url, str):
        raise APIError(400, "An image URL must be a string.", param=param)
    if url.startswith(("http://", "https://")):
        raise APIError(
            400,
            "This server does not fetch image URLs; send the image as a data URL "
            "(data:image/png;base64,...).",
            param=param,
        )
    header, comma, data = url.partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64") and comma):
        raise APIError(
            400, "An image must be a base64 data URL (data:image/png;base64,...).", param=param
        )
    return from_base64(data, param)


def from_base64(data: Any, param: str) -> Image.Image:
    """The image of base64 `data`."""
    if not isinstance(data, str):
        raise APIError(400, "An image's data must be a base64 string.", param=param)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(400, f"The image is over {MAX_IMAGE_BYTES} bytes.", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "The image's data is not valid base64.", param=param) from None
    return opened(raw, param)


def opened(raw: bytes, param: str) -> Image.Image:
    """`raw` decoded as an RGB image; a 400 for anything that is not a whole image of at
    most `MAX_PIXELS` pixels."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
            if width * height > MAX_PIXELS or width < 1 or height < 1:
                raise APIError(
                    400,
                    f"The image is {width}x{height} pixels; at most {MAX_PIXELS} are taken.",
                    param=param,
                )
            image.load()
            return image.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(400, "The data is not an image this server can read.", param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise APIError(400, f"The image cannot be decoded: {e}", param=param) from None


def counted(images: list[Image.Image]) -> list[Image.Image]:
    """`images`, or a 400 past `MAX_IMAGES`."""
    if len(images) > MAX_IMAGES:
        raise APIError(
            400, f"A request may carry at most {MAX_IMAGES} images; got {len(images)}.",
            param="messages",
        )  # fmt: skip
    return images


def checked_data_url(media_type: Any, data: Any, param: str) -> str:
    """The data URL of base64 image `data` of `media_type`, its image checked here (so a bad
    one's 400 names the client's own field)."""
    if media_type not in ("image/jpeg", "image/png", "image/gif", "image/webp"):
        raise APIError(
            400, "An image's media_type must be image/jpeg, image/png, image/gif or image/webp.",
            param=param.rsplit(".", 1)[0] + ".media_type",
        )  # fmt: skip
    from_base64(data, param)
    return f"data:{media_type};base64,{data}"
