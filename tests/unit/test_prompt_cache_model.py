"""The cache against a naive reference: a plain LRU-ordered list of sequences.

The reference holds what the cache's rules say in the simplest terms: bytes
are the distinct tokens over all stored sequences (prefixes shared once), a
sequence that extends a stored one replaces it, eviction drops the oldest, or,
when only bytes are short, cuts what is needed off the end it shares with no other.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_cache_server.prompt_cache import PromptCache
from mlx_cache_server.prompt_cache.radix import iter_nodes
from tests.fakes import BYTES_PER_TOKEN, kv_cache, same_state

MODELS = ["a", "b"]
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def distinct_tokens(seqs):
    return len({tuple(s[:i]) for s in seqs for i in range(1, len(s) + 1)})


class Reference:
    def __init__(self, max_sequences, max_bytes):
        self.max_sequences, self.max_bytes = max_sequences, max_bytes
        self.order = []  # (model, tuple(tokens)), oldest first

    def stored(self, model):
        return [list(s) for m, s in self.order if m == model]

    def nbytes(self, extra=()):
        total = 0
        for model in MODELS:
            seqs = self.stored(model) + [list(s) for m, s in extra if m == model]
            total += distinct_tokens(seqs) * BYTES_PER_TOKEN
        return total

    def touch(self, key):
        self.order.remove(key)
        self.order.append(key)

    def fetch(self, model, tokens):
        stored = self.stored(model)
        m = max((lcp(tokens, s) for s in stored), default=0)
        n = min(m, len(tokens) - 1)
        if n <= 0:
            return "miss", 0
        at_m = [s for s in stored if lcp(tokens, s) == m]
        if len(at_m) == 1:
            (s,) = at_m
            branch = max((lcp(s, o) for o in stored if o != s), default=0)
            if m > branch:  # the match reaches into this sequence's own tokens
                self.touch((model, tuple(s)))
        if tokens[:m] in stored:
            return ("exact" if m == len(tokens) else "shorter"), n
        return "longer", n

    def insert(self, model, tokens):
        stored = self.stored(model)
        key = (model, tuple(tokens))
        m = max((lcp(tokens, s) for s in stored), default=0)
        if m == len(tokens):
            if tokens in stored:
                self.touch(key)
            return True
        need = (len(tokens) - m) * BYTES_PER_TOKEN
        prefix = (model, tuple(tokens[:m]))
        extends = prefix in self.order
        if extends:
            self.order.remove(prefix)
        pinned = [prefix] if m else []  # the branch point stays while we make room
        new_seq = 0 if extends else 1
        if need > self.max_bytes or new_seq > self.max_sequences:
            ok = False
        else:
            ok = True
            while True:
                excess = self.nbytes(pinned) + need - self.max_bytes
                if len(self.order) + new_seq > self.max_sequences:
                    excess = 0
                elif excess <= 0:
                    break
                if not self.order:
                    ok = False
                    break
                self.evict_oldest(excess, pinned)
        if not ok:
            if extends:
                self.order.append(prefix)
            return False
        self.order.append(key)
        return True

    def evict_oldest(self, excess, pinned):
        """Cut `excess` bytes off the end the oldest sequence shares with none, or drop it."""
        model, s = self.order[0]
        if excess > 0:
            others = [o for m, o in self.order[1:] + pinned if m == model]
            owned = len(s) - max((lcp(list(s), list(o)) for o in others), default=0)
            cut = -(-excess // BYTES_PER_TOKEN)
            if cut < owned:
                self.order[0] = (model, s[: len(s) - cut])
                return
        self.order.pop(0)


class CacheMatchesReference(RuleBasedStateMachine):
    @rule(
        max_sequences=st.integers(1, 6),
        max_tokens=st.integers(4, 40),
    )
    @precondition(lambda self: not hasattr(self, "cache"))
    def start(self, max_sequences, max_tokens):
        self.cache = PromptCache(max_sequences, max_tokens * BYTES_PER_TOKEN)
        # Cutting into a node has its own cost rule, which depends on node shapes: tested apart.
        self.cache._budget.shorten_copy = 10**9
        self.ref = Reference(max_sequences, max_tokens * BYTES_PER_TOKEN)

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from(MODELS), tokens=tokens_st, spare=st.integers(0, 3))
    def insert(self, model, tokens, spare):
        assert self.cache.insert(model, tokens, kv_cache(tokens, spare)) == self.ref.insert(
            model, tokens
        )

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from(MODELS), tokens=tokens_st)
    def fetch(self, model, tokens):
        got = self.cache.fetch(model, tokens)
        kind, n = self.ref.fetch(model, tokens)
        assert (got.kind, got.n_cached) == (kind, n)
        if n:
            assert same_state(got.cache, kv_cache(tokens[:n]))
        else:
            assert got.cache is None

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(n=st.integers(0, 6))
    def trim_sequences(self, n):
        self.cache.trim_to(n_sequences=n)
        del self.ref.order[: max(0, len(self.ref.order) - n)]

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from(MODELS))
    def clear(self, model):
        self.cache.clear(model)
        self.ref.order = [(m, s) for m, s in self.ref.order if m != model]

    @invariant()
    def same_sequences_bytes_and_lru_order(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.nbytes == self.ref.nbytes() <= self.ref.max_bytes
        assert len(self.cache) == len(self.ref.order) <= self.ref.max_sequences
        assert lru_order(self.cache) == self.ref.order
        assert self.cache.stats().bytes == self.cache.nbytes
        for model in self.cache.models():
            root = self.cache._trees[model].root
            nodes = list(iter_nodes(root))
            assert sum(n.held.segment_nbytes for n in nodes) == self.cache.stats(model).bytes
            assert all(n.pins == 0 for n in nodes)
            assert all(n.children or n.terminal for n in nodes)  # nothing left dangling


def path_tokens(node):
    out = []
    while node.parent is not None:
        out = node.tokens + out
        node = node.parent
    return tuple(out)


def lru_order(cache):
    model_of = {id(tree): m for m, tree in cache._trees.items()}
    return [(model_of[id(tree)], path_tokens(node)) for node, tree in cache._lru._order.items()]


CacheMatchesReference.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestCacheMatchesReference = CacheMatchesReference.TestCase
