"""Use Debian's OpenBLAS for MLX's CPU matmuls when it is installed.

The `mlx[cpu]` wheel bundles the reference BLAS, many times slower for float32
prefill than OpenBLAS (bench/README.md, "The CPU path"). The library has
to be loaded before MLX is, so a process that lacks it re-executes
itself once with LD_PRELOAD set; the user never has to know.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_DONE = "MLX_CACHE_SERVER_BLAS_CHECKED"


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


def openblas_to_preload() -> str | None:
    """The OpenBLAS library this process should be re-executed with, if any."""
    if not sys.platform.startswith("linux") or os.environ.get(_DONE) or openblas_loaded():
        return None
    return find_openblas()


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process by `argv` with OpenBLAS preloaded, if that helps here."""
    lib = openblas_to_preload()
    if lib is None:
        return
    env = dict(os.environ, **{_DONE: "1"})
    env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def describe() -> tuple[str, bool]:
    """Which BLAS serves MLX's CPU matmuls, and whether that is the fast one."""
    if sys.platform == "darwin":
        return "Accelerate", True
    if openblas_loaded():
        return "OpenBLAS (preloaded)", True
    return (
        "the reference BLAS bundled with mlx-cpu (slow; apt-get install libopenblas0-pthread)",
        False,
    )
