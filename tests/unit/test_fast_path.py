"""The CPU fast path's switch and rules (`runtime/fast_path.py`): off means MLX's own for
every family, and `off` turns off a family or one route of it. The routes each entry point
takes are tested beside it (test_cpu_attention.py, test_cpu_activations.py, ...)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_cache_server.runtime import fast_path, native
from mlx_cache_server.runtime.fast_path import FastPath, Route

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a CPU-only path")


def operands() -> dict[str, tuple]:
    """One call of each family that the fast path takes when on."""
    q, k = mx.ones((4, 9, 1, 64)), mx.ones((4, 3, 100, 64))
    rows, w = mx.ones((3, 64)), mx.ones((32, 64))
    return {
        "attention": (q, k, k, None, None, None),
        "swiglu": (mx.ones((4, 8, 1024)), mx.ones((4, 8, 1024))),
        "logsumexp": (rows, -1),
        "rope": (mx.ones((1, 4, 3, 16)),),
        "rms_norm": (rows, mx.ones((64,))),
        "block": (mx.ones((1, 3, 64)), [w]),
        "linear": (rows, w),
    }


def routes(path: FastPath) -> dict[str, Route]:
    return {family: getattr(path, family)(*args) for family, args in operands().items()}


def test_off_every_call_is_mlx_s():
    assert set(routes(FastPath(on=False)).values()) == {Route.MLX}
    assert not FastPath(on=False).installs() and FastPath().installs()


def test_on_each_family_takes_ours():
    kernels = native.layers() is not None
    got = routes(FastPath())
    assert got["logsumexp"] is Route.NUMPY
    if kernels:
        assert set(got.values()) == {Route.KERNEL, Route.NUMPY}
        assert got["attention"] is got["swiglu"] is got["linear"] is Route.KERNEL
    else:
        assert got["attention"] is Route.NUMPY_DECODE and got["swiglu"] is Route.NUMPY


def test_a_family_or_one_route_of_it_turned_off():
    path = FastPath()
    path.off = frozenset({"attention.kernel", "swiglu.kernel", "logsumexp"})
    got = routes(path)
    assert got["attention"] is Route.NUMPY_DECODE and got["swiglu"] is Route.NUMPY
    assert got["logsumexp"] is Route.MLX
    path.off = frozenset(operands())
    assert set(routes(path).values()) == {Route.MLX}


def test_other_dtypes_and_empty_rows_are_mlx_s(monkeypatch):
    monkeypatch.setattr(fast_path, "MIN_ROWS", 0)
    path = FastPath()
    assert path.logsumexp(mx.ones((3, 0)), -1) is Route.MLX
    assert path.logsumexp(mx.ones((3, 8), mx.float16), -1) is Route.MLX
    assert path.logsumexp(mx.ones((3, 8)), 0) is Route.MLX
    half = mx.ones((1, 3, 64), mx.bfloat16)
    assert path.block(half, [mx.ones((32, 64))]) is Route.MLX
    assert path.linear(mx.ones((65, 64)), mx.ones((32, 64))) is Route.MLX  # past MAX_ROWS
