"""The cache for hybrid models: attention layers and sliding windows stored by token,
recurrent state checkpointed; against the state a fresh prefill reaches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from mlx_cache_server.prompt_cache import PromptCache
from mlx_cache_server.prompt_cache.layers import layout_of
from mlx_cache_server.prompt_cache.radix import iter_nodes
from tests.fakes import kv_cache

WINDOW = 4


def hybrid_cache(tokens: list[int], chunk: int = 3, state: bool = True) -> list:
    """[attention, sliding window, recurrent state] (no state: as gemma3 and gpt-oss), fed
    `tokens` `chunk` at a time as a prefill feeds a model (one at a time: as decoding does)."""
    (kv,) = kv_cache(tokens)[:1]
    window = RotatingKVCache(max_size=WINDOW)
    layers = [kv, window]
    if state:
        layers.append(ArraysCache(2))
        layers[2][0], layers[2][1] = mx.zeros((1, 1)), mx.zeros((1, 1))
    feed(window, layers[2] if state else None, tokens, 0, chunk)
    return layers


def feed(window, state, tokens, start, chunk):
    """Run tokens[start:] into the window and state layers of a cache."""
    (full,) = kv_cache(tokens)[:1]
    for at in range(start, len(tokens), chunk):
        end = min(at + chunk, len(tokens))
        window.update_and_fetch(full.keys[..., at:end, :], full.values[..., at:end, :])
        if state is None:
            continue
        for t in tokens[at:end]:
            state[0] = state[0] * 3 + t + 1  # depends on every token before, in order
        state[1] = state[1] + (end - at)


def window_of(layer) -> np.ndarray:
    """The window's last min(offset, max_size) keys, in order of the tokens."""
    keys = layer._temporal_order(layer.keys)
    return np.array(keys[..., -min(layer.offset, layer.max_size) :, :])


def same_as_fresh(cache, tokens) -> bool:
    want = hybrid_cache(tokens, state=len(cache) == 3)
    kv, window = cache[:2]
    n = len(tokens)
    states = zip(cache[2].cache, want[2].cache, strict=True) if len(cache) == 3 else []
    return (
        kv.offset == n
        and np.array_equal(np.array(kv.keys[..., :n, :]), np.array(want[0].keys[..., :n, :]))
        and window.offset == n
        and np.array_equal(window_of(window), window_of(want[1]))
        and all(np.array_equal(np.array(a), np.array(b)) for a, b in states)
    )


SYSTEM = list(range(10, 40))


def stored_bytes(node) -> int:
    return node.held.segment_nbytes + node.held.checkpoint_nbytes + node.held.window_nbytes


def test_the_layout_says_what_is_checkpointed():
    layout = layout_of(hybrid_cache([1, 2, 3]))
    assert layout.checkpointed and not layout.sliceable and layout.kv == (0,)
    assert layout.mode() == ("hybrid: 1 attention and 1 sliding-window layers stored by "
                             "token, 1 recurrent-state layers checkpointed")  # fmt: skip
    kept = RotatingKVCache(max_size=8, keep=2)
    kept.update_and_fetch(*(mx.zeros((1, 1, 3, 4)),) * 2)
    assert not layout_of([kept]).checkpointed  # what `keep` holds: whole snapshots


def test_a_prompt_resumes_where_a_checkpoint_is_and_goes_on_as_a_fresh_one():
    cache = PromptCache()
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    cache.insert("h", prompt, hybrid_cache(prompt))
    found = cache.fetch("h", prompt + [6, 7])
    assert (found.kind, found.n_cached) == ("shorter", len(prompt))
    assert same_as_fresh(found.cache, prompt)
    # Going on from the restored cache gives what a fresh prefill of it all does.
    longer = prompt + [6, 7, 8, 9, 10]
    kv, window, state = found.cache
    feed(window, state, longer, len(prompt), 2)
    assert np.array_equal(window_of(window), window_of(hybrid_cache(longer)[1]))
    assert np.array_equal(np.array(state[0]), np.array(hybrid_cache(longer)[2][0]))
    # The same prompt again: no checkpoint leaves a token to run, so it is a miss...
    assert cache.fetch("h", prompt).kind == "miss"
    # ...until one is stored a token before its end, as the engine does.
    cache.insert("h", prompt[:-1], hybrid_cache(prompt[:-1]))
    found = cache.fetch("h", prompt)
    assert found.n_cached == len(prompt) - 1 and same_as_fresh(found.cache, prompt[:-1])


