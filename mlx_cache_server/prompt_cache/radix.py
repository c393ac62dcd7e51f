"""A radix tree (compressed trie) over token sequences.

The tree only indexes tokens; what a node carries (`held`) is opaque to it and
managed by its owner: a model's tree in the cache (`mlx_cache_server.prompt_cache.held`)
or the disk tier's (`mlx_cache_server.prompt_cache.disk_tree`).

Invariants:
- Every node but the root has a non-empty edge (`tokens`). The children of a
  node start with distinct tokens and `children` is keyed by that first token.
- `depth` is the number of tokens from the root to the end of a node's edge.
- Tokens are held packed, 4 bytes each (`pack`): a walk compares whole runs
  with memcmp, so a lookup costs one packing of the query, one dict probe per
  node and a linear compare, never a Python-level step per token.
- Nodes are never merged back after a split: merging would cost a copy of the
  payload, and an extra node on a path only costs one dict probe.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

TOKEN = 4  # bytes per packed token


@lru_cache(maxsize=512)
def _int32s(n: int) -> struct.Struct:
    # A compiled Struct per length: `Struct.pack(*tokens)` copies the list into
    # an argument tuple once, where `struct.pack(fmt, *tokens)` copies it twice
    # (a measurable share of a lookup: bench/cache_ops.py).
    return struct.Struct(f"<{n}i")


def pack(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int32s: what edges hold and walks compare."""
    try:
        return _int32s(len(tokens)).pack(*tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in int32 range: {e}") from None


def unpack(packed: bytes) -> list[int]:
    return list(_int32s(len(packed) // TOKEN).unpack(packed))


class PackedTokens(bytes):
    """A token sequence packed once, so a prompt looked up is stored without packing it again.

    The cache's `fetch`, `peek` and `insert` take one in place of a token list.
    Packing is all of an index operation's Python-level work,
    so a server that packs each prompt on arrival and stores prompt + reply as
    `prompt.extend(reply)` packs only the reply at insert. Plain `bytes` are not
    taken as packed: only this type says they are.
    """

    __slots__ = ()

    def __new__(cls, packed: bytes = b"") -> PackedTokens:
        if len(packed) % TOKEN:
            raise ValueError(f"packed tokens come in {TOKEN}-byte units, got {len(packed)} bytes")
        return super().__new__(cls, packed)

    @classmethod
    def of(cls, tokens: Sequence[int]) -> PackedTokens:
        return cls(pack(tokens))

    @property
    def n_tokens(self) -> int:
        return len(self) // TOKEN

    def extend(self, tokens: Sequence[int]) -> PackedTokens:
        """These tokens followed by `tokens`; only `tokens` are packed."""
        return PackedTokens(self + pack(tokens))

    def prefix(self, n: int) -> PackedTokens:
        """The first `n` tokens."""
        return PackedTokens(self[: n * TOKEN])

    def tolist(self) -> list[int]:
        return unpack(self)


@dataclass(eq=False)
class Node:
    edge: bytes  # this node's tokens, packed
    parent: Node | None = None
    depth: int = 0
    children: dict[bytes, Node] = field(default_factory=dict)  # keyed by first packed token
    held: Any = None  # what its tree's owner keeps for this edge (opaque here)
    used: int = 0  # when what it holds was last stored, used or resumed from (a clock)
    terminal: bool = False  # a cached sequence ends here
    pins: int = 0  # running fetches/inserts using this node; it is not removed while > 0
    hits: int = 0  # fetches that reused this edge (shown by `outline`)
    seen: float = 0.0  # wall-clock time its sequence was stored or its edge last reused

    @property
    def size(self) -> int:
        """Tokens on this node's edge."""
        return len(self.edge) // TOKEN

    @property
    def start(self) -> int:
        """Tokens from the root to the start of this node's edge."""
        return self.depth - self.size

    @property
    def tokens(self) -> list[int]:
        return unpack(self.edge)


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


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the common prefix of two sequences, by bisecting slice compares."""
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


def walk(root: Node, packed: bytes) -> Walk:
    """Walk packed tokens (see `pack`) down from `root`."""
    nodes: list[Node] = []
    pos, node, n = 0, root, len(packed)
    while pos < n:
        child = node.children.get(packed[pos : pos + TOKEN])
        if child is None:
            break
        edge = child.edge
        run = packed[pos : pos + len(edge)]
        nodes.append(child)
        if run == edge:
            pos += len(edge)
            node = child
            continue
        pos += common_prefix_length(edge, run) // TOKEN * TOKEN
        break
    return Walk(nodes, pos // TOKEN)


def add_child(parent: Node, edge: bytes) -> Node:
    if not edge or edge[:TOKEN] in parent.children:
        raise ValueError("a child edge must be non-empty and start with a new token")
    child = Node(edge=edge, parent=parent, depth=parent.depth + len(edge) // TOKEN)
    parent.children[edge[:TOKEN]] = child
    return child


def split(node: Node, k: int) -> Node:
    """Cut `node`'s edge after `k` tokens; returns the new head, `node` keeps the tail.

    Payloads are left to the caller: the head starts with none. Its use so far is the
    whole edge's: every fetch that reused the tail reused the head too.
    """
    if not 0 < k < node.size or node.parent is None:
        raise ValueError(f"cannot split an edge of {node.size} tokens at {k}")
    parent, cut = node.parent, k * TOKEN
    head = Node(edge=node.edge[:cut], parent=parent, depth=node.start + k, hits=node.hits,
                seen=node.seen)  # fmt: skip
    parent.children[head.edge[:TOKEN]] = head
    node.edge = node.edge[cut:]
    node.parent = head
    head.children[node.edge[:TOKEN]] = node
    return head


def detach(node: Node) -> None:
    if node.parent is not None:
        del node.parent.children[node.edge[:TOKEN]]
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


Tokens = Sequence[int] | PackedTokens
"""A token list (or tuple, numpy or mlx array), or tokens packed once (`PackedTokens`)."""


def packed_key(tokens: Tokens | Any) -> bytes:
    """Packed tokens from a list, tuple, numpy or mlx array, or as they come."""
    if isinstance(tokens, PackedTokens):
        return tokens
    return pack(tokens.tolist() if hasattr(tokens, "tolist") else tokens)
