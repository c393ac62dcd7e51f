"""Positions of a model whose images take a grid of them: M-RoPE (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL).

Such a model rotates each query and key by three positions (time, height, width), each
for its own share of the rotary frequencies (`frequency_axes`). A text token's three are
equal, so for text M-RoPE is the plain RoPE mlx-lm's language model applies, at the
token's position.
An image's `count` positions form a `grid` (t, h, w): position k of the image is at
(s + k_t, s + k_h, s + k_w), s being where the image starts, and the text after the
image starts at s + the grid's longest side (`Image.span`), not s + count. So a token's
position is its index plus a shift: the sum of (span - count) over the images wholly
before it.

`ImagePositions` works out the shifts from the tokens (an image's ids say which image and
which of its positions: `vision.ImageIds`) and holds what the pass being run adds to
each token's index (`offsets`), set by the engine around each pass
(`engine.positions`). `MRope`, put in place of each attention layer's RoPE, reads it.

Invariants:
- A token's position depends only on the tokens before it and itself, so the KV the
  prompt cache keeps for a prefix is the KV of that prefix in any longer sequence.
- With no offsets set (no image in the pass's sequences), `MRope` is the RoPE it wraps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.positions import Rows
from .vision import IMAGE_BASE, Image, ImageIds, Passes


class PromptPositions:
    """`engine.positions.Positions` for a vision model whose positions are plain (Gemma 3):
    no shift; a prompt's pass is marked as one (`Passes`)."""

    def __init__(self, passes: Passes) -> None:
        self._passes = passes

    def shift(self, tokens: Sequence[int]) -> int:
        return 0

    def prefilling(self, rows: Rows) -> AbstractContextManager[None]:
        return self._passes.prompting()

    def decoding(self, shifts: Sequence[int]) -> AbstractContextManager[None]:
        return nullcontext()


