"""Attaching what an insert copied to a model's tree: a segment under a node (prefix
sharing), a segment and a checkpoint (hybrid models), or a whole snapshot; and the
split of an edge an insert ends inside.

`Attaching` is a part of `PromptCache` (its methods run under the cache's lock).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import layers, planning
from .radix import TOKEN, Node, Walk, add_child, split
from .tree import ModelTree

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .eviction import LRUOrder


class Attaching:
    measure: Callable[[Any], int]
    _lru: LRUOrder[Node, ModelTree]

    def _anchor(self, tree: ModelTree, w: Walk, n: int, prep: planning.Prepared) -> Node:
        """The node the new sequence ends at or hangs from, splitting an edge if needed."""
        end = w.nodes[-1] if w.nodes else tree.root
        if not w.partial or (tree.layout.sliceable and w.length == n):
            return end
        k = w.length - end.start
        tree.version += 1
        if not tree.layout.segmented:
            return split(end, k)
        halves = prep.halves if prep.split_of is end.segment and prep.split_at == k else None
        if halves is None:  # another insert split this edge meanwhile
            halves = layers.cut_segment(end.segment, 0, k), layers.cut_segment(end.segment, k)
        head = split(end, k)
        head.segment, end.segment = halves
        head.segment_nbytes = self.measure(halves[0])
        end.segment_nbytes = self.measure(halves[1])
        return head

    def _attach_segment(
        self, tree: ModelTree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        if m * TOKEN == len(key):  # already on a stored path; only recency changes
            if parent.terminal and parent.depth == m:
                self._lru.touch(parent, tree)
            return True
        seg = prep.segment
        if m > prep.start:  # another insert stored part of it meanwhile
            seg = layers.cut_segment(seg, m - prep.start)
        need = self.measure(seg)
        extends = parent.terminal  # the stored sequence becomes a prefix of this one
        if extends:
            self._unmark(tree, parent)
        if not self._make_room(need, 0 if extends else 1):
            if extends:
                self._mark(tree, parent)
            return False
        child = add_child(parent, key[m * TOKEN :])
        tree.version += 1
        child.segment, child.segment_nbytes = seg, need
        self._add_bytes(tree, need)
        self._mark(tree, child)
        return True

    def _attach_checkpointed(
        self, tree: ModelTree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        """As `_attach_segment`, and the new end holds the checkpoint (an end already on
        the tree gets it, if it has none)."""
        if m * TOKEN == len(key):
            if parent.checkpoint is None:
                if not self._make_room(prep.checkpoint_nbytes, 0):
                    return False
                parent.checkpoint = prep.checkpoint
                parent.checkpoint_nbytes = prep.checkpoint_nbytes
                self._add_bytes(tree, prep.checkpoint_nbytes)
            parent.checkpoint_used = self._tick()
            if parent.terminal:
                self._lru.touch(parent, tree)
            return True
        seg = prep.segment
        if m > prep.start:  # another insert stored part of it meanwhile
            seg = layers.cut_segment(seg, m - prep.start)
        seg_nbytes = self.measure(seg)
        extends = parent.terminal
        # Still a sequence while room is made (pinned, it is not evicted): its checkpoint is
        # not one that goes first, and stays if the insert is refused.
        if not self._make_room(seg_nbytes + prep.checkpoint_nbytes, 0 if extends else 1):
            return False
        if extends:
            self._unmark(tree, parent)
        child = add_child(parent, key[m * TOKEN :])
        tree.version += 1
        child.segment, child.segment_nbytes = seg, seg_nbytes
        child.checkpoint, child.checkpoint_nbytes = prep.checkpoint, prep.checkpoint_nbytes
        child.checkpoint_used = self._tick()
        self._add_bytes(tree, seg_nbytes + prep.checkpoint_nbytes)
        self._mark(tree, child)
        return True

    def _attach_snapshot(
        self, tree: ModelTree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        ends_here = m * TOKEN == len(key)
        replaces = ends_here and parent.terminal
        old = parent.entry_nbytes if replaces else 0
        if not self._make_room(max(0, prep.entry_nbytes - old), 0 if replaces else 1):
            return False
        node = parent if ends_here else add_child(parent, key[m * TOKEN :])
        tree.version += 1
        node.entry, node.entry_nbytes = prep.entry, prep.entry_nbytes
        node.entry_trimmable = prep.entry_trimmable
        self._add_bytes(tree, prep.entry_nbytes - old)
        if replaces:
            self._lru.touch(node, tree)
        else:
            self._mark(tree, node)
        return True
