"""Which of two decode batches a sequence joins: the main one or the side one.

mlx-lm's batch keeps its sequences' KV in one rectangle per layer, each sequence
left-padded to the longest. A long prompt joining short streams pads every one of
them to its length: the join copies the whole batch into a buffer that many times
its size, and every decode step after it reads the padding as if it were KV. Beside
a batch whose rectangle would be mostly padding, a second batch costs less: one more
forward pass per step, each pass reading only its own sequences' KV
(`python -m bench mixed` measures the streams' inter-token latency until the long
prompt's last token: bench/results/mixed.json).

A sequence joins a batch with sequences in it whose padding would stay within
`PADDING_LIMIT` tokens of KV held per token of real KV, the main one first; else an
empty one, the main one first; else, both padded past the limit, whichever it pads
less. So short streams arriving while a long sequence holds the main batch gather in
the side batch once padding them to it would pass the limit, as a long sequence beside
short streams does; and once one batch empties, sequences gather in the other rather
than split over two forward passes. The two batches together decode at most
`capacity` sequences (`--completion-batch-size`), as one did: past it, a sequence
waits its turn in the main batch.

Pure: lengths in, a batch's index out.
"""

from __future__ import annotations

from collections.abc import Sequence

PADDING_LIMIT = 2.0  # tokens of KV a batch holds, padding included, per real token
MAIN, SIDE = 0, 1


def padded(lengths: Sequence[int], joining: int) -> float:
    """Tokens a batch of sequences of `lengths` holds per real token, one of `joining`
    tokens joined: every sequence is padded to the longest."""
    real = sum(lengths) + joining
    if real <= 0:
        return 1.0
    return (len(lengths) + 1) * max([joining, *lengths]) / real


def place(length: int, main: Sequence[int], side: Sequence[int], capacity: int) -> int:
    """`MAIN` or `SIDE`: where a sequence of `length` tokens decodes, beside batches
    holding sequences of the lengths `main` and `side`, `capacity` at most in both."""
    if len(main) + len(side) >= capacity:
        return MAIN
    into_main, into_side = padded(main, length), padded(side, length)
    if main and into_main <= PADDING_LIMIT:
        return MAIN
    if side and into_side <= PADDING_LIMIT:
        return SIDE
    if not main:
        return MAIN
    if not side:
        return SIDE
    return MAIN if into_main <= into_side else SIDE
