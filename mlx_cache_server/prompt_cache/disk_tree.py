"""The disk tier's radix tree: which tokens of each path its files hold, and the gaps
that files lost leave behind.

A node lies in one file (`node.held`, the disk tier's `DiskFile`) or in none:
a gap. A gap stands for the tokens of a file that was lost (missing, truncated,
corrupt) while files below it survived: their rows record every token of their
paths, so the gap's tokens are known, only their KV is not. The KV below a gap is
still right for those tokens; it becomes usable again once a write covers the gap,
which the next request through it makes (its prompt is prefilled and stored).

Invariants:
- A path is held from the root to its first gap (`held`); nothing past a gap is
  served, and a write starts where its path stops being held.
- Every gap has children: a gap left without any is removed (`prune`).
- A file's tokens [start, end) are covered by its nodes; a node is never in two files.
"""

from __future__ import annotations

from typing import Any

from .radix import TOKEN, Node, Walk, add_child, detach, split, walk


def held(w: Walk) -> int:
    """How many tokens of a walk the files hold: up to its first gap."""
    for node in w.nodes:
        if node.held is None:
            return node.start
    return w.length


def first_gap(w: Walk) -> Node | None:
    return next((node for node in w.nodes if node.held is None), None)


def attach(root: Node, f: Any, key: bytes, gap_ok: bool = False) -> Node | None:
    """Hang file `f`'s tokens [f.start, f.end) of `key`'s path in the tree, filling
    the gaps it covers; its last node, or None where it cannot be hung: a file
    already holds some of those tokens, or the tree does not hold the path up to
    f.start (unless `gap_ok`: then the missing part becomes a gap)."""
    w = walk(root, key[: f.end * TOKEN])
    if any(n.held is not None and min(n.depth, w.length) > f.start for n in w.nodes):
        return None  # overlaps a file
    if not gap_ok and (w.length < f.start or held(w) < f.start):
        return None
    nodes = list(w.nodes)
    if w.partial:  # the walk stops inside an edge: cut it there
        end = nodes[-1]
        head = split(end, w.length - end.start)
        head.held = end.held
        if end.held is not None:
            end.held.nodes.append(head)
        nodes[-1] = head
    parent = nodes[-1] if nodes else root
    if w.length < f.start:
        parent = add_child(parent, key[w.length * TOKEN : f.start * TOKEN])  # a gap
    for node in nodes:
        if node.start < f.start < node.depth:  # a gap across f's start: f fills its tail
            split(node, f.start - node.start)
        if node.start >= f.start:
            node.held = f
            f.nodes.append(node)
    if w.length < f.end:
        parent = add_child(parent, key[max(w.length, f.start) * TOKEN : f.end * TOKEN])
        parent.held = f
        f.nodes.append(parent)
    return parent


def prune(node: Node | None) -> None:
    """Remove `node` and the ancestors above it that are gaps left without children."""
    while node is not None and node.parent is not None and node.held is None:
        if node.children:
            return
        parent = node.parent
        detach(node)
        node = parent
