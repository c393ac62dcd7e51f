"""Our decode products (`runtime/csrc/gemm.c`), through MLX as the server calls them.

pytest runs preloaded as the server does (tests/conftest.py), so MLX's matmuls here reach
the kernels' `cblas_sgemm`; each test checks, through the kernels' call counter, that the
products it means to test were computed there and not by OpenBLAS.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_cache_server.runtime import blas, native

pytestmark = pytest.mark.skipif(
    native.loaded() is None, reason=f"kernels not preloaded: {native.problem or 'see native.py'}"
)


def kernels() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(native.loaded()))  # the preloaded copy: same path, same handle
    lib.mlxcs_gemm_calls.restype = ctypes.c_long
    return lib


def counted(fn):
    """`fn()`'s result and how many products the kernels computed for it."""
    lib = kernels()
    before = lib.mlxcs_gemm_calls()
    out = fn()
    mx.eval(out)
    return out, lib.mlxcs_gemm_calls() - before


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, 64, 65])
@pytest.mark.parametrize("n,k", [(576, 576), (1537, 577), (4099, 17), (70, 1000)])
def test_products_equal_float64_within_float32_rounding(rows, n, k):
    rng = np.random.default_rng(rows * 1000 + n)
    x, w = rng.standard_normal((rows, k), np.float32), rng.standard_normal((n, k), np.float32)
    out, calls = counted(lambda: mx.array(x) @ mx.array(w).T)
    assert calls == (1 if rows <= kernels().mlxcs_gemm_max_rows() else 0)
    np.testing.assert_allclose(np.array(out), reference(x, w), rtol=2e-5, atol=2e-4)


def test_alpha_and_beta_through_addmm():
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((3, 600), np.float32), rng.standard_normal((800, 600), np.float32)
    c = rng.standard_normal((3, 800), np.float32)
    for alpha, beta in ((0.5, 2.0), (1.0, 1.0), (-1.5, 0.0)):
        args = (mx.array(c), mx.array(x), mx.array(w).T)
        out, calls = counted(lambda: mx.addmm(*args, alpha=alpha, beta=beta))  # noqa: B023
        assert calls == 1
        expected = alpha * reference(x, w) + beta * c
        np.testing.assert_allclose(np.array(out), expected, rtol=2e-5, atol=2e-4)


def test_leading_dimensions_wider_than_the_rows():
    """MLX passes contiguous operands; a BLAS caller may pass rows of a wider matrix."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((4, 700), np.float32)
    b = rng.standard_normal((900, 650), np.float32)
    c = np.full((4, 1000), np.nan, np.float32)  # beta 0: C is not read, NaN and all
    f, ptr = ctypes.c_float, ctypes.c_void_p
    kernels().cblas_sgemm(
        101, 111, 112, 3, 800, 600, f(1.0), ptr(a[1:].ctypes.data), 700,
        ptr(b[50:].ctypes.data), 650, f(0.0), ptr(c.ctypes.data), 1000,
    )  # fmt: skip
    np.testing.assert_allclose(
        c[:3, :800], reference(a[1:, :600], b[50:850, :600]), rtol=2e-5, atol=2e-4
    )
    assert np.isnan(c[:3, 800:]).all() and np.isnan(c[3]).all()  # nothing outside C


def test_a_row_gets_the_same_bits_alone_and_beside_others():
    """Why drafts verified in one pass can equal single steps: a row's products do not
    depend on the rows computed with it."""
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((64, 576), np.float32))
    w = mx.array(rng.standard_normal((3000, 576), np.float32))
    together, calls = counted(lambda: x @ w.T)
    assert calls == 1
    for i in range(64):
        alone = x[i : i + 1] @ w.T
        assert np.array_equal(np.array(alone)[0], np.array(together)[i]), f"row {i}"
    for size in (2, 3, 5, 9, 17, 33):
        part = x[:size] @ w.T
        assert np.array_equal(np.array(part), np.array(together)[:size]), f"{size} rows"


def test_other_products_go_on_to_the_blas():
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((600, 576), np.float32))
    cases = {
        "more rows": lambda: mx.ones((kernels().mlxcs_gemm_max_rows() + 1, 576)) @ w.T,
        "not transposed": lambda: mx.ones((2, 600)) @ w,
        "small": lambda: mx.ones((1, 64)) @ mx.ones((64, 64)).T,
    }
    for name, product in cases.items():
        out, calls = counted(product)
        assert calls == 0, name
        assert np.isfinite(np.array(out)).all()
        # The workers slept through it, and spin again after: every call ended its quiet.
        assert kernels().mlxcs_pool_quiet() == 0, name


def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b.T through the kernels' cblas_sgemm, called directly."""
    c = np.empty((a.shape[0], b.shape[0]), np.float32)
    f, ptr = ctypes.c_float, ctypes.c_void_p
    m, k = a.shape
    kernels().cblas_sgemm(
        101, 111, 112, m, b.shape[0], k, f(1.0), ptr(a.ctypes.data), k,
        ptr(b.ctypes.data), k, f(0.0), ptr(c.ctypes.data), b.shape[0],
    )  # fmt: skip
    return c