def test_two_conversations_share_the_attention_kv_of_a_checkpointed_prefix():
    cache = PromptCache()
    a, b = SYSTEM + [1, 1, 1], SYSTEM + [2, 2, 2, 2]
    cache.insert("h", SYSTEM, hybrid_cache(SYSTEM))  # the engine's checkpoint at the system's end
    cache.insert("h", a, hybrid_cache(a))
    found = cache.fetch("h", b)
    assert found.n_cached == len(SYSTEM) and same_as_fresh(found.cache, SYSTEM)
    cache.insert("h", b, hybrid_cache(b))
    nodes = list(iter_nodes(cache._trees["h"].root))
    kv_bytes = sum(n.held.segment_nbytes for n in nodes)
    per_token = kv_bytes // (len(SYSTEM) + 3 + 4)
    assert per_token * (len(SYSTEM) + 3 + 4) == kv_bytes  # the prefix's KV is stored once
    assert sorted(n.depth for n in nodes if n.held.checkpoint is not None) == [
        len(SYSTEM), len(a), len(b)]  # fmt: skip
    held = sum(n.held.checkpoint_nbytes + n.held.window_nbytes for n in nodes)
    assert cache.nbytes == kv_bytes + held


def test_the_caller_owns_what_it_fetched():
    cache = PromptCache()
    prompt = SYSTEM + [1, 2]
    cache.insert("h", prompt, hybrid_cache(prompt))
    first = cache.fetch("h", prompt + [3]).cache
    feed(first[1], first[2], prompt + [9] * 6, len(prompt), 1)  # in place, as decoding writes
    assert same_as_fresh(cache.fetch("h", prompt + [3]).cache, prompt)


def test_a_long_conversation_drops_its_least_used_checkpoints_to_go_on():
    one = PromptCache()
    one.insert("h", SYSTEM, hybrid_cache(SYSTEM))
    budget = one.nbytes * 3
    cache = PromptCache(max_bytes=budget)
    tokens = list(SYSTEM)
    cache.insert("h", tokens, hybrid_cache(tokens))
    cache.fetch("h", SYSTEM + [99])  # the system prompt's checkpoint, used again
    for turn in range(12):
        tokens += [turn + 1] * 5
        assert cache.insert("h", tokens, hybrid_cache(tokens))  # room made, never refused
        assert cache.nbytes <= budget
        found = cache.fetch("h", tokens + [0])
        assert found.n_cached == len(tokens) and same_as_fresh(found.cache, tokens)
    nodes = list(iter_nodes(cache._trees["h"].root))
    held = sorted(n.depth for n in nodes if n.held.checkpoint is not None)
    assert held[-1] == len(tokens) and len(held) < 13  # the end kept; older ones gone
    assert cache.nbytes == sum(stored_bytes(n) for n in nodes)


def test_the_byte_budget_holds_and_eviction_frees_checkpoints():
    one = PromptCache()
    one.insert("h", SYSTEM + [1], hybrid_cache(SYSTEM + [1]))
    budget = int(one.nbytes * 2.5)
    cache = PromptCache(max_bytes=budget)
    for i in range(6):
        seq = [100 + i, *SYSTEM]  # nothing shared
        cache.insert("h", seq, hybrid_cache(seq))
        assert cache.nbytes <= budget
    assert 1 <= len(cache) < 6
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)


class HybridCacheHolds(RuleBasedStateMachine):
    """Any inserts, fetches and trims: every fetch is the fresh state of what it covers,
    resumes at a checkpoint, and bytes are what the tree holds, within the budget."""

    state = True
    budget = 12_000

    def __init__(self):
        super().__init__()
        self.cache = PromptCache(max_sequences=4, max_bytes=self.budget)
        self.last = None

    @rule(tokens=tokens_st, chunk=st.integers(1, 5), prefix=st.integers(0, 13))
    def insert(self, tokens, chunk, prefix):
        if 0 < prefix < len(tokens):  # a checkpoint inside the prompt, as the engine takes
            stop = hybrid_cache(tokens[:prefix], chunk, self.state)
            self.cache.insert("h", tokens[:prefix], stop)
        if self.cache.insert("h", tokens, hybrid_cache(tokens, chunk, self.state)):
            self.last = tokens

    @rule(tokens=tokens_st)
    def fetch(self, tokens):
        found = self.cache.fetch("h", tokens)
        if found.cache is None:
            return
        assert 0 < found.n_cached < len(tokens)
        assert same_as_fresh(found.cache, tokens[: found.n_cached])

    @rule(extra=st.integers(0, 3))
    def the_last_insert_resumes_at_its_end(self, extra):
        if self.last is not None:
            assert self.cache.fetch("h", self.last + [extra]).n_cached == len(self.last)

    @rule(n=st.integers(0, 3))
    def trim(self, n):
        self.cache.trim_to(n_sequences=n)
        self.last = None

    @invariant()
    def bytes_are_what_the_tree_holds(self):
        tree = self.cache._trees.get("h")
        nodes = list(iter_nodes(tree.root)) if tree is not None else []
        total = sum(stored_bytes(n) for n in nodes)
        assert self.cache.nbytes == total <= self.budget
        assert all(n.pins == 0 and n.held.window_held <= n.size for n in nodes)

    @invariant()
    def every_cached_sequence_resumes_at_its_end(self):
        tree = self.cache._trees.get("h")
        for node in iter_nodes(tree.root) if tree is not None else []:
            if node.terminal and node.depth > 1:
                assert self.cache.peek("h", path_of(node) + [0])[1] == node.depth


