"""Attaching what an insert copied to a model's tree: a segment under a node (prefix
sharing), a segment and a checkpoint (hybrid models), or a whole snapshot; and the
split of an edge an insert ends inside.

Invariants: room is made (`Budget.make_room`) before anything is hung, and what is hung
is counted in the ledger as it is; a refused attach hangs nothing and the sequence it
would have extended is still cached (what was evicted for room stays evicted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import layers, planning
from .budget import Budget
from .held import HybridEdge
from .ledger import Ledger
from .radix import TOKEN, Node, Walk, add_child, split
from .tree import ModelTree


class Attacher:
    """Hangs what an insert (or a load from disk) prepared in a `PromptCache`'s trees.

    Given the cache's ledger (bookkeeping of what is hung), its budget (room for it) and
    its `measure`. Every method expects the cache's lock held, and the node it attaches
    under pinned.
    """

    def __init__(self, ledger: Ledger, budget: Budget, measure: Callable[[Any], int]) -> None:
        self._ledger = ledger
        self._budget = budget
        self._measure = measure

    def anchor(self, tree: ModelTree, w: Walk, n: int, prep: planning.Prepared) -> Node:
        """The node the new sequence ends at or hangs from, splitting an edge if needed."""
        end = w.nodes[-1] if w.nodes else tree.root
        if not w.partial or (tree.layout.sliceable and w.length == n):
            return end
        k = w.length - end.start
        tree.version += 1
        if not tree.layout.segmented:
            return split(end, k)
        tail = end.held
        halves = prep.halves if prep.split_of is tail.segment and prep.split_at == k else None
        if halves is None:  # another insert split this edge meanwhile
            halves = layers.cut_segment(tail.segment, 0, k), layers.cut_segment(tail.segment, k)
        head = split(end, k)
        head.held = tree.edge(halves[0], self._measure(halves[0]))
        tail.segment, tail.segment_nbytes = halves[1], self._measure(halves[1])
        if tree.layout.checkpointed and tail.window_held > end.size:
            # The window KV reaches into the head's tokens.
            self._split_window(tree, head.held, tail, end.size)
            head.used = end.used
        return head

    def _split_window(self, tree: ModelTree, head: HybridEdge, tail: HybridEdge, size: int) -> None:
        """Move what `tail`'s window KV holds before its edge's last `size` tokens to `head`."""
        over = tail.window_held - size
        head.window = layers.cut_segment(tail.window, 0, over)
        tail.window = layers.cut_segment(tail.window, over)
        head.window_held, tail.window_held = over, size
        before = tail.window_nbytes
        head.window_nbytes, tail.window_nbytes = map(self._measure, (head.window, tail.window))
        self._ledger.add_bytes(tree, head.window_nbytes + tail.window_nbytes - before)

    def segment(
        self, tree: ModelTree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        """Hang `key`'s tokens past `m` (an edge under `parent`, which ends at `m`) holding
        the prepared segment, as a cached sequence; False when there is no room."""
        if m * TOKEN == len(key):  # already on a stored path; only recency changes
            if parent.terminal and parent.depth == m:
                self._ledger.touch(parent, tree)
            return True
        seg = prep.segment
        if m > prep.start:  # another insert stored part of it meanwhile
            seg = layers.cut_segment(seg, m - prep.start)
        need = self._measure(seg)
        extends = parent.terminal  # the stored sequence becomes a prefix of this one
        if extends:
            self._ledger.unmark(tree, parent)
        if not self._budget.make_room(need, 0 if extends else 1):
            if extends:
                self._ledger.mark(tree, parent)
            return False
        child = add_child(parent, key[m * TOKEN :])
        tree.version += 1
        child.held = tree.edge(seg, need)
        self._ledger.add_bytes(tree, need)
        self._ledger.mark(tree, child)
        return True

    def checkpointed(
        self, tree: ModelTree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        """As `segment`; the new end holds the checkpoint (an end already on the
        tree gets it, if it has none), and window KV the path lacks is filled in."""
        n = len(key) // TOKEN
        ends_here = m == n
        path = _path_to(parent)
        fills = self._window_fills(path, prep)
        need = sum(nb - node.held.window_nbytes for node, _, _, nb in fills)
        put_checkpoint = prep.checkpoint is not None and (
            not ends_here or parent.held.checkpoint is None
        )
        if put_checkpoint:
            need += prep.checkpoint_nbytes
        if not ends_here:
            seg = prep.segment
            if m > prep.start:  # another insert stored part of it meanwhile
                seg = layers.cut_segment(seg, m - prep.start)
            seg_nbytes = self._measure(seg)
            window, held = self._window_from(prep, m, n)
            window_nbytes = self._measure(window) if window is not None else 0
            need += seg_nbytes + window_nbytes
        extends = parent.terminal and not ends_here
        # While room is made, the path keeps the window KV the new end resumes from and what
        # is filled (pinned); the sequence this extends is still one (pinned, it is not
        # evicted), its checkpoint not one that goes first, and kept if the insert is refused.
        kept = [node for node in path if node.depth > n - tree.layout.span]
        self._ledger.pin(kept)
        try:
            room = self._budget.make_room(need, 0 if extends or ends_here else 1)
        finally:
            self._ledger.unpin(tree, kept)
        if not room:
            return False
        now = self._ledger.tick()
        for node, longer, longer_held, nb in fills:
            edge = node.held
            self._ledger.add_bytes(tree, nb - edge.window_nbytes)
            edge.window, edge.window_held, edge.window_nbytes = longer, longer_held, nb
            node.used = now
        if ends_here:
            if put_checkpoint:
                parent.held.checkpoint = prep.checkpoint
                parent.held.checkpoint_nbytes = prep.checkpoint_nbytes
                self._ledger.add_bytes(tree, prep.checkpoint_nbytes)
            parent.used = now
            if parent.terminal:
                self._ledger.touch(parent, tree)
            return True
        if extends:
            self._ledger.unmark(tree, parent)
        child = add_child(parent, key[m * TOKEN :])
        tree.version += 1
        child.held = HybridEdge(seg, seg_nbytes, window, held, window_nbytes, prep.checkpoint,
                                prep.checkpoint_nbytes)  # fmt: skip
        child.used = now
        self._ledger.add_bytes(tree, child.held.nbytes)
        self._ledger.mark(tree, child)
        return True

    def _window_from(self, prep: planning.Prepared, m: int, n: int) -> tuple[Any, int]:
        """The window KV of a new edge [m, n): what the insert's cache still held of it."""
        if prep.window is None or prep.window_from >= n:
            return None, 0
        if prep.window_from >= m:
            return prep.window, n - prep.window_from
        return layers.cut_segment(prep.window, m - prep.window_from), n - m

    def _window_fills(
        self, path: list[Node], prep: planning.Prepared
    ) -> list[tuple[Node, Any, int, int]]:
        """For nodes on the path whose window KV lacks tokens the insert's cache held: the
        longer window each gets (node, window, held, bytes)."""
        out = []
        for node in path:
            if prep.window is None or node.depth <= prep.window_from:
                continue
            first = max(node.start, prep.window_from)
            if node.depth - node.held.window_held <= first:
                continue
            window = layers.cut_segment(
                prep.window, first - prep.window_from, node.depth - prep.window_from
            )
            out.append((node, window, node.depth - first, self._measure(window)))
        return out

    def snapshot(
        self, tree: ModelTree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        """Store the prepared snapshot at the end of `key` (on `parent` when it ends there),
        replacing one stored there; False when there is no room."""
        ends_here = m * TOKEN == len(key)
        replaces = ends_here and parent.terminal
        old = parent.held.nbytes if replaces else 0
        if not self._budget.make_room(max(0, prep.entry.nbytes - old), 0 if replaces else 1):
            return False
        node = parent if ends_here else add_child(parent, key[m * TOKEN :])
        tree.version += 1
        node.held = prep.entry
        self._ledger.add_bytes(tree, prep.entry.nbytes - old)
        if replaces:
            self._ledger.touch(node, tree)
        else:
            self._ledger.mark(tree, node)
        return True


def _path_to(node: Node) -> list[Node]:
    """`node` and its ancestors, root excluded."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path
