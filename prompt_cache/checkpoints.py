"""Where a hybrid model's cache can resume, and which checkpoint goes first.

In checkpointed mode (`layers.Layout.checkpointed`) a node's edge holds the KV
layers' segment, as in prefix sharing, and may hold a checkpoint: the other
layers' state after the node's last token. A fetch resumes at the deepest node
of its walk that has a checkpoint, no deeper than its match and leaving at least
one token to run; the KV layers are joined up to there.

Policy, apart from the mechanism: checkpoints are bytes like any other, in the
same budget. A sequence's end keeps its checkpoint as long as the sequence is
cached (its next turn resumes there). The others (where a system prompt ended,
a token before a prompt's end, a reply inside a longer conversation) go when
room is short and no whole sequence can be evicted instead, least recently used
first (stored or resumed from).
"""

from __future__ import annotations

from collections.abc import Iterable

from .radix import Node, Walk


def resume_point(w: Walk, asked: int) -> Node | None:
    """The deepest node of the walk a fetch of `asked` tokens can resume from."""
    limit = min(w.length, asked - 1)
    for node in reversed(w.nodes):
        if node.checkpoint is not None and node.depth <= limit:
            return node
    return None


def first_to_drop(nodes: Iterable[Node]) -> Node | None:
    """The checkpoint that goes first when room is short: not at a sequence's end, least
    recently used. (A fetch that planned with it holds its own reference.)"""
    loose = (n for n in nodes if n.checkpoint is not None and not n.terminal)
    return min(loose, key=lambda n: n.checkpoint_used, default=None)
