"""Use Debian's OpenBLAS for MLX's CPU matmuls when it is installed.

The `mlx[cpu]` wheel bundles the reference BLAS, many times slower for float32
prefill than OpenBLAS (bench/README.md, "The CPU path"). Our kernels for a decode
step's products (`native.py`) go in front of it. Both have to be loaded before MLX is,
so a process that lacks them re-executes itself once with LD_PRELOAD set; the user
never has to know. Only a library `native.library()` has checked against its digest goes
into LD_PRELOAD: a fault there kills the process before it can log a line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import native

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_DONE = "MLX_CACHE_SERVER_BLAS_CHECKED"
_WHY = "MLX_CACHE_SERVER_KERNELS_OFF"  # why the re-executed process has no kernels


def find_openblas() -> str | None:
    return next((p for p in CANDIDATES if Path(p).exists()), None)


def openblas_loaded() -> bool:
    """Whether the system OpenBLAS is mapped (numpy's own bundled copy does not count)."""
    lib = find_openblas()
    if lib is None:
        return False
    try:
        return str(Path(lib).resolve()) in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def preload(kernels: bool = True) -> list[str]:
    """What a process running MLX on this CPU preloads, in order: our kernels (unless
    `kernels` is False or they cannot be built), which hand what they do not compute to
    the BLAS after them, then OpenBLAS. Nothing without OpenBLAS, or off Linux."""
    openblas = find_openblas()
    if not sys.platform.startswith("linux") or openblas is None:
        return []
    lib = native.library() if kernels else None
    return [str(lib), openblas] if lib else [openblas]


def to_preload() -> list[str]:
    """`preload()`'s libraries if this process lacks one it could have, else nothing."""
    if os.environ.get(_DONE) or (openblas_loaded() and native.loaded() is not None):
        return []
    libs = preload()
    if len(libs) == 1 and openblas_loaded():  # the kernels cannot be built here
        return []
    return libs


def reexec_preloaded(argv: list[str]) -> None:
    """Replace this process by `argv` with `to_preload()`'s libraries, if that helps here."""
    libs = to_preload()
    if not libs:
        return
    env = dict(os.environ, **{_DONE: "1"})
    env.pop(_WHY, None)
    if native.problem:  # said in its log, without building again
        env[_WHY] = native.problem
    env["LD_PRELOAD"] = " ".join(p for p in (*libs, env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def describe() -> tuple[str, bool]:
    """Which BLAS serves MLX's CPU matmuls, and whether that is the fast one."""
    if sys.platform == "darwin":
        return "Accelerate", True
    if openblas_loaded():
        if native.loaded() is not None:
            return "OpenBLAS (preloaded), a decode step's products on our kernels", True
        # A re-executed child did not try the build itself: its parent said why, else
        # trying it finds the reason.
        why = native.problem or os.environ.get(_WHY)
        why = why or ("not preloaded" if native.library() else native.problem)
        return f"OpenBLAS (preloaded); our decode kernels are off ({why})", True
    return (
        "the reference BLAS bundled with mlx-cpu (slow; apt-get install libopenblas0-pthread)",
        False,
    )
