"""Memory goes back to the system: pooled memory after a pause, freed heap pages at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import app.engine as engine_module
from app.engine import Failed, Finished, SamplingParams
from app.server import build_engine
from app.settings import Settings


def finish(engine, prompt: list[int]) -> None:
    done = threading.Event()

    def emit(event) -> None:
        if isinstance(event, Finished | Failed):
            done.set()

    engine.submit(prompt, SamplingParams(max_tokens=4, temperature=0), emit)
    assert done.wait(60)


def test_memory_is_released_once_idle(tiny_model_dir, monkeypatch):
    released: list[float] = []
    monkeypatch.setattr(engine_module, "_release_memory", lambda: released.append(1.0))
    engine = build_engine(Settings(), str(tiny_model_dir))
    engine.release_after = 1.0
    prompt = engine.tokenizer.encode("hello there, how are you?")
    engine.start()
    try:
        for _ in range(3):
            finish(engine, prompt)
        assert released == []  # the next request came at once: keep the buffers
        time.sleep(2.5)
        assert released == [1.0]  # one release per pause, not one per idle tick
        finish(engine, prompt)
        time.sleep(2.5)
        assert len(released) == 2
    finally:
        engine.stop()


def test_the_heap_is_trimmed_each_time_the_engine_goes_idle(tiny_model_dir, monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(engine_module, "_trim_heap", lambda: trims.append(1))
    engine = build_engine(Settings(), str(tiny_model_dir))
    engine.release_after = 60.0  # the full release (MLX's pool too) does not come into it
    prompt = engine.tokenizer.encode("hello there, how are you?")
    engine.start()
    try:
        for n in range(1, 4):
            finish(engine, prompt)
            deadline = time.monotonic() + 10
            while len(trims) < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(trims) == n  # at once, one per request that left the engine idle
    finally:
        engine.stop()


FREE_AND_MEASURE = r"""
import ctypes, sys
from app.engine import _trim_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    status = open("/proc/self/status").read().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) << 10

# Blocks under glibc's mmap threshold come from the heap, as KV buffers do once
# glibc has raised its threshold.
blocks = [libc.malloc(64 << 10) for _ in range(1024)]
for p in blocks:
    ctypes.memset(p, 1, 64 << 10)
for p in blocks[:-1]:  # the last one stays, as a cache segment would, so the heap cannot shrink
    libc.free(p)
before = rss()
if sys.argv[1] == "trim":
    _trim_heap()
print((before - rss()) >> 20)
"""


@pytest.mark.skipif(engine_module._libc is None, reason="glibc only")
@pytest.mark.parametrize("mode", ["trim", "no trim"])
def test_trimming_returns_freed_heap_pages_to_the_system(mode):
    out = subprocess.run(
        [sys.executable, "-c", FREE_AND_MEASURE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    returned_mib = int(out.stdout.split()[-1])
    if mode == "trim":
        assert returned_mib >= 56  # 64 MiB freed
    else:  # what the trim changes: glibc keeps them
        assert returned_mib <= 8


UNMAP_AND_MEASURE = r"""
import ctypes, sys
from app.engine import unmap_large_blocks

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    status = open("/proc/self/status").read().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) << 10

if sys.argv[1] == "pinned":
    assert unmap_large_blocks()
libc.free(libc.malloc(2 << 20))  # unpinned, glibc now serves 2 MiB blocks from its heap
blocks = [libc.malloc(2 << 20) for _ in range(32)]
for p in blocks:
    ctypes.memset(p, 1, 2 << 20)
before = rss()
for p in blocks[:-1]:  # the last one stays, as a cache segment would
    libc.free(p)
print((before - rss()) >> 20)
"""


@pytest.mark.skipif(engine_module._libc is None, reason="glibc only")
@pytest.mark.parametrize("mode", ["pinned", "default"])
def test_freed_large_blocks_go_back_to_the_system_at_once(mode):
    out = subprocess.run(
        [sys.executable, "-c", UNMAP_AND_MEASURE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    returned_mib = int(out.stdout.split()[-1])
    if mode == "pinned":
        assert returned_mib >= 56  # 62 MiB freed
    else:  # what the pin changes: glibc keeps them until trimmed
        assert returned_mib <= 8
