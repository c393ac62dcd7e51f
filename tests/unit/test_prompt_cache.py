"""PromptCache behaviour, case by case, on real mlx-lm layer caches with known contents."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache

from mlx_cache_server.prompt_cache import LRUPromptCache, PackedTokens, PromptCache
from tests.fakes import BYTES_PER_TOKEN, held, kv_cache, same_state

SYSTEM = list(range(100, 400))  # a long shared prefix


def test_miss_on_empty_cache_and_unknown_model():
    cache = PromptCache()
    assert cache.fetch("m", [1, 2, 3]).kind == "miss"
    cache.insert("m", [1, 2, 3], kv_cache([1, 2, 3]))
    found = cache.fetch("other", [1, 2, 3])
    assert (found.cache, found.n_cached, found.kind) == (None, 0, "miss")


def test_exact_match_leaves_the_last_token_to_run():
    cache = PromptCache()
    seq = [5, 6, 7, 8]
    cache.insert("m", seq, kv_cache(seq))
    found = cache.fetch("m", seq)
    assert found.kind == "exact" and found.n_cached == 3
    assert same_state(found.cache, kv_cache(seq[:3]))
    assert cache.fetch("m", [5]).kind == "miss"  # one token: nothing can be reused


def test_shorter_prefix_and_longer_sequence_cut_back():
    cache = PromptCache()
    turn1 = SYSTEM + [1, 2, 3]
    cache.insert("m", turn1, kv_cache(turn1))
    shorter = cache.fetch("m", turn1 + [9, 9])
    assert shorter.kind == "shorter" and shorter.n_cached == len(turn1)
    assert same_state(shorter.cache, kv_cache(turn1))
    longer = cache.fetch("m", SYSTEM + [4])
    assert longer.kind == "longer" and longer.n_cached == len(SYSTEM)
    assert same_state(longer.cache, kv_cache(SYSTEM))


def test_shared_prefix_is_stored_once():
    cache = PromptCache()
    convs = [SYSTEM + [1000 + i] * 20 for i in range(10)]
    for conv in convs:
        assert cache.insert("m", conv, kv_cache(conv, spare=50))
    assert len(cache) == 10
    assert cache.nbytes == (len(SYSTEM) + 10 * 20) * BYTES_PER_TOKEN
    for conv in convs:
        found = cache.fetch("m", conv + [1])
        assert found.n_cached == len(conv) and same_state(found.cache, kv_cache(conv))


def test_splitting_an_edge_keeps_both_branches_exact():
    cache = PromptCache()
    a = SYSTEM + [1, 2, 3, 4]
    b = SYSTEM[:150] + [7, 7]
    cache.insert("m", a, kv_cache(a))
    cache.insert("m", b, kv_cache(b))
    assert cache.nbytes == (len(a) + 2) * BYTES_PER_TOKEN
    for seq in (a, b, SYSTEM[:150] + [5]):
        found = cache.fetch("m", seq)
        assert same_state(found.cache, kv_cache(seq[: found.n_cached]))
    assert cache.fetch("m", SYSTEM[:150] + [5]).n_cached == 150


def test_a_turn_that_extends_a_stored_one_replaces_it():
    cache = PromptCache()
    turn1 = SYSTEM + [1, 2]
    turn2 = turn1 + [3, 4, 5]
    cache.insert("m", turn1, kv_cache(turn1))
    cache.insert("m", turn2, kv_cache(turn2))
    assert len(cache) == 1
    assert cache.nbytes == len(turn2) * BYTES_PER_TOKEN
    assert cache.fetch("m", turn1 + [8]).kind == "longer"


def test_inserting_a_stored_prefix_adds_nothing():
    cache = PromptCache()
    seq = SYSTEM + [1, 2, 3]
    cache.insert("m", seq, kv_cache(seq))
    assert cache.insert("m", SYSTEM, kv_cache(SYSTEM))
    assert len(cache) == 1 and cache.nbytes == len(seq) * BYTES_PER_TOKEN


def test_fetched_cache_is_the_callers_to_mutate():
    cache = PromptCache()
    seq = SYSTEM + [1, 2, 3]
    cache.insert("m", seq, kv_cache(seq))
    for query in (seq + [4], seq):  # a single stored segment: handed out as views
        found = cache.fetch("m", query)
        for layer in found.cache:
            layer.trim(5)
            layer.update_and_fetch(mx.full((1, 2, 3, 4), -1.0), mx.full((1, 2, 3, 4), -1.0))
            layer.keys[..., 0, :] = 12345.0
        again = cache.fetch("m", seq + [4])
        assert same_state(again.cache, kv_cache(seq))


def test_caller_mutating_its_cache_after_insert_does_not_reach_the_store():
    cache = PromptCache()
    seq = SYSTEM + [1]
    mine = kv_cache(seq)
    cache.insert("m", seq, mine)
    for layer in mine:
        layer.keys[..., :, :] = -5.0
        layer.trim(10)
        layer.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert same_state(cache.fetch("m", seq + [2]).cache, kv_cache(seq))


def test_lru_eviction_by_count_keeps_recently_fetched():
    cache = PromptCache(max_sequences=3)
    seqs = [[i] * 10 for i in range(4)]
    for s in seqs[:3]:
        cache.insert("m", s, kv_cache(s))
    cache.fetch("m", seqs[0] + [1])  # 0 is now the most recent
    cache.insert("m", seqs[3], kv_cache(seqs[3]))
    assert len(cache) == 3
    assert cache.fetch("m", seqs[1] + [1]).kind == "miss"
    assert cache.fetch("m", seqs[0] + [1]).kind == "shorter"
    assert cache.stats().evictions == 1


def test_byte_budget_holds_and_shared_prefix_survives_leaf_eviction():
    budget = (len(SYSTEM) + 3 * 20) * BYTES_PER_TOKEN
    cache = PromptCache(max_sequences=100, max_bytes=budget)
    convs = [SYSTEM + [1000 + i] * 20 for i in range(6)]
    for conv in convs:
        assert cache.insert("m", conv, kv_cache(conv))
        assert cache.nbytes <= budget
    assert len(cache) == 3  # the prefix is paid once, so three conversations fit
    found = cache.fetch("m", SYSTEM + [5])
    assert found.n_cached == len(SYSTEM)


def test_bytes_are_counted_by_the_caches_measure_and_evicted_by_it():
    """A sharded model's rank counts its KV as the largest rank's would be (`measure`)."""
    from mlx_cache_server.prompt_cache import layers

    budget = (len(SYSTEM) + 3 * 20) * BYTES_PER_TOKEN * 2
    twice = lambda tree: 2 * layers.nbytes(tree)  # noqa: E731
    double = PromptCache(max_sequences=100, max_bytes=budget, measure=twice)
    convs = [SYSTEM + [1000 + i] * 20 for i in range(6)]
    for conv in convs:
        assert double.insert("m", conv, kv_cache(conv))
        assert double.nbytes <= budget
    assert len(double) == 3  # as many as half the budget holds at the arrays' own bytes
    assert double.nbytes == (len(SYSTEM) + 3 * 20) * BYTES_PER_TOKEN * 2


def test_short_of_bytes_the_oldest_sequence_loses_only_its_end():
    a, b = SYSTEM[:40] + [1] * 20, SYSTEM[:40] + [2] * 20
    cache = PromptCache(max_bytes=(40 + 20 + 20) * BYTES_PER_TOKEN)
    for seq in (a, b):
        cache.insert("m", seq, kv_cache(seq))
    c = SYSTEM[:40] + [3] * 5
    assert cache.insert("m", c, kv_cache(c))
    assert cache.nbytes == cache.max_bytes and len(cache) == 3
    stats = cache.stats()
    assert (stats.shortened, stats.evictions) == (1, 0)
    found = cache.fetch("m", a + [9])  # a kept all but the 5 tokens c needed
    assert found.n_cached == 55 and same_state(found.cache, kv_cache(a[:55]))
    assert cache.fetch("m", b + [9]).n_cached == len(b)


def test_cutting_into_a_long_segment_that_copies_too_much_drops_it_whole():
    alone = [7] * 100  # shares nothing: keeping 97 tokens would copy 32x the 3 freed
    cache = PromptCache(max_bytes=102 * BYTES_PER_TOKEN)
    cache.insert("m", alone, kv_cache(alone))
    new = [8] * 5
    assert cache.insert("m", new, kv_cache(new))
    assert cache.stats().evictions == 1 and cache.fetch("m", alone).kind == "miss"


def test_a_sequence_can_lose_a_whole_node_instead_of_a_costly_cut():
    a = SYSTEM[:30] + [1] * 40
    b = SYSTEM[:30] + [2] * 2  # splits a's path at 30, then leaves
    cache = PromptCache(max_sequences=2, max_bytes=(30 + 40 + 2) * BYTES_PER_TOKEN)
    for seq in (a, b):
        cache.insert("m", seq, kv_cache(seq))
    cache.fetch("m", a + [9])
    cache.trim_to(n_sequences=1)  # b goes: a is now two nodes it alone uses
    c = [5] * 6  # 4 tokens short: cutting a's 40-token tail would keep 36 (> 4 x 4)
    assert cache.insert("m", c, kv_cache(c))
    found = cache.fetch("m", a + [9])
    assert found.n_cached == 30 and same_state(found.cache, kv_cache(a[:30]))
    assert cache.stats().shortened == 1 and cache.nbytes == (30 + 6) * BYTES_PER_TOKEN


def test_insert_larger_than_budget_is_refused_without_evicting():
    cache = PromptCache(max_bytes=50 * BYTES_PER_TOKEN)
    small = [1] * 10
    cache.insert("m", small, kv_cache(small))
    big = [2] * 60
    assert cache.insert("m", big, kv_cache(big)) is False
    assert len(cache) == 1 and cache.stats().rejected == 1


def test_trim_to_and_clear():
    cache = PromptCache()
    for i in range(5):
        cache.insert("m", [i] * 8, kv_cache([i] * 8))
        cache.insert("n", [i] * 8, kv_cache([i] * 8))
    assert cache.trim_to(n_sequences=6) == 4
    assert len(cache) == 6
    cache.trim_to(n_bytes=3 * 8 * BYTES_PER_TOKEN)
    assert cache.nbytes <= 3 * 8 * BYTES_PER_TOKEN and len(cache) == 3
    cache.clear("m")
    assert cache.stats("m").sequences == 0 and "m" not in cache.models()
    assert cache.nbytes == cache.stats("n").bytes > 0
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0


def test_a_pinned_sequence_is_not_evicted_under_a_fetch(monkeypatch):
    from mlx_cache_server.prompt_cache import layers

    cache = PromptCache(max_sequences=1)
    a, b = [1] * 8, [2] * 8
    cache.insert("m", a, kv_cache(a))
    original = layers.assemble
    results = []

    def assemble_while_another_insert_runs(layout, pieces):
        results.append(cache.insert("m", b, kv_cache(b)))  # would need to evict a
        return original(layout, pieces)

    monkeypatch.setattr(layers, "assemble", assemble_while_another_insert_runs)
    found = cache.fetch("m", a + [3])
    assert results == [False] and same_state(found.cache, kv_cache(a))
    monkeypatch.setattr(layers, "assemble", original)
    assert cache.insert("m", b, kv_cache(b))  # unpinned now: a can go


def test_peek_matches_fetch_without_counting():
    cache = PromptCache()
    seq = SYSTEM + [1, 2]
    cache.insert("m", seq, kv_cache(seq))
    for query in (seq, seq + [3], SYSTEM[:10] + [4], [9, 9], [1]):
        before = cache.stats()
        peeked = cache.peek("m", query)
        assert cache.stats() == before
        found = cache.fetch("m", query)
        assert peeked == (found.kind, found.n_cached)
    assert cache.peek("other", seq) == ("miss", 0)


def test_packed_tokens_work_as_the_token_list_they_pack():
    as_lists, as_packed = PromptCache(max_sequences=3), PromptCache(max_sequences=3)
    prompts = [SYSTEM + [1, 2], SYSTEM + [1, 2, 3, 4], SYSTEM + [5], [7, 8, 9], SYSTEM[:50]]
    for prompt in prompts:
        packed = PackedTokens.of(prompt)
        assert as_packed.peek("m", packed) == as_lists.peek("m", prompt)
        a, b = as_lists.fetch("m", prompt), as_packed.fetch("m", packed)
        assert (a.kind, a.n_cached) == (b.kind, b.n_cached)
        assert a.cache is None or same_state(a.cache, b.cache)
        turn = prompt + [60, 61]  # the prompt and its reply, stored as a server would
        assert as_lists.insert("m", turn, kv_cache(turn))
        assert as_packed.insert("m", packed.extend([60, 61]), kv_cache(turn))
        assert (len(as_packed), as_packed.nbytes) == (len(as_lists), as_lists.nbytes)
    with pytest.raises(ValueError, match="holds"):  # the cache must match the packed tokens too
        as_packed.insert("m", PackedTokens.of([1, 2, 3]), kv_cache([1, 2]))


def test_stats_count_kinds_and_tokens():
    cache = PromptCache()
    seq = [1, 2, 3, 4]
    cache.insert("m", seq, kv_cache(seq))
    cache.fetch("m", seq)
    cache.fetch("m", seq + [5])
    cache.fetch("m", [1, 2, 9])
    cache.fetch("m", [9, 9])
    s = cache.stats("m")
    assert (s.lookups, s.exact, s.shorter, s.longer, s.misses) == (4, 1, 1, 1, 1)
    assert s.tokens_asked == 4 + 5 + 3 + 2 and s.tokens_reused == 3 + 4 + 2
    assert s.sequences == 1 and s.bytes == 4 * BYTES_PER_TOKEN and s.inserts == 1


def test_bad_inserts_are_refused_clearly():
    cache = PromptCache()
    with pytest.raises(ValueError, match="holds 3 tokens but 4"):
        cache.insert("m", [1, 2, 3, 4], kv_cache([1, 2, 3]))
    cache.insert("m", [1, 2], kv_cache([1, 2]))
    with pytest.raises(ValueError, match="clear it"):
        cache.insert("m", [1, 2, 3], rotating([1, 2, 3]))
    with pytest.raises(ValueError, match="at least one layer"):
        cache.insert("m", [1], [])


def test_quantized_kv_cache_is_shared_by_prefix():
    def qcache(tokens):
        out = []
        for layer in range(2):
            x = mx.array(np.add.outer(np.asarray(tokens, np.float32), np.arange(32) + layer))
            q = QuantizedKVCache(group_size=32, bits=8)
            q.update_and_fetch(x[None, None], -x[None, None])
            out.append(q)
        return out

    def held_q(c):
        return [np.array(x[..., : c.offset, :]) for x in (*c.keys, *c.values)]

    cache = PromptCache()
    a, b = SYSTEM[:64] + [1] * 8, SYSTEM[:64] + [2] * 8
    cache.insert("q", a, qcache(a))
    cache.insert("q", b, qcache(b))
    found = cache.fetch("q", b + [3])
    assert found.n_cached == len(b)
    for got, want in zip(found.cache, qcache(b), strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(held_q(got), held_q(want), strict=True))
    per_token = sum(sum(x.nbytes for x in held_q(c)) for c in qcache([1]))
    assert cache.nbytes == (64 + 8 + 8) * per_token


def rotating(tokens, max_size=16):
    layer = RotatingKVCache(max_size=max_size)
    (kv,) = kv_cache(tokens)[:1]
    for i in range(len(tokens)):  # one token at a time, like decoding
        layer.update_and_fetch(kv.keys[..., i : i + 1, :], kv.values[..., i : i + 1, :])
    return [layer]


def test_snapshot_mode_for_windows_that_keep_their_start():
    def kept(tokens):
        layer = RotatingKVCache(max_size=16, keep=2)
        (kv,) = kv_cache(tokens)[:1]
        for i in range(len(tokens)):
            layer.update_and_fetch(kv.keys[..., i : i + 1, :], kv.values[..., i : i + 1, :])
        return [layer]

    cache = PromptCache()
    short = [1, 2, 3, 4, 5]
    cache.insert("r", short, kept(short))
    found = cache.fetch("r", short + [6, 7])
    assert found.kind == "shorter" and found.n_cached == 5
    assert found.cache[0].offset == 5
    # A longer stored sequence is trimmed back while the window has not wrapped.
    longer = short + [6, 7, 8]
    cache.insert("r", longer, kept(longer))
    found = cache.fetch("r", short + [6, 9])
    assert found.kind == "longer" and found.n_cached == 6 and found.cache[0].offset == 6
    k, _ = found.cache[0].state[:2]
    assert np.array_equal(np.array(k[..., :6, :]), held(kv_cache(longer[:6])[:1])[0][0])


def test_windows_and_state_space_layers_are_checkpointed():
    # (tests/unit/test_prompt_cache_hybrid.py has the checkpointed mode's own tests.)
    def ssm(tokens):
        layer = ArraysCache(2)
        layer[0] = mx.array([[float(sum(tokens))]])
        layer[1] = mx.array([[float(len(tokens))]])
        return [layer, *rotating(tokens)]

    cache = PromptCache()
    seq = [3, 4, 5]
    cache.insert("s", seq, ssm(seq))
    assert cache.fetch("s", seq).kind == "miss"  # no checkpoint leaves a token to run
    found = cache.fetch("s", seq + [6])
    assert found.kind == "shorter" and found.n_cached == 3
    assert found.cache[0][0].item() == 12.0 and found.cache[1].offset == 3
    found.cache[0][0] = mx.array([[0.0]])  # the caller's copy only
    assert cache.fetch("s", seq + [6]).cache[0][0].item() == 12.0


def test_lru_prompt_cache_is_a_drop_in_for_mlx_lm():
    lru = LRUPromptCache(max_size=2)
    seq = [1, 2, 3, 4]
    assert lru.fetch_nearest_cache("m", seq) == (None, seq)
    lru.insert_cache("m", seq, kv_cache(seq), cache_type="user")
    cache, rest = lru.fetch_nearest_cache("m", seq + [5, 6])
    assert rest == [5, 6] and same_state(cache, kv_cache(seq))
    assert len(lru) == 1 and lru.nbytes == 4 * BYTES_PER_TOKEN
    lru.trim_to(n_sequences=0)
    assert len(lru) == 0 and lru.stats_by_type()["all"]["n_bytes"] == 0


def test_joined_cache_merges_into_a_batch_like_mlx_lm():
    from mlx_lm.models.cache import BatchKVCache

    cache = PromptCache()
    a = SYSTEM[:40] + [1] * 10
    b = SYSTEM[:40] + [2] * 25
    cache.insert("m", a, kv_cache(a))
    cache.insert("m", b, kv_cache(b))  # b's cache is now two segments: shared + own
    joined = cache.fetch("m", b + [3]).cache
    plain = kv_cache([7, 8, 9])
    touched = cache.fetch("m", a + [3]).cache
    for layer in touched:  # a caller change: the parts no longer describe it
        layer.trim(2)
    for i in range(len(joined)):
        layers_in = [joined[i], plain[i], touched[i]]
        direct = [kv_cache(b)[i], kv_cache([7, 8, 9])[i], kv_cache(a[:-2])[i]]
        got = type(joined[i]).merge(layers_in)
        want = BatchKVCache.merge(direct)
        assert np.array_equal(np.array(got.keys), np.array(want.keys))
        assert np.array_equal(np.array(got.values), np.array(want.values))
        assert np.array_equal(np.array(got.left_padding), np.array(want.left_padding))
        assert np.array_equal(np.array(got.offset), np.array(want.offset))


def test_joined_cache_extended_in_place_equals_a_plain_one():
    cache = PromptCache()
    a = SYSTEM[:40] + [1] * 10
    b = SYSTEM[:40] + [2] * 25
    cache.insert("m", a, kv_cache(a))
    cache.insert("m", b, kv_cache(b))
    joined = cache.fetch("m", b + [3]).cache  # two segments: shared + b's own
    plain = kv_cache(b)
    for step in range(3):  # the first update joins the parts; later ones append
        new_k, new_v = mx.full((1, 2, 3, 4), float(step)), mx.full((1, 2, 3, 4), -float(step))
        for j, p in zip(joined, plain, strict=True):
            got, want = j.update_and_fetch(new_k, new_v), p.update_and_fetch(new_k, new_v)
            assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
    assert same_state(joined, plain)
    assert same_state(cache.fetch("m", b + [3]).cache, kv_cache(b))  # the store is untouched
    merged = type(joined[0]).merge([joined[0], plain[0]])
    assert np.array_equal(np.array(merged.keys[0]), np.array(merged.keys[1]))


def _grown_by_one(tokens: list[int]) -> tuple[list, list]:
    """A fetched (joined) cache of `tokens` run on for one more token, and the plain equal."""
    cache = PromptCache()
    cache.insert("m", tokens, kv_cache(tokens))
    joined = cache.fetch("m", tokens + [1]).cache
    plain = kv_cache(tokens)
    last = kv_cache(tokens + [1])
    for j, p, ref in zip(joined, plain, last, strict=True):
        k, v = ref.keys[..., -1:, :], ref.values[..., -1:, :]
        j.update_and_fetch(k, v)
        p.update_and_fetch(k, v)
    mx.eval([c.state for c in joined + plain])
    return joined, plain


def _reset_peak() -> int:
    """MLX's memory in use now, from which its peak is counted again."""
    mx.reset_peak_memory()
    return mx.get_active_memory()


