"""Our CPU kernels (`csrc/`), built when the package was installed (`setup.py`).

One extension module per instruction set, each the whole set of MLX primitives
(`csrc/layers.cpp`, `csrc/block.cpp`) with the C kernels they call (a decode step's
products, `csrc/gemm.c`; a few queries' attention, `csrc/attention.c`) built in:
`_kernels_x86_64_v4` (AVX-512), `_kernels_x86_64_v3` (AVX2 and FMA), `_kernels_x86_64`
(any x86-64), `_kernels_aarch64`. `layers()` imports the first this CPU runs. Nothing is
compiled here, and nothing of ours is preloaded: the module is a Python extension like
any other, imported when the server asks for it (never on a GPU device or with the CPU
fast path off: `models/engine_build.py`).

A module is used only with the MLX it was built against (its C++ headers have no stable
ABI) and with MLX's own nanobind internals (it takes and returns `mx.array`); where
there is none, or it does not fit, the server runs on MLX's own path, slower, and
`problem` says why.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

DISABLE = "MLX_CACHE_SERVER_NO_KERNELS"  # set: MLX's own path, as without the modules

# The x86-64 levels' CPU flags as /proc/cpuinfo names them (the psABI's lists, less
# what every CPU of the level has anyway).
X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

problem: str | None = None  # why `layers()` has no module, once it was asked for
variant: str | None = None  # the module's name suffix, once one was imported
_module: ModuleType | None | bool = None  # False: asked for, and not to be had


def variants(machine: str, flags: set[str]) -> list[str]:
    """The modules' name suffixes a CPU of this machine and flags runs, best first."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        levels = [("x86_64_v4", X86_64_V4), ("x86_64_v3", X86_64_V3), ("x86_64", set())]
        return [name for name, needs in levels if needs <= flags]
    if machine in ("aarch64", "arm64"):
        return ["aarch64"]
    return []


def cpu_flags() -> set[str]:
    """The CPU's flags, as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def layers() -> ModuleType | None:
    """The kernels' module for this CPU, imported once; None where there is none to use
    (`problem` says why)."""
    global _module
    if _module is None:
        _module = _load() or False
    return _module or None


def _load() -> ModuleType | None:
    global problem, variant
    if not sys.platform.startswith("linux"):
        problem = "not Linux"
        return None
    if os.environ.get(DISABLE):
        problem = f"{DISABLE} is set"
        return None
    import mlx.core as mx  # first: the module links MLX's library, loaded by this import

    names = variants(platform.machine(), cpu_flags())
    problem = f"no kernels for {platform.machine()}" if not names else None
    for suffix in names:
        try:
            module = importlib.import_module(f"{__package__}._kernels_{suffix}")
        except ImportError as e:
            problem = problem or _missing(e)
            continue
        checked = _checked(module, mx)
        variant = suffix if checked is not None else None
        return checked
    return None


def _missing(e: ImportError) -> str:
    if isinstance(e, ModuleNotFoundError):
        return "not built when the package was installed (no C++ compiler then?)"
    return f"it does not load: {e}"


def _checked(module: ModuleType, mx: ModuleType) -> ModuleType | None:
    """`module` if it fits the MLX of this process; else None, `problem` saying why."""
    global problem
    built = module.built_with()
    if built.split()[1] != mx.__version__:
        problem = (
            f"built against {built}, running MLX {mx.__version__}: reinstall the package "
            "against this MLX (pip install --force-reinstall --no-cache-dir, with "
            "PIP_CONSTRAINT naming the file that pins MLX)"
        )
        return None
    try:
        with mx.stream(mx.cpu):
            module.rms_norm(mx.ones((1, 2)), mx.ones((2,)), 1e-5)
    except TypeError:  # nanobind did not match its `mx.array` argument to MLX's type
        problem = f"built against {built}, whose nanobind internals MLX does not share"
        return None
    problem = None
    return module
