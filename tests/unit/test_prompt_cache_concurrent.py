"""The cache's accounting when operations interleave, as the engine thread and admin flushes do.

An insert and a fetch each release the lock while they copy KV. The state
machine below runs another operation (an insert, a fetch, a trim, a clear of
either model) inside that window, then checks what every interleaving must
keep: every byte and sequence counted belongs to a tree a fetch can reach, the
budget holds, nothing stays pinned, and a clear leaves nothing behind.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlx_cache_server.prompt_cache import PromptCache, layers, planning
from mlx_cache_server.prompt_cache.radix import iter_nodes
from tests.fakes import BYTES_PER_TOKEN, kv_cache, same_state

MODELS = ["a", "b"]
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=12)
# What runs while an insert or fetch is between its two locked sections.
racer_st = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(MODELS), tokens_st),
    st.tuples(st.just("fetch"), st.sampled_from(MODELS), tokens_st),
    st.tuples(st.just("clear"), st.sampled_from([*MODELS, None]), st.just(None)),
    st.tuples(st.just("trim"), st.integers(0, 3), st.just(None)),
)


def run(cache: PromptCache, racer: tuple) -> None:
    op, arg, tokens = racer
    if op == "insert":
        cache.insert(arg, tokens, kv_cache(tokens))
    elif op == "fetch":
        cache.fetch(arg, tokens)
    elif op == "clear":
        cache.clear(arg)
    else:
        cache.trim_to(n_sequences=arg)


def reachable(cache: PromptCache) -> tuple[int, int, set[int]]:
    """Bytes, sequences and node ids in the trees a fetch can reach."""
    nbytes, sequences, ids = 0, 0, set()
    for model in cache.models():
        for node in iter_nodes(cache._trees[model].root):
            nbytes += node.held.nbytes if node.held is not None else 0
            sequences += node.terminal
            ids.add(id(node))
    return nbytes, sequences, ids


def assert_consistent(cache: PromptCache) -> None:
    nbytes, sequences, ids = reachable(cache)
    assert cache.nbytes == nbytes <= cache.max_bytes
    assert len(cache) == sequences <= cache.max_sequences
    assert {id(node) for node in cache._lru._order} <= ids  # no sequence outside a tree
    assert cache.stats().bytes == cache.nbytes
    for model in cache.models():
        assert all(n.pins == 0 for n in iter_nodes(cache._trees[model].root))


class InterleavedOperations(RuleBasedStateMachine):
    @rule(max_sequences=st.integers(1, 6), max_tokens=st.integers(4, 40))
    @precondition(lambda self: not hasattr(self, "cache"))
    def start(self, max_sequences, max_tokens):
        self.cache = PromptCache(max_sequences, max_tokens * BYTES_PER_TOKEN)

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from(MODELS), tokens=tokens_st)
    def insert(self, model, tokens):
        self.cache.insert(model, tokens, kv_cache(tokens))

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from(MODELS), tokens=tokens_st, racer=racer_st)
    def insert_racing(self, model, tokens, racer):
        original = planning.prepare_insert

        def prepare_while_another_runs(*args):
            planning.prepare_insert = original  # the racer's own insert runs unraced
            run(self.cache, racer)
            return original(*args)

        planning.prepare_insert = prepare_while_another_runs
        try:
            self.cache.insert(model, tokens, kv_cache(tokens))
        finally:
            planning.prepare_insert = original
        if racer[0] == "clear" and racer[1] in (model, None):
            # The flush came after this insert began: nothing of it may survive the flush
            # unnoticed, so it either stored nothing or stored it where a fetch finds it.
            found = self.cache.fetch(model, tokens + [9])
            assert found.n_cached in (0, len(tokens))

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from(MODELS), tokens=tokens_st, racer=racer_st)
    def fetch_racing(self, model, tokens, racer):
        original = layers.assemble

        def assemble_while_another_runs(layout, pieces):
            layers.assemble = original
            run(self.cache, racer)
            return original(layout, pieces)

        layers.assemble = assemble_while_another_runs
        try:
            found = self.cache.fetch(model, tokens)
        finally:
            layers.assemble = original
        if found.n_cached:  # what a fetch hands out is right even if its source went meanwhile
            assert same_state(found.cache, kv_cache(tokens[: found.n_cached]))

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(model=st.sampled_from([*MODELS, None]))
    def clear(self, model):
        self.cache.clear(model)
        for m in MODELS if model is None else [model]:
            assert m not in self.cache.models()

    @invariant()
    def counted_means_reachable(self):
        if hasattr(self, "cache"):
            assert_consistent(self.cache)


InterleavedOperations.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestInterleavedOperations = InterleavedOperations.TestCase
