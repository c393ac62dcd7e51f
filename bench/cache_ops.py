"""Cache operations, ours (prompt_cache) against mlx-lm's LRUPromptCache, on the same work.

N conversations share one long system prompt and each adds its own tail; both
caches get the same real mlx-lm KVCache objects. Timed per operation, medians:
  insert  - store one conversation's cache
  lookup  - find the best match for the next turn, no KV copied (peer: what
            fetch_nearest_cache does before it copies, PromptTrie.search then
            .get of the entry it picked; ours: PromptCache.peek)
  search  - the peer's PromptTrie.search alone, against the same peek
  index insert - the index alone, no KV: the peer's PromptTrie.add against our
            radix tree (pack, walk, split an edge if needed, add a node)
  fetch   - lookup plus building the cache the caller owns (forced with mx.eval)
Bytes held: each cache's own count, and the MLX memory actually held once the
caller's arrays are gone.

    python bench/cache_ops.py            # 1k x 1000, 8k x 300, 32k x 100
    python bench/cache_ops.py --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, PromptTrie
from mlx_lm.models.cache import LRUPromptCache as PeerCache

from prompt_cache import PromptCache
from prompt_cache.radix import TOKEN, Node, add_child, pack, split, walk

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 2, 2, 32, mx.float16
TAIL = 512  # tokens of each conversation's own
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2


def make_cache(shared: list[mx.array], n_shared: int, total: int, seed: int) -> list[KVCache]:
    mx.random.seed(seed)
    out = []
    for layer in range(LAYERS):
        tail = mx.random.normal((1, KV_HEADS, total - n_shared, HEAD_DIM)).astype(DTYPE)
        c = KVCache()
        c.keys = mx.concatenate([shared[layer][..., :n_shared, :], tail], axis=2)
        c.values = mx.concatenate([shared[layer][..., :n_shared, :], -tail], axis=2)
        c.offset = total
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def tokens_of(i: int, n_shared: int, total: int) -> list[int]:
    return [t % 50000 for t in range(n_shared)] + [
        50000 + (i * 7919 + t) % 40000 for t in range(total - n_shared)
    ]


def timed(fn, *args):
    t = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, result


def run_one(kind: str, length: int, n_convs: int, shared: list[mx.array]) -> dict:
    n_shared = length - TAIL
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    if kind == "ours":
        cache = PromptCache(max_sequences=n_convs + 1)
        insert, nbytes = cache.insert, lambda: cache.nbytes
        lookup = search = cache.peek

        def fetch(model, toks):
            got = cache.fetch(model, toks)
            mx.eval([(c.keys, c.values) for c in got.cache])
            return got.n_cached
    else:
        cache = PeerCache(max_size=n_convs + 1)
        insert, nbytes = cache.insert_cache, lambda: cache.nbytes

        def search(model, toks):
            return cache._trie.search(model, toks)

        def lookup(model, toks):
            found = cache._trie.search(model, toks)
            best = found.exact or found.longer or found.shorter
            return cache._trie.get(model, best)

        def fetch(model, toks):
            got, rest = cache.fetch_nearest_cache(model, toks)
            mx.eval([(c.keys, c.values) for c in got])
            return len(toks) - len(rest)

    t_insert, t_lookup, t_search, t_fetch = [], [], [], []
    for i in range(n_convs):
        toks = tokens_of(i, n_shared, length)
        kv = make_cache(shared, n_shared, length, seed=i)
        t_insert.append(timed(insert, "m", toks, kv)[0])
        del kv
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - base
    reused = []
    for i in range(0, n_convs, max(1, n_convs // 50)):
        nxt = tokens_of(i, n_shared, length) + [99999] * 64  # the next turn
        # Index-only operations are short: best of 5 per query, on both sides.
        t_lookup.append(min(timed(lookup, "m", nxt)[0] for _ in range(5)))
        t_search.append(min(timed(search, "m", nxt)[0] for _ in range(5)))
        dt, n = timed(fetch, "m", nxt)
        t_fetch.append(dt)
        reused.append(n)
    assert all(n == length for n in reused), (kind, set(reused))
    return {
        "insert_ms": statistics.median(t_insert) * 1e3,
        "lookup_ms": statistics.median(t_lookup) * 1e3,
        "search_ms": statistics.median(t_search) * 1e3,
        "fetch_ms": statistics.median(t_fetch) * 1e3,
        "bytes_counted": nbytes(),
        "bytes_held": held,
    }


def index_insert(kind: str, length: int, n_convs: int) -> float:
    """Median ms to add one conversation's tokens to an index holding the earlier ones."""
    n_shared = length - TAIL
    times = []
    if kind == "peer":
        trie = PromptTrie()
        for i in range(n_convs):
            times.append(timed(trie.add, "m", tokens_of(i, n_shared, length), None)[0])
    else:
        root = Node(edge=b"")

        def add(tokens: list[int]) -> None:
            key = pack(tokens)
            w = walk(root, key)
            parent = w.nodes[-1] if w.nodes else root
            if w.partial:
                parent = split(parent, w.length - parent.start)
            add_child(parent, key[w.length * TOKEN :])

        for i in range(n_convs):
            times.append(timed(add, tokens_of(i, n_shared, length))[0])
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "cache_ops.json"
    )
    args = ap.parse_args()
    configs = [(1024, 100), (8192, 30)] if args.quick else [(1024, 1000), (8192, 300), (32768, 100)]
    mx.random.seed(0)
    shared = [mx.random.normal((1, KV_HEADS, 32768, HEAD_DIM)).astype(DTYPE) for _ in range(LAYERS)]
    mx.eval(shared)
    rows = []
    print(
        f"KV shape: {LAYERS} layers x {KV_HEADS} heads x {HEAD_DIM} dims, float16 "
        f"({BYTES_PER_TOKEN} B/token); each conversation = shared prompt + {TAIL} own tokens"
    )
    header = f"{'tokens':>6} {'convs':>5} {'op':<14} {'ours':>12} {'peer':>12} {'peer/ours':>10}"
    print(header)
    for length, n in configs:
        ours = run_one("ours", length, n, shared)
        peer = run_one("peer", length, n, shared)
        ours["index_insert_ms"] = index_insert("ours", length, n)
        peer["index_insert_ms"] = index_insert("peer", length, n)
        rows.append({"tokens": length, "conversations": n, "ours": ours, "peer": peer})
        for key in (
            "lookup_ms",
            "search_ms",
            "insert_ms",
            "index_insert_ms",
            "fetch_ms",
            "bytes_counted",
            "bytes_held",
        ):
            o, p = ours[key], peer[key]
            fmt = "{:12.3f}" if key.endswith("ms") else "{:12,d}"
            ratio = p / o if o else float("inf")
            print(f"{length:>6} {n:>5} {key:<14} {fmt.format(o)} {fmt.format(p)} {ratio:>9.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
