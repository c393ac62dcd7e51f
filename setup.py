"""Builds our CPU kernels (`mlx_cache_server/runtime/csrc`) when the package is installed.

One extension module per instruction set (AVX-512, AVX2, a portable build; aarch64's
baseline), each a whole module named for its variant; `runtime/native.py` imports the
best one the CPU runs. They are built against MLX's headers and library and nanobind, as
MLX documents its extensions, from the build requirements in `pyproject.toml`; a module
records the MLX it was built against, and is not used with another.

Every module is optional: with no compiler, or off Linux, the package installs without
them and the server runs on MLX's own path (its log says so).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

CSRC = Path("mlx_cache_server/runtime/csrc")
C_SOURCES = ("pool.c", "gemm.c", "attention.c")
CXX_SOURCES = ("layers.cpp", "block.cpp")
# The C kernels keep GCC's contraction of a product and a sum into one fused multiply-add
# where the instruction set has it (the AVX2 and AVX-512 builds): a variant's bits differ
# from another's in the last place, and a machine always imports the same variant, so a
# row gets the same bits run to run, alone or in a batch. The C++ primitives, which must
# give MLX's own bits, are built without it.
C_FLAGS = ["-O3", "-pthread", "-std=gnu11", "-g0"]
CXX_FLAGS = [
    "-O2", "-std=c++20", "-fvisibility=hidden", "-fno-strict-aliasing", "-ffp-contract=off",
    "-DNB_DOMAIN=mlx", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS", "-g0",
]  # fmt: skip


def variants() -> dict[str, str]:
    """Each module's name suffix and the `-march` it is compiled for, on this platform."""
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux"):
        return {}  # macOS runs on Accelerate and Metal: nothing of ours to build
    if machine in ("x86_64", "amd64"):
        return {"x86_64_v4": "x86-64-v4", "x86_64_v3": "x86-64-v3", "x86_64": "x86-64"}
    if machine in ("aarch64", "arm64"):
        return {"aarch64": "armv8-a"}
    return {}


class BuildKernels(build_ext):
    """Compiles each variant's module from the same sources with its own `-march`, the
    nanobind runtime once for all of them."""

    def build_extension(self, ext: Extension) -> None:
        try:
            import mlx
            import mlx.core as mx
            import nanobind
        except ImportError as e:  # a build without the build requirements: no kernels
            raise CompileError(f"{e.name} is not installed") from e
        march = ext.march
        mlx_dir = Path(mlx.__path__[0])
        nb = Path(nanobind.source_dir()).parent
        includes = [
            str(nb / "include"), str(nb / "ext" / "robin_map" / "include"),
            str(mlx_dir / "include"), str(CSRC),
        ]  # fmt: skip
        build = Path(self.build_temp) / ext.name
        nb_object = self._nanobind_object(nb, includes)
        c_objects = self.compiler.compile(
            [str(CSRC / f) for f in C_SOURCES], output_dir=str(build),
            extra_postargs=[*C_FLAGS, f"-march={march}"],
        )  # fmt: skip
        name = ext.name.rsplit(".", 1)[-1]
        built_with = f"mlx {mx.__version__} nanobind {nanobind.__version__}"
        cxx_objects = self.compiler.compile(
            [str(CSRC / f) for f in CXX_SOURCES], output_dir=str(build),
            include_dirs=[*includes, self._python_include()],
            macros=[("MLXCS_MODULE", name), ("MLXCS_BUILT_WITH", f'"{built_with}"')],
            extra_postargs=[*CXX_FLAGS, f"-march={march}"],
        )  # fmt: skip
        self.compiler.link_shared_object(
            [*c_objects, *cxx_objects, nb_object], self.get_ext_fullpath(ext.name),
            library_dirs=[str(mlx_dir / "lib")], libraries=["mlx"],
            # MLX's library is the one `import mlx.core` loaded (its soname), found beside
            # the installed package otherwise.
            runtime_library_dirs=["$ORIGIN/../../mlx/lib"],
            extra_postargs=["-pthread", "-Wl,--as-needed"], target_lang="c++",
        )  # fmt: skip

    def _nanobind_object(self, nb: Path, includes: list[str]) -> str:
        if not hasattr(self, "_nb_object"):
            (self._nb_object,) = self.compiler.compile(
                [str(nb / "src" / "nb_combined.cpp")], output_dir=self.build_temp,
                include_dirs=[*includes, self._python_include()], extra_postargs=CXX_FLAGS,
            )  # fmt: skip
        return self._nb_object

    @staticmethod
    def _python_include() -> str:
        import sysconfig

        return sysconfig.get_paths()["include"]


def kernel_modules() -> list[Extension]:
    modules = []
    for suffix, march in variants().items():
        sources = [str(CSRC / f) for f in (*C_SOURCES, *CXX_SOURCES)]  # for sdists and deps
        ext = Extension(
            f"mlx_cache_server.runtime._kernels_{suffix}", sources=sources,
            depends=[str(p) for p in CSRC.glob("*.h")], language="c++", optional=True,
        )  # fmt: skip
        ext.march = march
        modules.append(ext)
    return modules


setup(ext_modules=kernel_modules(), cmdclass={"build_ext": BuildKernels})
