"""Debian's OpenBLAS for MLX's CPU matmuls, where it is installed.

The `mlx[cpu]` wheel links the reference BLAS, many times slower for float32 prefill than
OpenBLAS (timed by a script no longer kept: bench/README.md as of c01f1a1, "The CPU
path"). MLX's library leaves `cblas_sgemm` to the dynamic linker, which looks in the
libraries loaded with global symbols before a library's own: OpenBLAS loaded that way
before `mlx.core` is imported serves MLX's matmuls. Loaded after, it does not (the linker
has bound MLX's library by then), so `use_openblas` runs before anything imports MLX
(`cli.py`) and refuses once it has been.

Nothing goes into the environment: no LD_PRELOAD, no re-execution, and a child process
starts with what its own command loads. Only on Linux, and only for MLX's CPU backend:
a CUDA build of MLX or macOS (Accelerate) loads nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
# MLX's CUDA backends, as the `mlx[cuda]` extras install them.
CUDA_DISTRIBUTIONS = ("mlx-cuda-12", "mlx-cuda-13", "mlx-cuda")

why_not: str | None = None  # why `use_openblas` loaded nothing, once it was called


def find_openblas() -> str | None:
    """The system's OpenBLAS: Debian's threaded build, else what the linker finds."""
    found = next((p for p in CANDIDATES if Path(p).exists()), None)
    return found or ctypes.util.find_library("openblas")


def openblas_loaded() -> bool:
    """Whether `cblas_sgemm`, looked up as MLX's library looks it up (the libraries with
    global symbols first), is the system OpenBLAS's (numpy's bundled copy does not count)."""
    lib = find_openblas()
    if lib is None or not sys.platform.startswith("linux"):
        return False
    try:
        first = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
        # RTLD_NOLOAD: only where it is mapped already; asking must not load it (and start
        # its threads) in a process that does not use it.
        loaded = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        ours = ctypes.cast(loaded.cblas_sgemm, ctypes.c_void_p).value
    except (AttributeError, OSError):  # no global cblas_sgemm, or OpenBLAS is not mapped
        return False
    return first == ours


def cuda_backend() -> str | None:
    """The installed distribution of MLX's CUDA backend, if any (read without importing
    MLX, which would be too late for OpenBLAS)."""
    for name in CUDA_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def use_openblas() -> bool:
    """Load OpenBLAS with its symbols global, for MLX's CPU matmuls, if this process can
    use it: Linux, MLX's CPU backend, OpenBLAS installed, MLX not imported yet. Whether it
    is loaded now (`why_not` says why not)."""
    global why_not
    why_not = _refusal()
    if why_not is None:
        try:  # where it is loaded already without global symbols, this makes them global
            ctypes.CDLL(find_openblas(), mode=os.RTLD_GLOBAL)
        except OSError as e:
            why_not = f"it does not load: {e}"
    return why_not is None


def _refusal() -> str | None:
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if (cuda := cuda_backend()) is not None:
        return f"MLX runs on CUDA ({cuda})"
    if find_openblas() is None:
        return "not installed (apt-get install libopenblas0-pthread)"
    if "mlx.core" in sys.modules and not openblas_loaded():
        return "MLX was imported before it"
    return None


def describe() -> tuple[str, bool]:
    """Which BLAS serves MLX's CPU matmuls, and whether that is the fast one."""
    if sys.platform == "darwin":
        return "Accelerate", True
    if openblas_loaded():
        return "OpenBLAS", True
    why = f" ({why_not})" if why_not else ""
    return f"the reference BLAS bundled with mlx-cpu{why}: slow", False