def _decode_step(caches: list) -> None:
    for c in caches:
        c.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))


def test_a_lone_cache_already_run_on_joins_the_batch_without_a_copy():
    tokens = [t % 1000 for t in range(1 << 16)]  # 8 MiB of KV
    joined, plain = _grown_by_one(tokens)
    before = _reset_peak()
    batch = [type(c).merge([c]) for c in joined]
    del joined  # as the server does once the batch holds it
    _decode_step(batch)  # fits in the room the cache already has: nothing to grow
    mx.eval([(b.keys, b.values) for b in batch])
    assert mx.get_peak_memory() - before < len(tokens) * BYTES_PER_TOKEN // 8


def test_a_lone_cache_merged_into_a_batch_equals_mlx_lms_merge():
    from mlx_lm.models.cache import BatchKVCache

    joined, plain = _grown_by_one([t % 1000 for t in range(300)])
    batch = [type(c).merge([c]) for c in joined]
    want = [BatchKVCache.merge([p]) for p in plain]
    _decode_step(batch)
    _decode_step(want)
    for b, w in zip(batch, want, strict=True):
        for got_a, want_a in zip(b.keys_and_values(), w.keys_and_values(), strict=True):
            assert np.array_equal(np.array(got_a), np.array(want_a))
        assert b.offset.tolist() == w.offset.tolist() == [302]
        assert b.left_padding.tolist() == w.left_padding.tolist()
    assert same_state(joined, plain)  # the batch wrote on; the cache it came from did not change


