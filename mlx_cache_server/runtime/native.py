"""Our CPU kernels (`csrc/`), compiled on this machine the first time they are needed.

MLX's CPU backend compiles its fused kernels with the system's C compiler at run time;
these are built the same way, for the CPU at hand (`-march=native`), into a folder under
the user's cache keyed by the sources, the compiler and the CPU (`kernel_cache.py`: ours
alone, published whole, each library checked against its digest before it is loaded).
Each compiler run is bounded in time (`BUILD_SECONDS`), its process group killed past it.
No compiler, a failed or stopped build, or a cache that cannot be used or written leaves
them out, and never stops a start: MLX's own path runs, slower (`problem` says why).

The library goes in front of OpenBLAS in LD_PRELOAD (`blas.py`), where its
`cblas_sgemm` sees MLX's calls first (`csrc/gemm.c` says which it keeps): it needs the
BLAS loaded after it to hand the others to. Linux only: macOS has Accelerate.

`layers()` builds the other half, `csrc/layers.cpp`: MLX primitives, a Python extension
module compiled with the C++ compiler against MLX's headers and library, which the wheel
ships, and nanobind, which MLX's Python module is built with (the extension shares its
types: it takes and returns `mx.array`). It needs no preloading.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from . import kernel_cache

SOURCES = ("pool.c", "gemm.c", "attention.c")
HEADERS = ("pool.h", "vec.h", "attention.h")
NAME = "libmlx_cache_server_kernels.so"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-std=gnu11")
DISABLE = "MLX_CACHE_SERVER_NO_KERNELS"  # set: MLX's own path, as without a compiler
BUILD_SECONDS = "MLX_CACHE_SERVER_KERNEL_BUILD_SECONDS"  # the most one compiler run may take
DEFAULT_BUILD_SECONDS = 300.0

problem: str | None = None  # why the kernels are not built, once a build was tried

LAYERS = "layers.cpp"
LAYERS_SOURCES = (LAYERS, "block.cpp")  # one extension module; its headers below
LAYERS_HEADERS = ("layers.h", "attention.h")
LAYERS_MODULE = "_mlxcs_layers"  # NB_MODULE's name in it
LAYERS_FLAGS = (
    "-O2", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
    "-fno-strict-aliasing", "-ffp-contract=off", "-DNB_DOMAIN=mlx", "-DNDEBUG",
    "-DNB_COMPACT_ASSERTIONS",
)  # fmt: skip
layers_problem: str | None = None  # why `layers()` has no module, once it was asked for
_layers: ModuleType | None | bool = None  # False: asked for, and not to be had


def _csrc() -> Path:
    return Path(__file__).parent / "csrc"


def _compiler(variable: str, default: str, fallback: str) -> str | None:
    """The compiler `variable` names (`CC`, `CXX`), else `default`, else `fallback`."""
    return shutil.which(os.environ.get(variable, default)) or shutil.which(fallback)


def _refused() -> str | None:
    """Why nothing is built in this process at all, if so."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.environ.get(DISABLE):
        return f"{DISABLE} is set"
    return None


def _cpu() -> str:
    """What `-march=native` compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))  # the same for every core


def _key(compiler: str, files: tuple[str, ...], parts: tuple[str, ...]) -> str:
    version = _run([compiler, "--version"])
    digest = hashlib.sha256()
    for name in files:
        digest.update((_csrc() / name).read_bytes())
    for part in (compiler, version, _cpu(), *parts):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


class BuildFailed(Exception):
    """Why a compiler run did not give a library."""


def build_seconds() -> float:
    """How long one compiler run may take (`BUILD_SECONDS` in the environment)."""
    try:
        return float(os.environ.get(BUILD_SECONDS) or DEFAULT_BUILD_SECONDS)
    except ValueError:
        return DEFAULT_BUILD_SECONDS


def _run(cmd: list[str]) -> str:
    """Run `cmd` in a process group of its own and return its output; `BuildFailed` if it
    fails or runs past `build_seconds()`. A run cut short (timed out, or this process
    interrupted) has its whole group killed: no compiler's child outlives the start."""
    seconds = build_seconds()
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        raise BuildFailed(f"`{cmd[0]}` does not run: {e.strerror or e}") from e
    try:
        out, err = proc.communicate(timeout=seconds)
    except BaseException as e:
        # Not reaped yet, so its process group is still its own to kill.
        with contextlib.suppress(ProcessLookupError):  # the group may have ended by itself
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise BuildFailed(
                f"`{cmd[0]}` ran past {seconds:g} s ({BUILD_SECONDS}): stopped"
            ) from None
        raise
    if proc.returncode != 0:
        raise BuildFailed(f"`{' '.join(cmd)}` failed: {err.strip()[-500:]}")
    return out


