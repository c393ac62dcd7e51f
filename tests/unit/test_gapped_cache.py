"""`GappedKVCache` against a plain model of it: each row a list of slots, a token's KV or a
gap, right-aligned at the batch's index. After every operation (a step's positions fed,
kept in part, the rest trimmed or left as gaps; a trim into gaps; rows filtered out; rows
joining; gaps closed up) each row hands out exactly its tokens' KV, its offset is their
number, and a step's mask sees exactly them."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_cache_server.mlx_adapter import gapped_cache
from mlx_cache_server.mlx_adapter.gapped_cache import GappedKVCache

H, D = 2, 3
GAP = None


def fresh(rng: random.Random, rows: int) -> tuple[BatchKVCache, list[list]]:
    """A batch cache of rows of random lengths, as prompts leave one, and its slots."""
    caches, slots = [], []
    for _ in range(rows):
        n = rng.randint(1, 9)
        kv = [np.random.default_rng(rng.randint(0, 2**31)).normal(size=(H, D)) for _ in range(n)]
        c = KVCache()
        stacked = mx.array(np.stack(kv, axis=1)[None].astype(np.float32))
        c.update_and_fetch(stacked, stacked * 2)
        caches.append(c)
        slots.append(kv)
    return BatchKVCache.merge(caches), slots


def check(cache: BatchKVCache, slots: list[list]) -> None:
    assert cache.left_padding.shape[0] == len(slots)
    offsets = cache.offset.tolist()
    mask = np.array(cache.make_mask(1)).reshape(len(slots), -1)
    assert mask.shape[1] == cache._idx + 1
    for i, row in enumerate(slots):
        held = [kv for kv in row if kv is not GAP]
        assert offsets[i] == len(held)
        got = cache.extract(i)
        want = np.stack(held, axis=1)[None] if held else np.zeros((1, H, 0, D))
        assert got.offset == len(held)
        np.testing.assert_allclose(np.array(got.keys), want, rtol=1e-6)
        np.testing.assert_allclose(np.array(got.values), want * 2, rtol=1e-6)
        seen = [False] * (cache._idx - len(row)) + [kv is not GAP for kv in row] + [True]
        assert mask[i].tolist() == seen


def step(cache: BatchKVCache, slots: list[list], rng: random.Random) -> BatchKVCache:
    """A verification step's bookkeeping: n positions fed, each row keeping its first few,
    the positions past the most any kept trimmed and the rest left as gaps."""
    n = rng.randint(1, 5)
    kv = np.random.default_rng(rng.randint(0, 2**31)).normal(size=(len(slots), H, n, D))
    fed = mx.array(kv.astype(np.float32))
    cache.update_and_fetch(fed, fed * 2)
    kept = [rng.randint(0, n) for _ in slots]
    most = max(kept)
    cache.trim(n - most)
    if most > min(kept):
        cache = GappedKVCache.of(cache)
        cache.leave([most - k for k in kept])
    for row, k, fed_row in zip(slots, kept, kv, strict=True):
        row += [fed_row[:, j] for j in range(k)] + [GAP] * (most - k)
    return cache


@pytest.mark.parametrize("seed", range(12))
def test_a_gapped_batch_holds_exactly_its_rows_tokens(seed, monkeypatch):
    rng = random.Random(seed)
    if seed % 2:  # close gaps up often
        monkeypatch.setattr(gapped_cache, "MIN_GAPS", 3)
        monkeypatch.setattr(gapped_cache, "GAP_SHARE", 0.0)
    cache, slots = fresh(rng, rng.randint(1, 4))
    for _ in range(30):
        op = rng.choice(["step", "step", "step", "trim", "filter", "extend", "compact"])
        if op == "step":
            cache = step(cache, slots, rng)
        elif op == "trim":  # may cut into gaps: they were never counted in `offset`
            t = rng.randint(0, min(3, min(len(r) for r in slots)))
            cache.trim(t)
            for row in slots:
                del row[len(row) - t :]
        elif op == "filter" and len(slots) > 1:
            keep = sorted(rng.sample(range(len(slots)), rng.randint(1, len(slots) - 1)))
            cache.filter(keep)
            slots = [slots[i] for i in keep]
        elif op == "extend" and len(slots) < 6:
            joining, their_slots = fresh(rng, rng.randint(1, 2))
            cache.extend(joining)
            slots += their_slots
        elif op == "compact" and isinstance(cache, GappedKVCache):
            cache.compact()
        if getattr(cache, "gaps", None) is None:  # closed up, here or when gaps were left
            slots = [[kv for kv in row if kv is not GAP] for row in slots]
        check(cache, slots)


def test_closing_gaps_up_leaves_a_batch_without_them():
    rng = random.Random(5)
    cache, slots = fresh(rng, 3)
    while not isinstance(cache, GappedKVCache) or cache.gaps is None:
        cache = step(cache, slots, rng)
    cache.compact()
    slots = [[kv for kv in row if kv is not GAP] for row in slots]
    assert cache.gaps is None and cache._idx == max(len(r) for r in slots)
    check(cache, slots)
