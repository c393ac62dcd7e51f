"""Our CPU kernels (`csrc/`), compiled on this machine the first time they are needed.

MLX's CPU backend compiles its fused kernels with the system's C compiler at run time;
these are built the same way, for the CPU at hand (`-march=native`), into a folder under
the user's cache keyed by the sources, the compiler and the CPU. No compiler, or a
failed build, leaves them out: MLX's own path runs, slower (`problem` says why).

The library goes in front of OpenBLAS in LD_PRELOAD (`blas.py`), where its
`cblas_sgemm` sees MLX's calls first (`csrc/gemm.c` says which it keeps): it needs the
BLAS loaded after it to hand the others to. Linux only: macOS has Accelerate.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCES = ("pool.c", "gemm.c", "attention.c")
HEADERS = ("pool.h", "vec.h")
NAME = "libmlx_cache_server_kernels.so"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-std=gnu11")
DISABLE = "MLX_CACHE_SERVER_NO_KERNELS"  # set: MLX's own path, as without a compiler

problem: str | None = None  # why the kernels are not built, once a build was tried


def _csrc() -> Path:
    return Path(__file__).parent / "csrc"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu() -> str:
    """What `-march=native` compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))  # the same for every core


def _key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((_csrc() / name).read_bytes())
    for part in (compiler, version, _cpu(), " ".join(FLAGS)):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-cache-server" / "kernels"


def library() -> Path | None:
    """The built library, building it if this machine has not yet; None if it cannot be
    (not Linux, turned off, no compiler, a failed build: `problem`)."""
    global problem
    if not sys.platform.startswith("linux"):
        problem = "not Linux"
        return None
    if os.environ.get(DISABLE):
        problem = f"{DISABLE} is set"
        return None
    compiler = _compiler()
    if compiler is None:
        problem = "no C compiler (install gcc, or set CC)"
        return None
    target = cache_root() / _key(compiler) / NAME
    if any(c in str(target) for c in " :"):
        problem = f"LD_PRELOAD cannot carry the path {target} (a space or colon in it)"
        return None
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    sources = [str(_csrc() / f) for f in SOURCES]
    cmd = [compiler, *FLAGS, "-o", str(partial), *sources, "-ldl"]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode != 0:
        problem = f"`{' '.join(cmd)}` failed: {built.stderr.strip()[-500:]}"
        partial.unlink(missing_ok=True)
        return None
    # Published whole and never replaced: a process starting beside this one that built
    # it too keeps its own copy, and one that already mapped this file keeps it.
    try:
        os.link(partial, target)
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    return target


def loaded() -> Path | None:
    """The kernels' library if this process has it mapped."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1].removesuffix(" (deleted)")  # cache cleared since
        if path.endswith("/" + NAME):
            return Path(path)
    return None
