"""Many threads on one PromptCache: invariants hold at every observed point and after."""

from __future__ import annotations

import random
import threading
import time

import mlx.core as mx

from mlx_cache_server.prompt_cache import PromptCache
from mlx_cache_server.prompt_cache.radix import iter_nodes
from tests.fakes import BYTES_PER_TOKEN, kv_cache, same_state
from tests.unit.test_prompt_cache_concurrent import assert_consistent

THREADS = 16
SECONDS = 3.0
BUDGET = 400 * BYTES_PER_TOKEN
PREFIXES = [[7] * 40, [7] * 20 + [8] * 20, [9] * 30]


def random_tokens(rng: random.Random) -> list[int]:
    return rng.choice(PREFIXES) + [rng.randrange(4) for _ in range(rng.randrange(1, 60))]


def worker(cache: PromptCache, seed: int, deadline: float, errors: list, counts: list) -> None:
    rng = random.Random(seed)
    ops = 0
    try:
        while time.monotonic() < deadline:
            model = rng.choice(["a", "b"])
            op = rng.random()
            tokens = random_tokens(rng)
            if op < 0.45:
                found = cache.fetch(model, tokens)
                if found.cache is not None:
                    assert same_state(found.cache, kv_cache(tokens[: found.n_cached]))
                    for layer in found.cache:  # scribble on our copy
                        layer.keys[..., :1, :] = -1.0
                        layer.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
            elif op < 0.85:
                cache.insert(model, tokens, kv_cache(tokens, spare=rng.randrange(8)))
            elif op < 0.9:
                cache.trim_to(n_sequences=rng.randrange(20), n_bytes=rng.randrange(BUDGET))
            elif op < 0.92:
                cache.clear(model)
            else:
                s = cache.stats()
                assert s.bytes <= BUDGET and s.sequences <= cache.max_sequences
            assert cache.nbytes <= BUDGET
            ops += 1
    except BaseException as e:  # reported by the main thread
        errors.append(e)
    counts.append(ops)


def test_sixteen_threads_hammering_one_cache():
    cache = PromptCache(max_sequences=24, max_bytes=BUDGET)
    deadline = time.monotonic() + SECONDS
    errors: list = []
    counts: list = []
    threads = [
        threading.Thread(target=worker, args=(cache, seed, deadline, errors, counts))
        for seed in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert len(counts) == THREADS and sum(counts) > THREADS * 10

    total = 0
    for model in cache.models():
        nodes = list(iter_nodes(cache._trees[model].root))
        model_bytes = sum(n.held.segment_nbytes for n in nodes)
        assert model_bytes == cache.stats(model).bytes
        assert all(n.pins == 0 for n in nodes)
        assert all(n.children or n.terminal for n in nodes)
        assert sum(n.terminal for n in nodes) == cache.stats(model).sequences
        total += model_bytes
    assert total == cache.nbytes <= BUDGET
    assert len(cache) == cache.stats().sequences <= 24


def test_inserts_and_flushes_from_two_threads_leave_nothing_unreachable():
    """The engine inserts while an admin flushes: after the last flush the cache is empty."""
    cache = PromptCache(max_sequences=64, max_bytes=200 * BYTES_PER_TOKEN)
    stop = time.monotonic() + 1.5
    failures = []

    def insert_forever():
        i = 0
        try:
            while time.monotonic() < stop:
                tokens = [i % 5, (i // 5) % 5, i % 3, 7]
                cache.insert("m", tokens, kv_cache(tokens))
                i += 1
        except Exception as e:  # surfaced below: a thread's exception is otherwise lost
            failures.append(e)

    writer = threading.Thread(target=insert_forever)
    writer.start()
    while time.monotonic() < stop:
        cache.clear()
    writer.join()
    cache.clear()
    assert not failures
    assert (len(cache), cache.nbytes) == (0, 0)
    assert_consistent(cache)
