"""A vision model's images, as tokens the engine and the prompt cache already handle.

mlx-lm loads a vision checkpoint's language model (its `gemma3`, `qwen3_vl`, `mistral3`
modules drop the vision weights), and everything the engine does (batching, the cache,
speculation, the CPU fast path) works on token ids. So an image enters as ids: each of
its placeholder positions gets an id of its own above the vocabulary (`ImageIds`), the
same ids for the same pixels, and the model's token embedding (`ImageEmbedding`, put in
place of the language model's) gives those ids the image's features, computed by
mlx-vlm's vision encoder on the engine's thread when a pass first needs them.

Invariants:
- An image id names one position of one image's pixels (as the processor gave them, so a
  resize that changes them is another image); two different images never share an id,
  so the radix tree matches an image only where the very same pixels were prefilled.
- Ids are never reused in a process: a released image's ids stay retired, so a cached
  sequence holding them can never match another image.
- Ids are never handed out twice across restarts where the cache outlives the process
  (the disk tier): `keep_in` records each block of ids before any of it is used, and
  each image's ids, so a restarted server gives the same pixels the same ids.
- Features are kept for recent images within `feature_bytes`; an image whose features
  were dropped is encoded again from its pixels, which are kept while it is registered.
"""

from __future__ import annotations

import hashlib
import os
import threading
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.sampling import NON_TEXT

IMAGE_BASE = NON_TEXT  # image ids start here: above any vocabulary, within int32
IMAGE_END = 1 << 31
RESERVE = 1 << 16  # ids recorded as handed out at a time, before any of them is used
RETIRED = 4096  # forgotten images whose places are still known (`ImageIds.placed`)


@dataclass
class Image:
    """One image as the model takes it: its pixels and the ids of its positions."""

    digest: bytes
    pixels: np.ndarray | None  # its processed pixel values, kept while a request holds it
    first: int  # its first id
    count: int  # its positions
    holds: int = 0  # requests holding it (`ImageIds.register`, `release`)
    # The (time, height, width) grid its positions take in a model whose images have 2-D
    # positions (`vision_positions`); None: one run of positions, as text has.
    grid: tuple[int, int, int] | None = None

    @property
    def span(self) -> int:
        """How far it moves the positions of what follows it: its positions, or where they
        form a grid, the grid's longest side."""
        return max(self.grid) if self.grid is not None else self.count