def test_the_batch_hands_a_sequence_out_without_a_copy():
    tokens = [t % 1000 for t in range(1 << 16)]
    joined, plain = _grown_by_one(tokens)
    batch = [type(c).merge([c]) for c in joined]
    _decode_step(batch)  # the batch's buffer now has room to spare, as while generating
    _decode_step(plain)
    mx.eval([(b.keys, b.values) for b in batch])
    assert batch[0].keys.shape[2] > batch[0]._idx  # so a copy would not be a no-op
    before = _reset_peak()
    out = [b.extract(0) for b in batch]
    mx.eval([c.state for c in out])
    assert mx.get_peak_memory() - before < len(tokens) * BYTES_PER_TOKEN // 8
    assert same_state(out, plain)
    _decode_step(batch)  # the batch writes on; what was handed out stays as it was
    assert same_state(out, plain)


def test_a_fresh_cache_joins_the_batch_without_a_copy_and_is_stored_as_a_plain_one():
    from mlx_cache_server.prompt_cache.joined import FreshKVCache

    tokens = [t % 1000 for t in range((1 << 16) - 100)]  # room left in its last block
    plain = kv_cache(tokens)
    fresh = [FreshKVCache() for _ in plain]
    for layer in range(len(plain)):  # a prefill, as for a prompt with nothing cached
        fresh[layer].update_and_fetch(plain[layer].keys, plain[layer].values)
    mx.eval([c.state for c in fresh])
    cache = PromptCache()
    assert cache.insert("m", tokens, fresh)
    other = [7, 8, 9]
    assert cache.insert("m", other, kv_cache(other))  # one layout, whichever class filled it
    assert same_state(cache.fetch("m", tokens + [1]).cache, plain)
    before = _reset_peak()
    batch = [type(c).merge([c]) for c in fresh]
    del fresh  # nothing else may hold a layer, or the batch's first write copies its buffer
    _decode_step(batch)
    mx.eval([(b.keys, b.values) for b in batch])
    assert mx.get_peak_memory() - before < len(tokens) * BYTES_PER_TOKEN // 8


