"""A radix tree (compressed trie) over token sequences.

The tree only indexes tokens; what a node carries (`segment`, `entry`) is
opaque to it and managed by `prompt_cache.manager`.

Invariants:
- Every node but the root has a non-empty edge (`tokens`). The children of a
  node start with distinct tokens and `children` is keyed by that first token.
- `depth` is the number of tokens from the root to the end of a node's edge.
- A walk compares whole runs of tokens (list slices, compared in C), so a
  lookup costs one dict probe per node plus a linear compare of the matched
  tokens, never a Python-level step per token.
- Nodes are never merged back after a split: merging would cost a copy of the
  payload, and an extra node on a path only costs one dict probe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Node:
    tokens: list[int]
    parent: Node | None = None
    depth: int = 0
    children: dict[int, Node] = field(default_factory=dict)
    segment: Any = None  # the KV state of this edge's tokens (prefix-sharing mode)
    segment_nbytes: int = 0
    entry: Any = None  # a whole-sequence snapshot ending here (snapshot mode)
    entry_nbytes: int = 0
    entry_trimmable: bool = False
    terminal: bool = False  # a cached sequence ends here
    pins: int = 0  # running fetches/inserts using this node; it is not removed while > 0

    @property
    def start(self) -> int:
        """Tokens from the root to the start of this node's edge."""
        return self.depth - len(self.tokens)


@dataclass
class Walk:
    """The result of walking a token sequence down the tree.

    `nodes` are the nodes entered, root excluded; the last one may be matched
    only partly (`length < nodes[-1].depth`).
    """

    nodes: list[Node]
    length: int

    @property
    def partial(self) -> bool:
        return bool(self.nodes) and self.length < self.nodes[-1].depth


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists, by bisecting slice compares."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def walk(root: Node, tokens: list[int]) -> Walk:
    nodes: list[Node] = []
    pos, node, n = 0, root, len(tokens)
    while pos < n:
        child = node.children.get(tokens[pos])
        if child is None:
            break
        edge = child.tokens
        run = tokens[pos : pos + len(edge)]
        nodes.append(child)
        if run == edge:
            pos += len(edge)
            node = child
            continue
        pos += common_prefix_length(edge, run)
        break
    return Walk(nodes, pos)


def add_child(parent: Node, tokens: list[int]) -> Node:
    if not tokens or tokens[0] in parent.children:
        raise ValueError("a child edge must be non-empty and start with a new token")
    child = Node(tokens=tokens, parent=parent, depth=parent.depth + len(tokens))
    parent.children[tokens[0]] = child
    return child


def split(node: Node, k: int) -> Node:
    """Cut `node`'s edge after `k` tokens; returns the new head, `node` keeps the tail.

    Payloads are left to the caller: the head starts with none.
    """
    if not 0 < k < len(node.tokens) or node.parent is None:
        raise ValueError(f"cannot split an edge of {len(node.tokens)} tokens at {k}")
    parent = node.parent
    head = Node(tokens=node.tokens[:k], parent=parent, depth=node.start + k)
    parent.children[head.tokens[0]] = head
    node.tokens = node.tokens[k:]
    node.parent = head
    head.children[node.tokens[0]] = node
    return head


def detach(node: Node) -> None:
    if node.parent is not None:
        del node.parent.children[node.tokens[0]]
        node.parent = None


def iter_nodes(root: Node) -> Iterator[Node]:
    """Every node below `root` (root excluded), parents before children."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def nearest(start: Node, accept: Callable[[Node], bool]) -> Node | None:
    """The shallowest node at or below `start` that `accept`s, or None."""
    level = [start]
    best: Node | None = None
    while level:
        for node in level:
            if accept(node) and (best is None or node.depth < best.depth):
                best = node
        nxt = [c for node in level for c in node.children.values()]
        if best is not None and all(c.depth >= best.depth for c in nxt):
            return best
        level = nxt
    return best
