"""Our CPU kernels (`csrc/`), compiled on this machine the first time they are needed.

MLX's CPU backend compiles its fused kernels with the system's C compiler at run time;
these are built the same way, for the CPU at hand (`-march=native`), into a folder under
the user's cache keyed by the sources, the compiler and the CPU. No compiler, or a
failed build, leaves them out: MLX's own path runs, slower (`problem` says why).

The library goes in front of OpenBLAS in LD_PRELOAD (`blas.py`), where its
`cblas_sgemm` sees MLX's calls first (`csrc/gemm.c` says which it keeps): it needs the
BLAS loaded after it to hand the others to. Linux only: macOS has Accelerate.

`layers()` builds the other half, `csrc/layers.cpp`: MLX primitives, a Python extension
module compiled with the C++ compiler against MLX's headers and library, which the wheel
ships, and nanobind, which MLX's Python module is built with (the extension shares its
types: it takes and returns `mx.array`). It needs no preloading.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

SOURCES = ("pool.c", "gemm.c", "attention.c")
HEADERS = ("pool.h", "vec.h", "attention.h")
NAME = "libmlx_cache_server_kernels.so"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-std=gnu11")
DISABLE = "MLX_CACHE_SERVER_NO_KERNELS"  # set: MLX's own path, as without a compiler

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
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for name in files:
        digest.update((_csrc() / name).read_bytes())
    for part in (compiler, version, _cpu(), *parts):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _build(cmd: list[str], partial: Path, target: Path) -> str | None:
    """Run the compiler's `cmd`, which writes `partial`, and publish it as `target`; what
    went wrong, if anything."""
    target.parent.mkdir(parents=True, exist_ok=True)
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        return f"`{' '.join(cmd)}` failed: {built.stderr.strip()[-500:]}"
    # Published whole and never replaced: a process starting beside this one that built
    # it too keeps its own copy, and one that already mapped this file keeps it.
    try:
        os.link(partial, target)
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    return None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-cache-server" / "kernels"


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
    target = cache_root() / _key(compiler, SOURCES + HEADERS, FLAGS) / NAME
    if any(c in str(target) for c in " :"):
        problem = f"LD_PRELOAD cannot carry the path {target} (a space or colon in it)"
        return None
    if target.exists():
        return target
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    sources = [str(_csrc() / f) for f in SOURCES]
    problem = _build([compiler, *FLAGS, "-o", str(partial), *sources, "-ldl"], partial, target)
    return None if problem else target


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
    key = _key(compiler, (*LAYERS_SOURCES, *LAYERS_HEADERS), versions)
    target = cache_root() / key / (LAYERS_MODULE + suffix)
    if not target.exists():
        partial = target.with_name(f"{LAYERS_MODULE}.{os.getpid()}.tmp")
        includes = [nb / "include", nb / "ext" / "robin_map" / "include", mlx_dir / "include"]
        cmd = [
            compiler, *LAYERS_FLAGS, *(f"-I{d}" for d in includes),
            f"-I{sysconfig.get_paths()['include']}", "-o", str(partial),
            str(nb / "src" / "nb_combined.cpp"), *(str(_csrc() / f) for f in LAYERS_SOURCES),
            f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        ]  # fmt: skip
        layers_problem = _build(cmd, partial, target)
        if layers_problem:
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