def test_a_cache_taken_out_of_a_batch_joins_one_again_without_a_copy():
    from mlx_cache_server.prompt_cache import as_fresh

    tokens = [t % 1000 for t in range((1 << 16) - 100)]  # room left in its last block
    plain = kv_cache(tokens)
    taken = [type(c)() for c in plain]  # as a batch's `extract` hands it out: plain layers
    for layer in range(len(plain)):
        taken[layer].update_and_fetch(plain[layer].keys, plain[layer].values)
    mx.eval([c.state for c in taken])
    again = as_fresh(taken)
    assert same_state(again, plain)
    del taken
    before = _reset_peak()
    batch = [type(c).merge([c]) for c in again]
    del again
    _decode_step(batch)
    mx.eval([(b.keys, b.values) for b in batch])
    assert mx.get_peak_memory() - before < len(tokens) * BYTES_PER_TOKEN // 8


def test_a_sequence_taken_out_of_a_batch_goes_on_in_its_free_slots_without_a_copy():
    from mlx_cache_server.prompt_cache import as_fresh

    tokens = [t % 1000 for t in range((1 << 16) - 100)]  # room left in its last block
    joined, plain = _grown_by_one(tokens)
    batch = [type(c).merge([c]) for c in joined]
    del joined
    _decode_step(batch)  # room to spare in the batch's buffer, as when a prompt is taken out
    _decode_step(plain)
    mx.eval([(b.keys, b.values) for b in batch])
    alone = as_fresh([b.extract(0) for b in batch])
    del batch  # the batch lets go of it, as `BatchGenerator.remove` does
    assert same_state(alone, plain)
    before = _reset_peak()
    _decode_step(alone)  # its next token, written into the free slots
    _decode_step(plain)
    mx.eval([c.state for c in alone])
    assert mx.get_peak_memory() - before < len(tokens) * BYTES_PER_TOKEN // 8
    assert same_state(alone, plain)
