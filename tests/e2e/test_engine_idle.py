"""Memory goes back to the system: pooled memory after a pause, freed heap pages at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest

from mlx_cache_server.engine import Failed, Finished, SamplingParams
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.runtime import memory
from mlx_cache_server.settings import Settings
from tests.helpers import FakeClock, wait_until


def finish(engine, prompt: list[int]) -> None:
    """Run one request to its end, and until the engine has gone idle after it."""
    done = threading.Event()

    def emit(event) -> None:
        if isinstance(event, Finished | Failed):
            done.set()

    engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0), emit)
    assert done.wait(60)
    wait_until(lambda: engine.running == 0)


def test_memory_is_released_once_idle(tiny_model_dir, monkeypatch):
    released: list[float] = []
    engine = build_engine(Settings(), str(tiny_model_dir))

    def release() -> None:  # this engine's releases: an earlier test's may still be winding down
        if threading.current_thread() is engine.runner.thread:
            released.append(1.0)

    monkeypatch.setattr(memory, "release_memory", release)
    engine.clock = clock = FakeClock()
    engine.release_after = 2.0
    prompt = engine.tokenizer.encode("hello there, how are you?")
    engine.start()
    try:
        for _ in range(3):
            finish(engine, prompt)
            clock.advance(1.0)  # the next request comes within the pause
        time.sleep(0.3)  # several idle ticks of the engine, at the same time on its clock
        assert released == []  # requests came back to back: keep the buffers
        clock.advance(1.5)
        wait_until(lambda: released)
        time.sleep(0.3)
        assert released == [1.0]  # one release per pause, not one per idle tick
        finish(engine, prompt)
        clock.advance(2.5)
        wait_until(lambda: len(released) == 2)
    finally:
        engine.stop()


def test_the_heap_is_trimmed_each_time_the_engine_goes_idle(tiny_model_dir, monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(1))
    engine = build_engine(Settings(), str(tiny_model_dir))
    engine.release_after = 60.0  # the full release (MLX's pool too) does not come into it
    prompt = engine.tokenizer.encode("hello there, how are you?")
    engine.start()
    try:
        for n in range(1, 4):
            finish(engine, prompt)
            wait_until(lambda n=n: len(trims) >= n, seconds=10)
            assert len(trims) == n  # at once, one per request that left the engine idle
    finally:
        engine.stop()


FREE_AND_MEASURE = r"""
import ctypes, sys
from mlx_cache_server.runtime.memory import trim_heap

block, count, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    status = open("/proc/self/status").read().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) << 10

blocks = [libc.malloc(block) for _ in range(count)]
for p in blocks:
    ctypes.memset(p, 1, block)
before = rss()
for p in blocks[:-1]:  # the last one stays, as a cache segment would, so the heap cannot shrink
    libc.free(p)
if how == "trim":
    trim_heap()
print((before - rss()) >> 20)
"""


def probe(script: str, *args: object) -> int:
    """Run `script` in a fresh process (allocator settings are process-wide); its last number."""
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def returned_mib(block: int, count: int, how: str) -> int:
    """MiB of RSS a fresh process gets back after freeing all but the last of `count` blocks."""
    return probe(FREE_AND_MEASURE, block, count, how)


@pytest.mark.skipif(memory._libc is None, reason="glibc only")
def test_trimming_returns_freed_heap_pages_to_the_system():
    # Blocks the size of a cache segment come from the heap (under glibc's mmap threshold).
    assert returned_mib(64 << 10, 1024, "trim") >= 56  # 64 MiB freed
    assert returned_mib(64 << 10, 1024, "neither") <= 8  # what the trim changes: glibc keeps them


POOLED_AFTER_FREE = r"""
import sys
import mlx.core as mx
from mlx_cache_server.runtime.memory import limit_buffer_pool

if sys.argv[1] == "limit":
    assert limit_buffer_pool(4 << 20)
a = mx.arange(8 << 20, dtype=mx.float32)  # 32 MiB, the size of a long prefill's activations
mx.eval(a)
del a
print(mx.get_cache_memory())
"""


@pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="limited on the CPU only")
def test_the_cpu_buffer_pool_keeps_at_most_its_limit():
    assert probe(POOLED_AFTER_FREE, "limit") <= 4 << 20
    assert probe(POOLED_AFTER_FREE, "default") >= 32 << 20  # what the limit changes: all kept


HELD_AFTER_A_REQUEST = r"""
import os, sys, threading, time
import mlx.core as mx
from mlx_cache_server.engine import Failed, Finished, SamplingParams
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.helpers import FakeClock, wait_until

engine = build_engine(Settings(), sys.argv[1])
prompt = engine.tokenizer.encode("hello there, how are you? " * 80)
engine.start()
before = mx.get_active_memory()
done = threading.Event()
def emit(event):
    if isinstance(event, Finished | Failed):
        done.set()
engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0), emit)
assert done.wait(60)
while engine.running:  # zero once the step that finished it has returned
    time.sleep(0.01)
time.sleep(0.2)
held = mx.get_active_memory() - before - engine.cache.nbytes
engine.stop()
print(len(prompt), 100 * held // engine.cache.nbytes, flush=True)
os._exit(0)  # MLX's threads can abort interpreter teardown (see mlx_cache_server.cli)
"""


def test_an_idle_engine_holds_no_kv_beyond_what_the_cache_stores(tiny_model_dir):
    # The finished request's KV is in the cache (copied); its own copy must be gone,
    # or the next request's peak carries one conversation's KV over the cache's budget.
    held_percent = probe(HELD_AFTER_A_REQUEST, tiny_model_dir)
    assert held_percent <= 10