class ImageIds:
    """The ids of each image's positions: a block per distinct digest, never reused.

    A request holds each image it registers until it ends (`release`): a held image is
    never forgotten and keeps its pixels, so its features can be encoded whenever a pass
    needs them. Of the images no request holds, the most recent `max_images` are
    remembered (the same pixels get the same ids again), without their pixels."""

    def __init__(self, max_images: int = 256) -> None:
        self._lock = threading.Lock()
        self._next = IMAGE_BASE
        self._by_digest: OrderedDict[bytes, Image] = OrderedDict()
        self._firsts: list[int] = []  # the remembered images' first ids, sorted
        self._by_first: dict[int, Image] = {}
        # The places of the last images forgotten (`placed`), oldest first.
        self._retired: OrderedDict[int, Image] = OrderedDict()
        self._retired_firsts: list[int] = []
        self.max_images = max_images
        self._log: Any = None  # the record `keep_in` opened
        self._reserved = IMAGE_END  # without a record, every id may be handed out

    def keep_in(self, path: Path) -> None:
        """Record the ids handed out in the file `path` (read first, where it exists): a
        block is recorded before any of its ids is used, so after a crash no id is
        handed out again, and each image's ids, so its pixels get them again (an image
        line lost in a crash loses only that reuse: it is not synced)."""
        lines = path.read_text().splitlines() if path.exists() else []
        recalled: list[tuple[bytes, int, int]] = []
        with self._lock:
            for line in lines:
                kind, *fields = line.split()
                try:
                    if kind == "reserve":
                        self._next = max(self._next, int(fields[0]))
                    elif kind == "image":
                        recalled.append((bytes.fromhex(fields[0]), int(fields[1]), int(fields[2])))
                except (ValueError, IndexError):
                    continue  # a line cut by a crash: its block was recorded before it
            for digest, first, count in recalled[-self.max_images :]:
                if IMAGE_BASE <= first and first + count <= self._next:
                    self._remember(Image(digest, None, first, count))
            self._log = open(path, "a")  # noqa: SIM115 (held until the process ends)
            self._reserved = self._next

    def register(
        self,
        pixels: np.ndarray,
        count: int,
        digest: bytes | None = None,
        grid: tuple[int, int, int] | None = None,
    ) -> Image:
        """The image of these pixels (`digest`: theirs, if known), with `count` positions
        (in `grid`, where they form one), held for the caller until it calls `release`: the
        same ids as before for the same pixels, new ones otherwise."""
        digest = digest or pixel_digest(pixels)
        with self._lock:
            image = self._by_digest.get(digest)
            if image is None or image.count != count:
                image = self._new(digest, count)  # held from the start: never forgotten first
            else:
                image.holds += 1
                self._by_digest.move_to_end(digest)
            image.pixels = pixels if image.pixels is None else image.pixels
            image.grid = grid  # its pixels' own: an image recalled from disk has none yet
            return image

    def release(self, images: list[Image]) -> None:
        """The end of a request's hold on `images` (one per `register` it made)."""
        with self._lock:
            for image in images:
                image.holds -= 1
                if image.holds == 0:
                    image.pixels = None  # encoded again, if ever, from a new request's
            self._forget_unheld()

    def of(self, token: int) -> Image | None:
        """The remembered image one of whose ids is `token`, else None."""
        with self._lock:
            return _holding(token, self._firsts, self._by_first)

    def placed(self, token: int) -> Image | None:
        """The image one of whose ids is `token`, remembered or among the last `RETIRED`
        forgotten (their ids, count and grid only): where an image stands in a sequence is
        needed for as long as the sequence runs, which can outlast its request's hold by a
        step (a request ends, then the engine drops it)."""
        with self._lock:
            image = _holding(token, self._firsts, self._by_first)
            return image or _holding(token, self._retired_firsts, self._retired)

    def among(self, ids: np.ndarray, forgotten: bool = False) -> Iterator[Image]:
        """The images some of `ids` (image ids, any order, repeats) are of, each once, in
        the order of their ids: remembered ones, and with `forgotten` the places of those
        `placed` still knows. A ValueError for an id of none: a request holds every image
        of its sequence, so that is a bug."""
        unique, i = np.unique(ids), 0  # sorted: an image's ids side by side
        while i < len(unique):
            token = int(unique[i])
            image = self.placed(token) if forgotten else self.of(token)
            if image is None:
                raise ValueError("an image of this sequence is no longer registered")
            yield image
            i = int(np.searchsorted(unique, image.first + image.count))

    def __len__(self) -> int:
        return len(self._by_digest)

    def _new(self, digest: bytes, count: int) -> Image:
        if self._next + count > IMAGE_END:
            raise ValueError("this server has handed out every image id it has")
        if self._next + count > self._reserved:
            self._reserved = min(self._next + count + RESERVE, IMAGE_END)
            self._record(f"reserve {self._reserved}", durable=True)
        image = Image(digest, None, self._next, count, holds=1)
        self._next += count
        self._remember(image)
        self._record(f"image {digest.hex()} {image.first} {count}")
        return image

    def _remember(self, image: Image) -> None:
        known = self._by_digest.pop(image.digest, None)
        if known is not None and known.holds == 0:
            self._forget(known)  # the same pixels with another count: its ids retire
        self._by_digest[image.digest] = image
        insort(self._firsts, image.first)
        self._by_first[image.first] = image
        self._forget_unheld()

    def _forget_unheld(self) -> None:
        """Forget the least recent images no request holds, past `max_images` (their ids
        stay retired)."""
        excess = len(self._by_digest) - self.max_images
        for digest in [d for d, i in self._by_digest.items() if i.holds == 0][: max(excess, 0)]:
            self._forget(self._by_digest.pop(digest))

    def _forget(self, image: Image) -> None:
        del self._by_first[image.first]
        del self._firsts[bisect_left(self._firsts, image.first)]
        self._retired[image.first] = Image(image.digest, None, image.first, image.count, 0,
                                           image.grid)  # fmt: skip
        insort(self._retired_firsts, image.first)
        if len(self._retired) > RETIRED:
            oldest, _ = self._retired.popitem(last=False)
            del self._retired_firsts[bisect_left(self._retired_firsts, oldest)]

    def _record(self, line: str, durable: bool = False) -> None:
        if self._log is None:
            return
        self._log.write(line + "\n")
        self._log.flush()
        if durable:
            os.fsync(self._log.fileno())


def _holding(token: int, firsts: list[int], by_first: dict[int, Image]) -> Image | None:
    """The image in `by_first` (`firsts`: its keys, sorted) one of whose ids is `token`."""
    i = bisect_right(firsts, token) - 1
    image = by_first.get(firsts[i]) if i >= 0 else None
    if image is None or not image.first <= token < image.first + image.count:
        return None
    return image


class Holds:
    """The images one request holds, released together once (`ImageIds.release`); an image
    registered after that (a rendering that outlived its request) is released at once."""

    def __init__(self, ids: ImageIds) -> None:
        self._ids = ids
        self._lock = threading.Lock()
        self._images: list[Image] = []
        self._released = False

    def append(self, image: Image) -> None:
        with self._lock:
            if not self._released:
                self._images.append(image)
                return
        self._ids.release([image])

    def release(self) -> None:
        with self._lock:
            self._released, images, self._images = True, self._images, []
        self._ids.release(images)


