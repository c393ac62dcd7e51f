"""Which positions of a forward pass are computed: a verification pass's are not all.

A pass that verifies drafts (`engine/speculative.py`) runs each stream's next token and
its draft as one row, every row padded to the longest draft; on a CPU a padded position
costs what a live one does, in every product and in attention. Within `live_positions`,
the thread's calls of our block (`kernel_block`) and attention (`kernel_attention`) over
that pass compute each row's first `lengths[b]` positions only. The fillers' q, k and v
are zeros, their attention zeros, their block outputs their inputs: finite, attended by
no live position (they come after it in their row), and cut from the cache or made gaps
after the pass. A live position's bits are the same either way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

_state = threading.local()


@contextmanager
def live_positions(lengths: list[int], width: int) -> Iterator[None]:
    """Within it, this thread's calls over (len(lengths), width) positions compute only
    each row's first lengths[b]."""
    _state.lengths, _state.width = mx.array(lengths, dtype=mx.int32), width
    try:
        yield
    finally:
        _state.lengths = None


def lengths_for(batch: int, positions: int) -> mx.array | None:
    """The live counts for a call over (batch, positions), None outside `live_positions`
    or for a call of another shape."""
    lengths = getattr(_state, "lengths", None)
    if lengths is None or lengths.shape[0] != batch or _state.width != positions:
        return None
    return lengths
