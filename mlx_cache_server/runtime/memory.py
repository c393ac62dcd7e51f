"""How freed memory goes back to the system: glibc's heaps and MLX's buffer pool.

glibc's mmap threshold is left to adapt as glibc does by default. Pinned low, every
multi-MiB block (a batch's KV, a long chunk's activations) is mapped afresh and
freed to the system at once: peak RSS fell, but each prefill chunk faulted its
activations in anew and a long prompt prefilled markedly slower. Heaps are trimmed
when the engine idles instead. `python -m bench multiturn` and `python -m bench models`
measure the peak and idle RSS these settings give (docs/performance.md, "Memory"); the
prefill timings of each threshold came from a script no longer kept (bench/README.md as of
c01f1a1, "Memory" and "glibc's mmap threshold and long prompts").
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx


def release_memory() -> None:
    """Idle for a while: hand pooled memory back to the system.

    MLX pools freed buffers, and glibc keeps freed heap pages; both would hold a
    busy hour's peak for as long as the server lives.
    """
    mx.clear_cache()
    trim_heap()


def trim_heap() -> None:
    """Return freed heap pages to the system, keeping MLX's pool.

    Pages freed between the cache's long-lived segments stay resident until
    trimmed. The pool is reused by the next request as it is, so this is cheap
    enough to run whenever the engine goes idle.
    """
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def limit_buffer_pool(limit: int = 4 << 20) -> bool:
    """On MLX's CPU backend, pool at most `limit` bytes of freed buffers.

    MLX keeps freed buffers for reuse, by default up to its memory limit; between
    requests that pool held one prefill's activations on top of the cache's
    budget. On the CPU, malloc serves a fresh buffer nearly as fast. Metal and
    CUDA, where a fresh buffer costs a driver call and which were not measured,
    keep MLX's default. False if not on the CPU.
    """
    if mx.default_device().type != mx.cpu:
        return False
    mx.set_cache_limit(limit)
    return True


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@functools.cache
def machine_memory() -> int | None:
    """The memory this process may use: the machine's RAM, or a container's (cgroup) limit
    where that is less; None where neither can be read."""
    try:
        found = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (ValueError, OSError, AttributeError):
        found = []
    for limit in CGROUP_LIMITS:
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            found.append(int(text))
    found = [n for n in found if n > 0]
    return min(found) if found else None
