"""Where a hybrid model's cache can resume, and which window KV or checkpoint goes first.

In checkpointed mode (`layers.Layout.checkpointed`) a node holds (`held.HybridEdge`)
its edge's KV layers' segment, as in prefix sharing; the window layers' KV of the edge's last
`window_held` tokens (all of them, or a suffix: a window drops its oldest
tokens as it runs, and stored window KV can be dropped for room); and may hold
a checkpoint: the recurrent layers' state after the node's last token.

Invariants:
- A fetch resumes at token n only if every window can be rebuilt there: the
  window KV of the `span` tokens before n (all of them when n < span) lies
  along the path. With recurrent layers n is also the end of a node holding a
  checkpoint; without them n can be any such token, as in prefix sharing.
- n is at most the match and leaves at least one token to run.
- A sequence's end stays resumable as long as the sequence is cached: its
  checkpoint and the window KV of the `span` tokens before it are never what
  goes first.

Policy, apart from the mechanism: window KV and checkpoints are bytes like any
other, in the same budget. What no sequence's end needs (where a system prompt
ended, a token before a prompt's end, old window KV inside a conversation) can
go when room is short; `Budget.make_room` weighs the least recently used of it
against the least recently used sequence, on one clock (stored, or resumed from).
With recurrent layers an insert keeps only the window KV before its own end:
such a model resumes nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .radix import Node, Walk

if TYPE_CHECKING:
    from .layers import Segment


def window_covers(nodes: list[Node], n: int, span: int) -> Node | None:
    """None when the window KV of the `span` tokens before token n lies along the path
    `nodes`; else the node that lacks some of it."""
    lo = max(0, n - span)
    for node in reversed(nodes):
        if node.start >= n:
            continue
        if node.depth <= lo:
            break
        if node.depth - node.held.window_held > max(lo, node.start):
            return node
    return None


def resume_point(w: Walk, asked: int, span: int, states: bool) -> tuple[int, Node | None]:
    """The deepest token a fetch of `asked` tokens can resume at (0: none), and the node
    whose checkpoint it restores (None without recurrent layers)."""
    limit = min(w.length, asked - 1)
    if states:
        for node in reversed(w.nodes):
            if node.held.checkpoint is not None and 0 < node.depth <= limit:
                if window_covers(w.nodes, node.depth, span) is None:
                    return node.depth, node
        return 0, None
    n = limit
    while n > 0:
        gap = window_covers(w.nodes, n, span)
        if gap is None:
            return n, None
        # The window KV it lacks is at the start of its edge: every later resume point
        # up to here needs some of it, so the next candidate is before that node.
        n = gap.start
    return 0, None


def window_pieces(nodes: list[Node], n: int, span: int) -> list[tuple[Segment, int, int]]:
    """Where the window KV of the `span` tokens before n lies: (segment, from, to) with
    positions in each node's stored window, in token order."""
    lo = max(0, n - span)
    out = []
    for node in nodes:
        if node.depth <= lo or node.start >= n:
            continue
        first = node.depth - node.held.window_held
        out.append((node.held.window, max(lo, node.start) - first, min(n, node.depth) - first))
    return out


def needed_from(node: Node, span: int) -> int | None:
    """The first token of `node`'s edge whose window KV a sequence ending at or below it
    needs (None: none does)."""
    need: int | None = None
    stack = [node]
    while stack:
        x = stack.pop()
        if x.depth - span >= node.depth:
            continue  # it needs nothing of `node`, nor does anything below it
        if x.terminal:
            first = max(node.start, x.depth - span)
            need = first if need is None else min(need, first)
        stack.extend(x.children.values())
    return need


def first_to_drop(nodes: Iterable[Node], span: int) -> tuple[Node, str, int] | None:
    """What goes first when room is short, least recently used: (node, "checkpoint", 0)
    for a checkpoint not at a sequence's end, or (node, "window", k) for the first k
    tokens of a node's window KV that no sequence's end needs. Nodes a running insert or
    fetch pins keep both."""
    best: tuple[Node, str, int] | None = None
    for node in nodes:
        held = node.held
        if held.checkpoint is not None and not node.terminal and not node.pins:
            if best is None or node.used < best[0].used:
                best = (node, "checkpoint", 0)
        if held.window_held and not node.pins:
            need = needed_from(node, span)
            first = node.depth - held.window_held
            loose = held.window_held if need is None else max(0, need - first)
            if loose and (best is None or node.used < best[0].used):
                best = (node, "window", loose)
    return best
