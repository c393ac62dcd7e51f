"""Where a pass's tokens stand for the model's rotary embedding.

For most models a token's position is its index in its sequence, which the KV cache's
offset already gives the model. A Qwen-VL model's is not: an image's positions form a
grid (M-RoPE), so the text after an image stands at its index plus a shift, a shift
that depends on every image before it in the sequence. The model cannot see the
sequence's earlier tokens (they are in the cache), and only the engine knows which
sequence each row of a pass is; so the engine runs every pass of the model inside a
context of its `Positions` that says, for each row, what is before the pass's tokens.

- `prefilling(rows)`: a pass over prompts, each row (its tokens already in its cache,
  the pass's tokens for it).
- `decoding(shifts)`: a pass over decoded tokens (one a row, or a row's draft to
  verify), each row's `shift` of its sequence. Decoded tokens are text and never
  change a sequence's shift, so the engine computes it once a stream.

A text model's positions are `PLAIN`: no shift, nothing to set up for a pass. The model
side is `models.vision_positions.ImagePositions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

Rows = Sequence[tuple[Sequence[int], Sequence[int]]]  # (tokens before the pass, the pass's)


class Positions(Protocol):
    def shift(self, tokens: Sequence[int]) -> int:
        """How far the positions after `tokens` stand from their index."""
        ...

    def prefilling(self, rows: Rows) -> AbstractContextManager[None]:
        """The context a prompt pass over `rows` runs in."""
        ...

    def decoding(self, shifts: Sequence[int]) -> AbstractContextManager[None]:
        """The context a pass over decoded tokens runs in, each row's `shift` given."""
        ...


class Plain:
    """A token's position is its index."""

    def shift(self, tokens: Sequence[int]) -> int:
        return 0

    def prefilling(self, rows: Rows) -> AbstractContextManager[None]:
        return nullcontext()

    def decoding(self, shifts: Sequence[int]) -> AbstractContextManager[None]:
        return nullcontext()


PLAIN = Plain()
