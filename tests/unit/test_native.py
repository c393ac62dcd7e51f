"""Which kernels' module a process imports (`runtime/native.py`): the best its CPU runs,
built against its MLX, else none and the reason."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import types

import mlx.core as mx
import pytest

from mlx_cache_server.runtime import native

PACKAGE = "mlx_cache_server.runtime"
EXPECT = "MLX_CACHE_SERVER_EXPECT_KERNELS"  # set: the kernels must have been built
AVX2 = native.X86_64_V3 | {"sse4_2"}
AVX512 = native.X86_64_V4 | {"sse4_2"}


@pytest.mark.parametrize(
    "machine,flags,expected",
    [
        ("x86_64", AVX512, ["x86_64_v4", "x86_64_v3", "x86_64"]),
        ("x86_64", AVX2, ["x86_64_v3", "x86_64"]),
        ("x86_64", AVX2 - {"fma"}, ["x86_64"]),
        ("x86_64", AVX2 | {"avx512f"}, ["x86_64_v3", "x86_64"]),  # AVX-512 in part only
        ("aarch64", {"fp", "asimd"}, ["aarch64"]),
        ("riscv64", set(), []),
    ],
)
def test_the_variants_a_cpu_runs_best_first(machine, flags, expected):
    assert native.variants(machine, flags) == expected


@pytest.fixture
def fresh(monkeypatch):
    """`native` as if nothing were imported yet (its state restored after)."""
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "problem", None)
    monkeypatch.setattr(native, "variant", None)
    monkeypatch.setattr(native.sys, "platform", "linux")
    monkeypatch.delenv(native.DISABLE, raising=False)
    return monkeypatch


def fake_module(built_with: str) -> types.ModuleType:
    module = types.ModuleType("fake")
    module.built_with = lambda: built_with
    module.rms_norm = lambda x, w, eps: x
    return module


def test_no_module_built_says_so(fresh):
    def missing(name):
        raise ModuleNotFoundError(name=name)

    fresh.setattr(native.importlib, "import_module", missing)
    assert native.layers() is None
    assert "not built when the package was installed" in native.problem


def test_the_best_module_there_is_imported(fresh):
    fresh.setattr(native, "cpu_flags", lambda: AVX512)
    fresh.setattr(native.platform, "machine", lambda: "x86_64")
    asked = []

    def only_v3(name):
        asked.append(name.rsplit(".", 1)[-1])
        if not name.endswith("_v3"):
            raise ModuleNotFoundError(name=name)
        return fake_module(f"mlx {mx.__version__} nanobind 3.1.0")

    fresh.setattr(native.importlib, "import_module", only_v3)
    assert native.layers() is not None and native.problem is None
    assert asked == ["_kernels_x86_64_v4", "_kernels_x86_64_v3"]


def test_a_module_built_against_another_mlx_is_not_used(fresh):
    fresh.setattr(native.importlib, "import_module", lambda name: fake_module("mlx 0.0.1 nb 3"))
    assert native.layers() is None
    assert "built against mlx 0.0.1" in native.problem and "reinstall" in native.problem
    assert native.variant is None  # named only once a module passes


def test_turned_off_imports_nothing(fresh):
    fresh.setenv(native.DISABLE, "1")
    fresh.setattr(native.importlib, "import_module", lambda name: pytest.fail("imported"))
    assert native.layers() is None and native.DISABLE in native.problem


def test_off_linux_imports_nothing(fresh):
    fresh.setattr(native.sys, "platform", "darwin")
    fresh.setattr(native.importlib, "import_module", lambda name: pytest.fail("imported"))
    assert native.layers() is None and native.problem == "not Linux"


def built_variants() -> list[str]:
    """The modules this CPU runs that the install built, best first."""
    runs = native.variants(platform.machine(), native.cpu_flags())
    return [v for v in runs if importlib.util.find_spec(f"{PACKAGE}._kernels_{v}") is not None]


@pytest.mark.skipif(
    not os.environ.get(EXPECT) or not sys.platform.startswith("linux"),
    reason=f"{EXPECT} is not set (CI sets it: its machine has the compilers)",
)
def test_the_install_built_every_variant_this_cpu_runs_and_the_best_is_used():
    """Where the kernels must be there (CI), an install that left them out, or built them
    against another MLX, fails here instead of skipping their tests."""
    runs = native.variants(platform.machine(), native.cpu_flags())
    assert runs and built_variants() == runs
    assert native.layers() is not None, native.problem
    assert native.variant == runs[0]


@pytest.mark.parametrize("suffix", built_variants() or ["none"])
def test_each_built_variant_computes_the_same_products(suffix):
    """Every variant this CPU runs, not only the one the server imports: products within
    float32 rounding, a row's bits the same alone as in a batch, MLX's own RMSNorm."""
    if suffix == "none":
        pytest.skip(f"no kernels' module built here: {native.problem}")
    import numpy as np

    module = importlib.import_module(f"{PACKAGE}._kernels_{suffix}")
    assert module.built_with().split()[1] == mx.__version__
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((8, 576), np.float32))
    w = mx.array(rng.standard_normal((1000, 576), np.float32))
    mx.eval(w)
    with mx.stream(mx.cpu):
        together = np.asarray(module.linear(x, w))
        alone = np.asarray(module.linear(x[3:4], w))
        norm = np.asarray(module.rms_norm(x, mx.ones((576,)), 1e-5))
    expected = np.asarray(x).astype(np.float64) @ np.asarray(w).astype(np.float64).T
    np.testing.assert_allclose(together, expected, rtol=2e-5, atol=2e-4)
    assert np.array_equal(alone[0], together[3])
    assert np.array_equal(norm, np.asarray(mx.fast.rms_norm(x, mx.ones((576,)), 1e-5)))