def _product_in_child(queue) -> None:
    queue.put(float(product(np.ones((2, 512), np.float32), np.ones((512, 512), np.float32)).sum()))


def test_a_forked_child_multiplies_without_the_parents_workers():
    """(MLX itself does not run in a forked child; a library using the kernels might.)"""
    before = kernels().mlxcs_gemm_calls()
    product(np.ones((2, 512), np.float32), np.ones((512, 512), np.float32))  # workers ran
    assert kernels().mlxcs_gemm_calls() == before + 1
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_product_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the child hung or died"
    assert queue.get(timeout=5) == 2 * 512.0 * 512


def test_two_threads_multiply_at_once():
    """A second caller finds the workers busy and computes alone: both right."""
    rng = np.random.default_rng(11)
    ws = [rng.standard_normal((2048, 512), np.float32) for _ in range(2)]
    xs = [rng.standard_normal((3, 512), np.float32) for _ in range(2)]
    failures = []

    def run(i: int) -> None:
        stream = mx.new_stream(mx.cpu)
        x, w = mx.array(xs[i]), mx.array(ws[i])
        for _ in range(40):
            out = np.array(mx.matmul(x, w.T, stream=stream))
            if not np.allclose(out, reference(xs[i], ws[i]), rtol=2e-5, atol=2e-4):
                failures.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not failures


def test_describe_names_the_kernels():
    text, fast = blas.describe()
    assert fast and "our kernels" in text


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"MLX_CACHE_SERVER_KERNEL_THREADS": "1"}, 1),
        ({"OPENBLAS_NUM_THREADS": "1"}, 1),  # ranks sharing a machine share its cores
        ({"MLX_CACHE_SERVER_KERNEL_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}, 2),
        ({}, min(len(os.sched_getaffinity(0)), 8)),
    ],
)
def test_how_many_cores_the_kernels_use(env, expected):
    unset = ("OPENBLAS_NUM_THREADS", "MLX_CACHE_SERVER_KERNEL_THREADS", "LD_PRELOAD")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    code = f"import ctypes; print(ctypes.CDLL({str(native.loaded())!r}).pool_parts())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=base | env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == expected


def test_a_draft_pass_stays_within_what_the_kernels_compute_as_single_steps():
    """A verified draft's tokens are a single step's only where its pass takes the same
    kernels: our products for all its rows, our attention for each stream's positions."""
    from mlx_cache_server.engine.drafting import MAX_DRAFT
    from mlx_cache_server.engine.speculative import MAX_POSITIONS
    from mlx_cache_server.runtime.kernel_attention import MAX_QUERIES

    assert MAX_DRAFT + 1 <= MAX_QUERIES
    assert MAX_POSITIONS <= kernels().mlxcs_gemm_max_rows()