HybridCacheHolds.TestCase.settings = settings(max_examples=60, stateful_step_count=25,
                                              deadline=None)  # fmt: skip
test_hybrid_cache_holds = HybridCacheHolds.TestCase


class WindowCacheHolds(HybridCacheHolds):
    """The same for a model whose only other layers are windows (gemma3, gpt-oss): a fetch
    may resume at any token whose window KV lies along its path."""

    state = False


class TightCacheHolds(HybridCacheHolds):
    """The same with a budget of a few sequences, where window KV and checkpoints go too."""

    budget = 3_000


class TightWindowCacheHolds(TightCacheHolds):
    state = False


for machine in (WindowCacheHolds, TightCacheHolds, TightWindowCacheHolds):
    machine.TestCase.settings = HybridCacheHolds.TestCase.settings
test_window_cache_holds = WindowCacheHolds.TestCase
test_tight_cache_holds = TightCacheHolds.TestCase
test_tight_window_cache_holds = TightWindowCacheHolds.TestCase


def path_of(node) -> list[int]:
    out = []
    while node.parent is not None:
        out = node.tokens + out
        node = node.parent
    return out


def test_an_insert_copies_only_the_window_kv_the_tree_lacks():
    from mlx_cache_server.prompt_cache import planning
    from mlx_cache_server.prompt_cache.radix import pack, walk

    cache = PromptCache()
    prompt = SYSTEM + [1, 2, 3]
    cache.insert("w", prompt, hybrid_cache(prompt, chunk=len(prompt), state=False))
    longer = prompt + [4] * 6
    window = hybrid_cache(longer, chunk=len(longer), state=False)  # holds every token
    layout = layout_of(window)
    w = walk(cache._trees["w"].root, pack(longer))
    assert planning.window_from(layout, w, len(longer), len(longer)) == len(prompt)
    # With recurrent layers, only the window before the end: nothing else resumes there.
    mixed = hybrid_cache(longer, chunk=len(longer))
    assert planning.window_from(layout_of(mixed), w, len(longer), len(longer)) == len(longer) - 4


def test_window_kv_used_longer_ago_goes_before_a_conversation_used_since():
    cache = PromptCache()
    conversations = []
    for c in range(2):
        tokens = [50 + c]
        for turn in range(10):
            tokens = tokens + [c * 10 + turn % 4] * 5
            cache.insert("w", tokens, hybrid_cache(tokens, chunk=5, state=False))
        conversations.append(tokens)
    for tokens in conversations:
        cache.fetch("w", tokens + [0])
    cache.max_bytes = cache.nbytes
    assert cache.insert("w", [99] * 6, hybrid_cache([99] * 6, chunk=6, state=False))
    for tokens in conversations:  # both still resume where they ended
        assert cache.peek("w", tokens + [0])[1] == len(tokens)
    assert cache.stats("w").evictions == 0 and cache.nbytes <= cache.max_bytes


@pytest.mark.parametrize("state", [False, True])
def test_an_insert_stored_is_resumable_at_its_end_even_when_room_is_short(state):
    """A branch off a prefix split over several nodes, with room for its own edge only if
    something goes: the window KV of the prefix its end resumes from is not what goes."""
    system = list(range(10, 20))
    cache = PromptCache()
    for tokens in (system[:8], system, system + [3] * 6):
        assert cache.insert("w", tokens, hybrid_cache(tokens, chunk=len(tokens), state=state))
    branch = system + [4]
    alone = PromptCache()  # what the branch's own edge takes
    for tokens in (system, branch):
        alone.insert("w", tokens, hybrid_cache(tokens, chunk=len(tokens), state=state))
    edge = max(iter_nodes(alone._trees["w"].root), key=lambda n: n.depth)
    longest = next(n for n in iter_nodes(cache._trees["w"].root) if n.terminal)
    cache.max_bytes = cache.nbytes - stored_bytes(longest) + stored_bytes(edge) - 1
    if cache.insert("w", branch, hybrid_cache(branch, chunk=len(branch), state=state)):
        assert cache.peek("w", branch + [0])[1] == len(branch)
    assert cache.nbytes <= cache.max_bytes


