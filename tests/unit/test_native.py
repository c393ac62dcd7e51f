"""Which kernels' module a process imports (`runtime/native.py`): the best its CPU runs,
built against its MLX, else none and the reason."""

from __future__ import annotations

import sys
import types

import mlx.core as mx
import pytest

from mlx_cache_server.runtime import native

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


def test_this_cpu_has_flags_to_read():
    if sys.platform.startswith("linux"):
        assert "x86_64" in native.variants("x86_64", native.cpu_flags())


@pytest.fixture
def fresh(monkeypatch):
    """`native` as if nothing were imported yet (its state restored after)."""
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "problem", None)
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


def test_turned_off_imports_nothing(fresh):
    fresh.setenv(native.DISABLE, "1")
    fresh.setattr(native.importlib, "import_module", lambda name: pytest.fail("imported"))
    assert native.layers() is None and native.DISABLE in native.problem


def test_off_linux_imports_nothing(fresh):
    fresh.setattr(native.sys, "platform", "darwin")
    fresh.setattr(native.importlib, "import_module", lambda name: pytest.fail("imported"))
    assert native.layers() is None and native.problem == "not Linux"