class ImagePositions:
    """`engine.positions.Positions` for a model with M-RoPE; `offsets` is what the pass
    being run adds to each token's index: None (nothing), one shift a row (rows,), or
    three a token (rows, tokens, 3). A prompt's pass is marked as one (`Passes`)."""

    def __init__(self, ids: ImageIds, passes: Passes) -> None:
        self._ids, self._passes = ids, passes
        self.offsets: mx.array | None = None

    def shift(self, tokens: Sequence[int]) -> int:
        if len(self._ids) == 0:
            return 0
        ids = np.asarray(tokens, dtype=np.int64)
        ids = ids[ids >= IMAGE_BASE]
        total = 0
        for image in self._ids.among(ids, forgotten=True):
            last = image.first + image.count - 1  # an image cut short moves nothing yet
            total += int(np.count_nonzero(ids == last)) * (image.span - image.count)
        return total

    def offsets_of(self, before: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """What each of `tokens`, after `before`, adds to its index: (tokens, 3)."""
        shift = self.shift(before)
        ids = np.asarray(tokens, dtype=np.int64)
        out = np.full((len(ids), 3), shift, dtype=np.int64)
        at = np.flatnonzero(ids >= IMAGE_BASE)
        j = 0
        while j < len(at):
            i = int(at[j])
            (image,) = self._ids.among(ids[i : i + 1], forgotten=True)
            k = int(ids[i]) - image.first
            n = _run(ids, i, image)
            if image.grid is not None:
                ks = np.arange(k, k + n)
                t, h, w = image.grid
                grid = np.stack([ks // (h * w), (ks // w) % h, ks % w], axis=1)
                out[i : i + n] = shift - ks[:, None] + grid
            if k + n == image.count:  # its last position: what follows stands past it
                shift += image.span - image.count
                out[i + n :] = shift
            j += n
        return out

    @contextmanager
    def prefilling(self, rows: Rows) -> Iterator[None]:
        with self._passes.prompting(), self._offsets_for(rows):
            yield

    @contextmanager
    def _offsets_for(self, rows: Rows) -> Iterator[None]:
        if len(self._ids) == 0:
            yield
            return
        tables = [self.offsets_of(before, tokens) for before, tokens in rows]
        if not any(t.any() for t in tables):
            yield
            return
        if all(len(t) == 0 or (t == t[0, 0]).all() for t in tables):
            shifts = [int(t[0, 0]) if len(t) else 0 for t in tables]
            with self._set(mx.array(shifts, dtype=mx.int32)):
                yield
            return
        width = max(len(t) for t in tables)  # mlx-lm pads a pass's rows on the right
        padded = np.zeros((len(tables), width, 3), dtype=np.int32)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table
        with self._set(mx.array(padded)):
            yield

    @contextmanager
    def decoding(self, shifts: Sequence[int]) -> Iterator[None]:
        if not any(shifts):
            yield
            return
        with self._set(mx.array(list(shifts), dtype=mx.int32)):
            yield

    @contextmanager
    def _set(self, offsets: mx.array) -> Iterator[None]:
        self.offsets = offsets
        try:
            yield
        finally:
            self.offsets = None


def _run(ids: np.ndarray, i: int, image: Image) -> int:
    """How many of `ids` from `i` on are `image`'s next positions, one after another."""
    end = min(len(ids), i + image.first + image.count - int(ids[i]))
    expected = np.arange(int(ids[i]), int(ids[i]) + end - i)
    same = ids[i:end] == expected
    return int(end - i if same.all() else np.argmin(same))


def frequency_axes(sections: Sequence[int], frequencies: int, interleaved: bool) -> np.ndarray:
    """Which of the three positions (0 time, 1 height, 2 width) each of the `frequencies`
    rotary frequencies takes: `sections` of them each, one section after another
    (Qwen2-VL, Qwen2.5-VL), or `interleaved`, height and width taking every third
    frequency from the second and third on for as many as their sections say and time
    the rest (Qwen3-VL)."""
    if len(sections) != 3 or sum(sections) != frequencies:
        raise ValueError(f"M-RoPE sections {list(sections)} do not cover {frequencies} frequencies")
    if not interleaved:
        return np.repeat(np.arange(3), sections)
    axes = np.zeros(frequencies, dtype=np.int64)
    for axis in (1, 2):
        axes[axis : sections[axis] * 3 : 3] = axis
    return axes


class MRope(nn.Module):
    """A layer's RoPE, given each token's three positions where `positions` has them.

    `rope` is the language model's own (`nn.RoPE`, rotating halves: Qwen's); `axes` which
    position each of its frequencies takes (`frequency_axes`)."""

    def __init__(self, rope: nn.Module, positions: ImagePositions, axes: np.ndarray) -> None:
        super().__init__()
        if getattr(rope, "traditional", False):
            raise ValueError("M-RoPE here rotates halves; this model's RoPE interleaves")
        if len(axes) != rope.dims // 2:
            raise ValueError("M-RoPE's frequencies are not this RoPE's")
        self.rope = rope
        self._positions = positions
        self._dims, self._scale = rope.dims, rope.scale
        self._inv_freq = rope.base ** (-mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims)
        self._axis = mx.array(axes)  # each frequency's position
        mx.eval(self._inv_freq, self._axis)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        offsets = self._positions.offsets
        if offsets is None:
            return self.rope(x, offset)
        if offsets.ndim == 1:
            return self.rope(x, offset + offsets)
        return self._rotate(x, offset, offsets)

    def _rotate(self, x: mx.array, offset: int | mx.array, offsets: mx.array) -> mx.array:
        rows, _, length, _ = x.shape
        if offsets.shape[:2] != (rows, length):
            raise ValueError("the positions set are not this pass's")  # a bug if so
        first = offset if isinstance(offset, mx.array) else mx.array([offset])
        at = first.reshape(-1, 1, 1) + mx.arange(length).reshape(1, -1, 1) + offsets
        angles = (at.astype(mx.float32) * self._scale)[:, :, self._axis] * self._inv_freq
        cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]
        half = self._dims // 2
        x1, x2 = x[..., :half].astype(mx.float32), x[..., half : self._dims].astype(mx.float32)
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        out = mx.concatenate(rotated, axis=-1).astype(x.dtype)
        if self._dims < x.shape[-1]:
            out = mx.concatenate([out, x[..., self._dims :]], axis=-1)
        return out


def install_mrope(
    layers: Sequence[nn.Module],
    positions: ImagePositions,
    sections: Sequence[int],
    interleaved: bool = False,
) -> None:
    """Each attention layer's RoPE in `layers` wrapped in `MRope` (a hybrid model's other
    layers have none)."""
    for layer in layers:
        attention = layer.get("self_attn")
        if attention is None:
            continue
        axes = frequency_axes(sections, attention.rope.dims // 2, interleaved)
        attention.rope = MRope(attention.rope, positions, axes)
