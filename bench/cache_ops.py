"""Cache operations, ours (prompt_cache) against mlx-lm's LRUPromptCache, on the same work.

N conversations share one long system prompt and each adds its own tail; both
caches get the same real mlx-lm KVCache objects. Each operation runs on both caches
back to back, in alternating order, so both see the same machine state (this
machine's speed drifts by a third between runs). Medians of:
  insert  - store one conversation's cache
  lookup  - find the best match for the next turn, no KV copied (peer: what
            fetch_nearest_cache does before it copies, PromptTrie.search then
            .get of the entry it picked; ours: PromptCache.peek)
  search  - the peer's PromptTrie.search alone, against the same peek
  index insert - the index alone, no KV: the peer's PromptTrie.add against our
            radix tree (pack, walk, split an edge if needed, add a node)
  ... packed - the same two, ours given the prompt packed at its lookup
            (PackedTokens, as the server does) so that only the reply's
            REPLY tokens are packed; the peer has only the token list. Every
            other conversation is stored this way, the rest from the list.
  lookup + index insert (packed) - what one turn costs the index, summed
  fetch   - lookup plus building the cache the caller owns (forced with mx.eval)
Bytes held: each cache's own count, and the MLX memory actually held once the
caller's arrays are gone.

    python bench/cache_ops.py            # 1k x 1000, 8k x 300, 32k x 100
    python bench/cache_ops.py --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import mlx.core as mx
from envelope import write_result
from mlx_lm.models.cache import KVCache, PromptTrie
from mlx_lm.models.cache import LRUPromptCache as PeerCache

from mlx_cache_server.prompt_cache import PackedTokens, PromptCache
from mlx_cache_server.prompt_cache.radix import TOKEN, Node, add_child, pack, split, walk

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 2, 2, 32, mx.float16
TAIL = 512  # tokens of each conversation's own
REPLY = 64  # of which the last reply
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


class Ours:
    def __init__(self, n_convs: int) -> None:
        self.cache = PromptCache(max_sequences=n_convs + 1)
        self.root = Node(edge=b"")

    def insert(self, toks: list[int], kv: list[KVCache]) -> None:
        self.cache.insert("m", toks, kv)

    def insert_packed(self, toks: list[int], prompt: PackedTokens, kv: list[KVCache]) -> None:
        self.cache.insert("m", prompt.extend(toks[-REPLY:]), kv)

    def lookup(self, toks: list[int]) -> object:
        return self.cache.peek("m", toks)

    search = lookup  # peek is the search: no KV is touched

    def fetch(self, toks: list[int]) -> int:
        got = self.cache.fetch("m", toks)
        mx.eval([(c.keys, c.values) for c in got.cache])
        return got.n_cached

    def index_add(self, toks: list[int]) -> None:
        self._index_add(pack(toks))

    def index_add_packed(self, toks: list[int], prompt: PackedTokens) -> None:
        self._index_add(prompt.extend(toks[-REPLY:]))

    def _index_add(self, key: bytes) -> None:
        w = walk(self.root, key)
        parent = w.nodes[-1] if w.nodes else self.root
        if w.partial:
            parent = split(parent, w.length - parent.start)
        add_child(parent, key[w.length * TOKEN :])

    def nbytes(self) -> int:
        return self.cache.nbytes


class Peer:
    def __init__(self, n_convs: int) -> None:
        self.cache = PeerCache(max_size=n_convs + 1)
        self.trie = PromptTrie()

    def insert(self, toks: list[int], kv: list[KVCache]) -> None:
        self.cache.insert_cache("m", toks, kv)

    def insert_packed(self, toks: list[int], prompt: PackedTokens, kv: list[KVCache]) -> None:
        self.insert(toks, kv)  # the peer has nothing else to take

    def lookup(self, toks: list[int]) -> object:
        found = self.cache._trie.search("m", toks)
        best = found.exact or found.longer or found.shorter
        return self.cache._trie.get("m", best)

    def search(self, toks: list[int]) -> object:
        return self.cache._trie.search("m", toks)

    def fetch(self, toks: list[int]) -> int:
        got, rest = self.cache.fetch_nearest_cache("m", toks)
        mx.eval([(c.keys, c.values) for c in got])
        return len(toks) - len(rest)

    def index_add(self, toks: list[int]) -> None:
        self.trie.add("m", toks, None)

    def index_add_packed(self, toks: list[int], prompt: PackedTokens) -> None:
        self.index_add(toks)

    def nbytes(self) -> int:
        return self.cache.nbytes


def paired(sides: dict[str, Ours | Peer], op: str, args: tuple, i: int, best_of: int = 1) -> dict:
    """Time `op` on both sides back to back, in alternating order: the same machine state."""
    order = list(sides) if i % 2 == 0 else list(reversed(sides))
    out = {}
    for kind in order:
        fn = getattr(sides[kind], op)
        out[kind] = min((timed(fn, *args) for _ in range(best_of)), key=lambda t: t[0])
    return out


def run_pair(length: int, n_convs: int, shared: list[mx.array]) -> dict:
    n_shared = length - TAIL
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    sides = {"ours": Ours(n_convs), "peer": Peer(n_convs)}
    times: dict[str, dict[str, list[float]]] = {k: {} for k in sides}

    def record(op: str, got: dict) -> dict:
        for kind, (dt, _) in got.items():
            times[kind].setdefault(op, []).append(dt)
        return {kind: result for kind, (_, result) in got.items()}

    for i in range(n_convs):
        toks = tokens_of(i, n_shared, length)
        kv = make_cache(shared, n_shared, length, seed=i)
        if i % 2 == 0:
            record("insert_ms", paired(sides, "insert", (toks, kv), i))
            record("index_insert_ms", paired(sides, "index_add", (toks,), i))
        else:
            prompt = PackedTokens.of(toks[:-REPLY])  # what its lookup packed
            record("insert_packed_ms", paired(sides, "insert_packed", (toks, prompt, kv), i))
            record("index_insert_packed_ms", paired(sides, "index_add_packed", (toks, prompt), i))
        del kv
    for i in range(0, n_convs, max(1, n_convs // 50)):
        nxt = tokens_of(i, n_shared, length) + [99999] * 64  # the next turn
        # Index-only operations are short: best of 5 per query, on both sides.
        record("lookup_ms", paired(sides, "lookup", (nxt,), i, best_of=5))
        record("search_ms", paired(sides, "search", (nxt,), i, best_of=5))
        reused = record("fetch_ms", paired(sides, "fetch", (nxt,), i))
        assert all(n == length for n in reused.values()), reused
    out: dict[str, dict] = {
        kind: {op: statistics.median(ts) * 1e3 for op, ts in ops.items()}
        for kind, ops in times.items()
    }
    for kind in out:
        out[kind]["turn_index_ms"] = out[kind]["lookup_ms"] + out[kind]["index_insert_packed_ms"]
        out[kind]["bytes_counted"] = sides[kind].nbytes()
    # What each holds: MLX memory that goes when its cache goes (the caller's
    # arrays are gone; the peer keeps references to them, ours its own copies).
    gc.collect()
    mx.clear_cache()
    total = mx.get_active_memory() - base
    del sides["peer"]
    gc.collect()
    mx.clear_cache()
    out["ours"]["bytes_held"] = mx.get_active_memory() - base
    out["peer"]["bytes_held"] = total - out["ours"]["bytes_held"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("cache_ops.json"), help="a file name")
    args = ap.parse_args()
    started = time.time()
    configs = [(1024, 100), (8192, 30)] if args.quick else [(1024, 1000), (8192, 300), (32768, 100)]
    mx.random.seed(0)
    shared = [mx.random.normal((1, KV_HEADS, 32768, HEAD_DIM)).astype(DTYPE) for _ in range(LAYERS)]
    mx.eval(shared)
    rows = []
    print(
        f"KV shape: {LAYERS} layers x {KV_HEADS} heads x {HEAD_DIM} dims, float16 "
        f"({BYTES_PER_TOKEN} B/token); each conversation = shared prompt + {TAIL} own tokens"
    )
    header = f"{'tokens':>6} {'convs':>5} {'op':<22} {'ours':>12} {'peer':>12} {'peer/ours':>10}"
    print(header)
    for length, n in configs:
        got = run_pair(length, n, shared)
        ours, peer = got["ours"], got["peer"]
        rows.append({"tokens": length, "conversations": n, "ours": ours, "peer": peer})
        for key in (
            "lookup_ms",
            "search_ms",
            "insert_ms",
            "insert_packed_ms",
            "index_insert_ms",
            "index_insert_packed_ms",
            "turn_index_ms",
            "fetch_ms",
            "bytes_counted",
            "bytes_held",
        ):
            o, p = ours[key], peer[key]
            fmt = "{:12.3f}" if key.endswith("ms") else "{:12,d}"
            ratio = p / o if o else float("inf")
            print(f"{length:>6} {n:>5} {key:<22} {fmt.format(o)} {fmt.format(p)} {ratio:>9.1f}x")
    write_result(args.out.name, args, started, rows)


if __name__ == "__main__":
    main()