def _built(key: str, name: str, command: Callable[[Path], list[str]]) -> Path:
    """`key`'s library `name` from the kernel cache, verified, compiled by `command(path)`
    first if it is not there whole. `BuildFailed` or `kernel_cache.Unusable` say why not."""
    found = kernel_cache.find(key, name)
    if found is not None:
        return found
    try:
        staged = kernel_cache.staging(key)
        try:
            _run(command(staged / name))
            published = kernel_cache.publish(staged, key, name)
        finally:
            kernel_cache.discard(staged)  # gone already where it was published
    except OSError as e:  # a read-only cache home, a full disk: MLX's own path
        where = e.filename or kernel_cache.base()
        raise kernel_cache.Unusable(
            f"the kernel cache cannot be written ({where}): {e.strerror or e}"
        ) from e
    if published is None:
        raise BuildFailed(f"{name} does not match its digest once built")
    return published


def library() -> Path | None:
    """The built library, building it if this machine has not yet; None if it cannot be
    (not Linux, turned off, no compiler, a failed build: `problem`)."""
    global problem
    problem = _refused()
    if problem:
        return None
    compiler = _compiler("CC", "cc", "gcc")
    if compiler is None:
        problem = "no C compiler (install gcc, or set CC)"
        return None
    sources = [str(_csrc() / f) for f in SOURCES]
    try:
        key = _key(compiler, SOURCES + HEADERS, FLAGS)
        if any(c in str(kernel_cache.root()) for c in " :"):
            problem = f"LD_PRELOAD cannot carry the path {kernel_cache.root()} (a space or colon)"
            return None
        return _built(key, NAME, lambda out: [compiler, *FLAGS, "-o", str(out), *sources, "-ldl"])
    except (BuildFailed, kernel_cache.Unusable, OSError) as e:
        problem = str(e)
        return None


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


def layers() -> ModuleType | None:
    """The extension module of `csrc/layers.cpp`, built if this machine has not yet; None
    if it cannot be (`layers_problem` says why)."""
    global _layers
    if _layers is None:
        _layers = _load_layers() or False
    return _layers or None


def _load_layers() -> ModuleType | None:
    global layers_problem
    layers_problem = _refused()
    if layers_problem:
        return None
    compiler = _compiler("CXX", "c++", "g++")
    try:
        import mlx
        import mlx.core as mx
        import nanobind
    except ImportError as e:
        layers_problem = f"{e.name} is not installed"
        return None
    if compiler is None:
        layers_problem = "no C++ compiler (install g++, or set CXX)"
        return None
    mlx_dir = Path(mlx.__path__[0])
    nb = Path(nanobind.source_dir()).parent
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    versions = (mx.__version__, nanobind.__version__, sys.version, *LAYERS_FLAGS)
    includes = [nb / "include", nb / "ext" / "robin_map" / "include", mlx_dir / "include"]

    def command(out: Path) -> list[str]:
        return [
            compiler, *LAYERS_FLAGS, *(f"-I{d}" for d in includes),
            f"-I{sysconfig.get_paths()['include']}", "-o", str(out),
            str(nb / "src" / "nb_combined.cpp"), *(str(_csrc() / f) for f in LAYERS_SOURCES),
            f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        ]  # fmt: skip

    try:
        key = _key(compiler, (*LAYERS_SOURCES, *LAYERS_HEADERS), versions)
        target = _built(key, LAYERS_MODULE + suffix, command)
    except (BuildFailed, kernel_cache.Unusable, OSError) as e:
        layers_problem = str(e)
        return None
    spec = importlib.util.spec_from_file_location(LAYERS_MODULE, target)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        with mx.stream(mx.cpu):
            module.rms_norm(mx.ones((1, 2)), mx.ones((2,)), 1e-5)
    except ImportError as e:
        layers_problem = f"{target} does not load: {e}"
        return None
    except TypeError:  # nanobind did not match its `mx.array` argument to MLX's type
        layers_problem = (
            f"MLX {mx.__version__} was built with a nanobind other than "
            f"{nanobind.__version__}'s internals: install the nanobind its release used"
        )
        return None
    return module