def pixel_digest(pixels: np.ndarray) -> bytes:
    """A digest of an image's pixel values, their shape and type included."""
    h = hashlib.sha256(repr((pixels.shape, str(pixels.dtype))).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


# An image -> its embeddings, (positions, hidden), or (levels, positions, hidden) for a model
# that adds the further levels to its first layers' output (`Deepstack`).
Encode = Callable[[Image], mx.array]


class Features:
    """Recent images' features within a byte budget (`budget`: a share of the prompt
    cache's, where the server has one), encoded when first asked for."""

    def __init__(self, encode: Encode, budget: int) -> None:
        self._encode, self.budget = encode, budget
        self._held: OrderedDict[bytes, mx.array] = OrderedDict()
        self.encoded = 0  # images encoded so far (a cached image's turn encodes none)

    def of(self, image: Image) -> mx.array:
        features = self._held.get(image.digest)
        if features is not None:
            self._held.move_to_end(image.digest)
            return features
        if image.pixels is None:  # a request holds every image it prefills: a bug if so
            raise ValueError("an image of this prompt is held by no request")
        features = self._encode(image)
        if features.shape[-2] != image.count:
            raise ValueError(
                f"the vision encoder gave {features.shape[-2]} positions for an image of "
                f"{image.count}"
            )
        self.encoded += 1
        self._held[image.digest] = features
        while len(self._held) > 1 and self.nbytes() > self.budget:
            self._held.popitem(last=False)
        return features

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self._held.values())


class ImageEmbedding(nn.Module):
    """The language model's token embedding, giving image ids their image's features.

    Text ids go to the embedding it replaces (kept as `text`, so a tied output head and
    our module replacements still find it); image ids get rows of their image's
    features (`Features`), and where those have further levels, the pass's `deepstack`
    gets them for the layers that add them."""

    def __init__(
        self,
        text: nn.Module,
        ids: ImageIds,
        features: Features,
        deepstack: Deepstack | None = None,
        passes: Passes | None = None,
    ) -> None:
        super().__init__()
        self.text = text
        self.images, self.features = ids, features
        self.last_text_id = int(text.weight.shape[0]) - 1
        self.deepstack = deepstack if deepstack is not None else Deepstack()
        self.passes = passes if passes is not None else Passes()

    def __call__(self, tokens: mx.array) -> mx.array:
        # A decode step's input is sampled tokens, never an image's: looking would wait for
        # the step before it, which mlx-lm overlaps with this one. A prompt's pass can be one
        # token wide too (a chunk of one), so the width does not tell: `passes` does. Clamped
        # all the same: an id past the table would be read out of bounds (MLX checks none).
        self.deepstack.additions = None  # each pass its own
        decoding = tokens.shape[-1] == 1 and not self.passes.prompt
        if len(self.images) == 0 or decoding:
            return self.text(mx.minimum(tokens, self.last_text_id))
        host = np.asarray(tokens)
        at = host >= IMAGE_BASE
        if not at.any():
            return self.text(tokens)
        embedded = self.text(mx.array(np.where(at, 0, host).astype(host.dtype)))
        parts, index, start = [], np.zeros(host.shape, dtype=np.int32), 0
        for image in self.images.among(host[at]):
            mine = (host >= image.first) & (host < image.first + image.count)
            index[mine] = start + host[mine] - image.first
            parts.append(self.features.of(image))
            start += image.count
        table, rows, mask = mx.concatenate(parts, axis=-2), mx.array(index), mx.array(at)[..., None]
        if table.ndim == 3:  # further levels, added to the first layers' output
            self.deepstack.additions = mx.where(mask, table[1:, rows], 0)
            table = table[0]
        images = table[rows].astype(embedded.dtype)
        return mx.where(mask, images, embedded)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.text.as_linear(x)


class Passes:
    """Whether the pass being run is over prompts, whose ids may be an image's, rather than
    over decoded tokens, which never are: set by the engine's prompt passes (through the
    model's `engine.positions` contexts), read by `ImageEmbedding`."""

    def __init__(self) -> None:
        self.prompt = False

    @contextmanager
    def prompting(self) -> Iterator[None]:
        self.prompt = True
        try:
            yield
        finally:
            self.prompt = False


class Deepstack:
    """What a pass adds to the output of each of the model's first layers at its image
    positions (Qwen3-VL's deepstack: the vision encoder's inner levels), zero elsewhere:
    set by `ImageEmbedding` at the start of each pass, read by each `DeepstackLayer`."""

    def __init__(self) -> None:
        self.additions: mx.array | None = None  # (levels, rows, tokens, hidden); None: none


class DeepstackLayer(nn.Module):
    """A decoder layer whose output gets the pass's `level`th deepstack addition."""

    def __init__(self, layer: nn.Module, level: int, deepstack: Deepstack) -> None:
        super().__init__()
        self.layer = layer
        self._level, self._deepstack = level, deepstack

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.layer(x, *args, **kwargs)
        additions = self._deepstack.additions
        if additions is None or self._level >= additions.shape[0]:
            return out
        return out + additions[self._level].astype(out.dtype)
