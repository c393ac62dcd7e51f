"""The cache's outline for the page: bounded, totals that add up, the same order each time."""

from __future__ import annotations

import random

from mlx_cache_server.prompt_cache import PromptCache
from mlx_cache_server.prompt_cache.outline import branches_in, outline
from mlx_cache_server.prompt_cache.radix import iter_nodes
from tests.fakes import BYTES_PER_TOKEN, kv_cache

SYSTEM = list(range(100, 140))


def test_conversations_sharing_a_system_prompt_hang_below_it():
    cache = PromptCache(max_sequences=10, max_bytes=10_000 * BYTES_PER_TOKEN)
    for user in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        cache.insert("m", SYSTEM + user, kv_cache(SYSTEM + user))
    cache.fetch("m", SYSTEM + [4, 5, 11])
    [(key, (top, hidden))] = cache.outline().items()
    assert key == "m" and hidden == 0
    [shared] = top
    assert (
        shared.tokens == SYSTEM[:24]
        and shared.tail == SYSTEM[24:]
        and shared.size == shared.depth == len(SYSTEM)
    )
    assert shared.sequences == 3 and shared.bytes == cache.nbytes
    assert shared.hits == 1 and shared.last_used > 0
    assert [c.tokens for c in shared.children] == [[6, 7, 8, 9], [1, 2, 3], [4, 5]]
    assert [c.hits for c in shared.children] == [0, 0, 1]
    assert [c.bytes for c in shared.children] == [4 * BYTES_PER_TOKEN, 3 * BYTES_PER_TOKEN,
                                                  2 * BYTES_PER_TOKEN]  # fmt: skip


def test_a_large_tree_gives_a_bounded_outline_in_a_stable_order():
    cache = PromptCache(max_sequences=3000, max_bytes=1 << 40)
    rng = random.Random(3)
    for _ in range(2000):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 14))]
        cache.insert("m", tokens, kv_cache(tokens))
    root = cache._trees["m"].root
    nodes = len(list(iter_nodes(root)))
    assert nodes > 1000
    top, hidden = outline(root, max_nodes=60)
    shown = branches_in(top)
    assert len(shown) == 60 and hidden == nodes - 60
    assert sum(b.bytes for b in top) == cache.nbytes
    assert sum(b.sequences for b in top) == len(cache)
    for branch in shown:  # the largest first; what is left out is counted where it hangs
        assert [c.bytes for c in branch.children] == sorted((c.bytes for c in branch.children),
                                                            reverse=True)  # fmt: skip
    # Left out: nodes below shown branches, counted on them, and whole subtrees under the root.
    shown_first = {tuple(b.tokens[:1]) for b in top}
    under_root = sum(1 + len(list(iter_nodes(c))) for c in root.children.values()
                     if tuple(c.tokens[:1]) not in shown_first)  # fmt: skip
    assert sum(b.hidden for b in shown) + under_root == hidden


def test_two_caches_built_alike_give_the_same_outline():
    """Not an accident of object ids or set order: built again, the tree outlines alike,
    ties between branches of equal bytes included."""
    rng = random.Random(5)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(2, 10))] for _ in range(300)]
    outlines = []
    for order in (sequences, list(sequences)):
        cache = PromptCache(max_sequences=1000, max_bytes=1 << 40)
        for tokens in order:
            cache.insert("m", tokens, kv_cache(tokens))
        top, hidden = outline(cache._trees["m"].root, max_nodes=40)
        shown = [(b.tokens, b.tail, b.size, b.depth, b.bytes, b.sequences, b.hidden)
                 for b in branches_in(top)]  # fmt: skip
        outlines.append((shown, hidden))
    assert outlines[0] == outlines[1]


def test_a_branch_the_disk_tier_holds_too_says_so(tmp_path):
    from mlx_cache_server.prompt_cache import DiskTier

    cache = PromptCache(64, 1 << 30, disk=DiskTier(tmp_path, "fp", 1 << 30))
    try:
        cache.insert("m", SYSTEM + [1, 2], kv_cache(SYSTEM + [1, 2]))
        cache.disk.flush()
        [(written, _)] = cache.outline().values()
        cache.disk.clear()
        [(cleared, _)] = cache.outline().values()
    finally:
        cache.disk.close()
    assert [b.on_disk for b in branches_in(written)] == [True]
    assert [b.on_disk for b in branches_in(cleared)] == [False]
