"""What a node of a model's tree holds, one holding per storage mode.

The radix tree only indexes tokens; a node's `held` is opaque to it. A model's tree
(`tree.ModelTree`) holds, by its layout's mode (`layers.Layout`):

- prefix sharing: an `Edge`, the KV segment of the node's own edge tokens;
- checkpointed (hybrid models): a `HybridEdge`, that segment, the window layers' KV
  of the edge's last `window_held` tokens, and maybe a checkpoint, the recurrent
  layers' state after the edge's last token (see `checkpoints`);
- snapshot: an `Entry` on the node where a sequence ends, its whole cache; other
  nodes hold nothing.

The disk tier's tree holds its files the same way (`disk_tree`).

Invariants: `nbytes` is every byte a holding counts, the sum of its parts' own counts;
the ledger counts exactly that for each node. Bytes are those of the arrays held, as
measured when they were stored (`PromptCache.measure`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .layers import Segment


@dataclass
class Edge:
    """The KV of an edge's tokens (prefix sharing)."""

    segment: Segment
    segment_nbytes: int
    alone: ClassVar[bool] = False  # other sequences may share it: it goes with its node

    @property
    def nbytes(self) -> int:
        return self.segment_nbytes


@dataclass
class HybridEdge(Edge):
    """The KV layers' segment of an edge's tokens, its windows' KV of its last tokens, and
    maybe a checkpoint after its last token (checkpointed mode)."""

    window: Segment | None = None  # the window layers' KV of the last `window_held` tokens
    window_held: int = 0
    window_nbytes: int = 0
    checkpoint: list[Any] | None = None  # the recurrent layers' state after the last token
    checkpoint_nbytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.segment_nbytes + self.window_nbytes + self.checkpoint_nbytes


@dataclass
class Entry:
    """A whole sequence's cache, on the node where it ends (snapshot mode)."""

    cache: list[Any]
    nbytes: int
    trimmable: bool  # whether a fetch may trim it back to a shorter prompt
    alone: ClassVar[bool] = True  # its sequence's alone: it goes with the sequence
