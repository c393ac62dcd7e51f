"""A picture of a radix tree small enough to send to a page: its largest branches.

A tree can hold thousands of nodes; a page needs the few that say what the cache holds
(the system prompts many conversations share, the conversations hanging below them).
`outline` keeps the `max_nodes` nodes with the most bytes below them, taken from the
root down (a node is kept only with its parent), and says how many it left out.

Invariants: at most `max_nodes` branches; each branch's totals count its whole subtree,
shown or not; children come largest first, ties in token order, so the same tree
gives the same outline.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from .radix import Node, iter_nodes


@dataclass
class Branch:
    tokens: list[int]  # the first `preview` tokens of its edge
    tail: list[int]  # and the last `preview` after those (all of the rest of a short edge)
    size: int  # tokens on its edge
    depth: int  # tokens from the root to its edge's end
    bytes: int  # KV held by it and everything below it
    sequences: int  # cached sequences ending in it or below
    hits: int  # lookups that reused its edge
    last_used: float  # wall-clock seconds it or something below was last stored or reused
    children: list[Branch] = field(default_factory=list)
    hidden: int = 0  # nodes below it left out
    on_disk: bool = False  # the disk tier holds its whole path too
    path: bytes = field(default=b"", repr=False)  # its tokens from the root, packed


def branches_in(top: list[Branch]) -> list[Branch]:
    """Every branch of an outline, parents before children."""
    out, stack = [], list(top)
    while stack:
        branch = stack.pop()
        out.append(branch)
        stack.extend(branch.children)
    return out


def own_bytes(node: Node) -> int:
    return node.held.nbytes if node.held is not None else 0


def outline(root: Node, max_nodes: int = 100, preview: int = 24) -> tuple[list[Branch], int]:
    """The top branches of the tree under `root`, and how many nodes were left out."""
    totals: dict[int, tuple[int, int, float, int]] = {}  # id -> bytes, sequences, last, nodes
    for node in reversed(list(iter_nodes(root))):  # children before parents
        b, s, last, n = own_bytes(node), int(node.terminal), node.seen, 1
        for child in node.children.values():
            cb, cs, clast, cn = totals[id(child)]
            b, s, last, n = b + cb, s + cs, max(last, clast), n + cn
        totals[id(node)] = (b, s, last, n)

    def order(node: Node) -> tuple[int, bytes]:
        return (-totals[id(node)][0], node.edge)

    top: list[Branch] = []
    made: dict[int, Branch] = {}
    tie = iter(range(1 << 62))  # equal keys in two branches: the one met first, never a Node
    frontier = [(order(c), next(tie), c) for c in root.children.values()]
    heapq.heapify(frontier)
    parent_of: dict[int, list[Branch]] = {id(c): top for c in root.children.values()}
    while frontier and len(made) < max_nodes:
        *_, node = heapq.heappop(frontier)
        b, s, last, _ = totals[id(node)]
        above = made.get(id(node.parent)) if node.parent is not None else None
        path = (above.path if above is not None else b"") + node.edge
        edge = node.tokens
        branch = Branch(edge[:preview], edge[max(preview, len(edge) - preview) :], node.size,
                        node.depth, b, s, node.hits, last, path=path)  # fmt: skip
        made[id(node)] = branch
        parent_of.pop(id(node)).append(branch)
        for child in node.children.values():
            parent_of[id(child)] = branch.children
            heapq.heappush(frontier, (order(child), next(tie), child))
    hidden = 0
    for *_, node in frontier:  # each left-out subtree, counted on the branch above it
        n = totals[id(node)][3]
        hidden += n
        if node.parent is not None and id(node.parent) in made:
            made[id(node.parent)].hidden += n
    for branch in made.values():
        branch.children.sort(key=lambda c: (-c.bytes, c.tokens))
    top.sort(key=lambda c: (-c.bytes, c.tokens))
    return top, hidden


Outline = tuple[list[Branch], int]


def mark_on_disk(shown: dict[Hashable, Outline], disk: Any) -> None:
    """Mark each branch of each model key's outline whose whole path the disk tier (a
    `DiskTier`) holds too. Each lookup takes the tier's lock: call it with the cache's
    lock free, as `PromptCache.outline` does."""
    for key, (top, _) in shown.items():
        for branch in branches_in(top):
            branch.on_disk = disk.match(key, branch.path) >= branch.depth