def test_windows_of_different_widths_are_stored_whole():
    narrow, wide = RotatingKVCache(max_size=4), RotatingKVCache(max_size=8)
    for layer in (narrow, wide):
        layer.update_and_fetch(*(mx.zeros((1, 1, 3, 4)),) * 2)
    assert not layout_of([narrow, wide]).checkpointed


def test_a_window_model_resumes_at_any_token_its_windows_cover():
    cache = PromptCache()
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    cache.insert("w", prompt, hybrid_cache(prompt, chunk=len(prompt), state=False))
    for n in (1, 3, 17, len(prompt) - 1):  # one chunk: the window held every token
        found = cache.fetch("w", prompt[:n] + [99])
        assert found.n_cached == n and same_as_fresh(found.cache, prompt[:n])
    # Regenerate: the same prompt resumes a token before its end, with no stop there.
    found = cache.fetch("w", prompt)
    assert found.n_cached == len(prompt) - 1 and same_as_fresh(found.cache, prompt[:-1])


def test_window_kv_lacking_inside_a_path_is_filled_by_the_next_insert_through_it():
    cache = PromptCache()
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    cache.insert("w", prompt, hybrid_cache(prompt, chunk=3, state=False))
    # A window run three at a time holds at most 6 tokens: nothing before them resumes.
    assert cache.fetch("w", prompt[:20] + [99]).kind == "miss"
    cache.insert("w", prompt[:20], hybrid_cache(prompt[:20], chunk=3, state=False))
    found = cache.fetch("w", prompt[:20] + [99])
    assert found.n_cached == 20 and same_as_fresh(found.cache, prompt[:20])
    # What the long prompt's window held is still there: it resumes at its end too.
    found = cache.fetch("w", prompt + [99])
    assert found.n_cached == len(prompt) and same_as_fresh(found.cache, prompt)
    nodes = list(iter_nodes(cache._trees["w"].root))
    assert cache.nbytes == sum(stored_bytes(n) for n in nodes)


def test_two_conversations_store_the_window_kv_of_their_shared_prefix_once():
    cache = PromptCache()
    a, b = SYSTEM + [1, 1, 1], SYSTEM + [2, 2, 2, 2]
    for tokens in (SYSTEM, a, b):  # the system's end first, as the engine stops there
        cache.insert("w", tokens, hybrid_cache(tokens, chunk=len(tokens), state=False))
    found = cache.fetch("w", SYSTEM + [3, 3])
    assert found.n_cached == len(SYSTEM) and same_as_fresh(found.cache, SYSTEM)
    nodes = list(iter_nodes(cache._trees["w"].root))
    two = hybrid_cache([1, 2], chunk=2, state=False)[1]  # a window holding two tokens
    per_token = (two.keys.nbytes + two.values.nbytes) // 2
    # Every token's window KV at most once: the system prompt's, then each branch's.
    assert sum(n.held.window_nbytes for n in nodes) == per_token * (len(SYSTEM) + 3 + 4)
    assert all(n.held.window_held <= n.size for n in nodes)


def test_a_long_conversation_of_a_window_model_drops_old_window_kv_to_go_on():
    one = PromptCache()
    one.insert("w", SYSTEM, hybrid_cache(SYSTEM, chunk=len(SYSTEM), state=False))
    budget = one.nbytes * 2
    cache = PromptCache(max_bytes=budget)
    tokens = list(SYSTEM)
    cache.insert("w", tokens, hybrid_cache(tokens, chunk=len(tokens), state=False))
    for turn in range(8):
        tokens += [turn + 1] * 5
        assert cache.insert("w", tokens, hybrid_cache(tokens, chunk=5, state=False))
        assert cache.nbytes <= budget
        found = cache.fetch("w", tokens + [0])
        assert found.n_cached == len(tokens) and same_as_fresh(found.cache, tokens)
    nodes = list(iter_nodes(cache._trees["w"].root))
    assert sum(n.held.window_held for n in nodes) < len(tokens)  # old window KV went first
    assert cache.nbytes == sum(stored_bytes(n) for n in nodes)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_a_window_restored_from_any_chunking_matches(chunk):
    cache = PromptCache()
    prompt = SYSTEM[:11]
    cache.insert("h", prompt, hybrid_cache(prompt, chunk))
    assert same_as_fresh(cache.fetch("h", prompt + [0]).cache, prompt)


def test_a_refused_extension_leaves_the_sequence_it_extends_resumable():
    one = PromptCache()
    short = SYSTEM + [1] * 10
    one.insert("h", short, hybrid_cache(short))
    cache = PromptCache(max_bytes=int(one.nbytes * 1.5))
    assert cache.insert("h", short, hybrid_cache(short))
    longer = short + [2] * 40  # its new part does not fit beside the old one
    assert not cache.insert("h", longer, hybrid_cache(longer))
    found = cache.fetch("h", short + [0])
    assert found.n_cached == len(short) and same_as_fresh(found.cache, short)
