"""Our decode products (`runtime/csrc/gemm.c`), through the primitive the server calls them
by (`linear`, in the kernels' module) and the modules that call it (`kernel_linear`).

Each test checks, through the kernels' call counter, that the products it means to test
were computed there and not by the BLAS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_cache_server.runtime import fast_path, kernel_linear, native

pytestmark = pytest.mark.skipif(
    native.layers() is None, reason=f"no kernels' module here: {native.problem}"
)


def ops():
    return native.layers()


def counted(fn):
    """`fn()`'s result and how many products the kernels computed for it."""
    before = ops().gemm_calls()
    out = fn()
    mx.eval(out)
    return out, ops().gemm_calls() - before


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, 64, 65])
@pytest.mark.parametrize("n,k", [(576, 576), (1537, 577), (4099, 17), (70, 1000)])
def test_products_equal_float64_within_float32_rounding(rows, n, k):
    rng = np.random.default_rng(rows * 1000 + n)
    x, w = rng.standard_normal((rows, k), np.float32), rng.standard_normal((n, k), np.float32)
    out, calls = counted(lambda: ops().linear(mx.array(x), mx.array(w)))
    assert calls == (1 if rows <= ops().gemm_max_rows() else 0)  # more: the BLAS's
    np.testing.assert_allclose(np.array(out), reference(x, w), rtol=2e-5, atol=2e-4)


def test_rows_of_any_layout():
    """A slice of a wider matrix, a transposed view, a batch of positions: each row is
    the product of that row."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((6, 700), np.float32)
    w = mx.array(rng.standard_normal((900, 600), np.float32))
    cases = {
        "rows of a wider matrix": mx.array(a)[1:4, :600],
        "transposed batch": mx.array(a[:, :600].reshape(2, 3, 600)).transpose(1, 0, 2),
    }
    for name, x in cases.items():
        out, calls = counted(lambda x=x: ops().linear(x, w))
        assert calls == 1, name
        assert out.shape == (*x.shape[:-1], 900), name
        expected = reference(np.array(x).reshape(-1, 600), np.array(w))
        np.testing.assert_allclose(
            np.array(out).reshape(-1, 900), expected, rtol=2e-5, atol=2e-4, err_msg=name
        )


def test_a_row_gets_the_same_bits_alone_and_beside_others():
    """Why drafts verified in one pass can equal single steps: a row's products do not
    depend on the rows computed with it."""
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((64, 576), np.float32))
    w = mx.array(rng.standard_normal((3000, 576), np.float32))
    together, calls = counted(lambda: ops().linear(x, w))
    assert calls == 1
    for i in range(64):
        alone = ops().linear(x[i : i + 1], w)
        assert np.array_equal(np.array(alone)[0], np.array(together)[i]), f"row {i}"
    for size in (2, 3, 5, 9, 17, 33):
        part = ops().linear(x[:size], w)
        assert np.array_equal(np.array(part), np.array(together)[:size]), f"{size} rows"


def test_other_products_go_on_to_the_blas():
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((600, 576), np.float32))
    small = mx.ones((64, 64))
    mx.eval(small)
    cases = {
        "more rows": lambda: ops().linear(mx.ones((ops().gemm_max_rows() + 1, 576)), w),
        "small": lambda: ops().linear(mx.ones((1, 64)), small),
    }
    for name, product in cases.items():
        out, calls = counted(product)
        assert calls == 0, name
        assert np.isfinite(np.array(out)).all()
        # The workers slept through it, and spin again after: every call ended its quiet.
        assert ops().pool_quiet() == 0, name


def test_a_weight_the_primitive_cannot_read_is_refused():
    w = mx.ones((600, 576))
    with pytest.raises(ValueError):
        ops().linear(mx.ones((1, 576)), w.T)  # not row-contiguous: a view
    with pytest.raises(ValueError):
        ops().linear(mx.ones((1, 576), mx.float16), w)


def test_two_threads_multiply_at_once():
    """A second caller finds the workers busy and computes alone: both right."""
    rng = np.random.default_rng(11)
    ws = [rng.standard_normal((2048, 512), np.float32) for _ in range(2)]
    xs = [rng.standard_normal((3, 512), np.float32) for _ in range(2)]
    failures = []

    def run(i: int) -> None:
        stream = mx.new_stream(mx.cpu)
        x, w = mx.array(xs[i]), mx.array(ws[i])
        mx.eval(w)
        for _ in range(40):
            with mx.stream(stream):
                out = np.array(ops().linear(x, w))
            if not np.allclose(out, reference(xs[i], ws[i]), rtol=2e-5, atol=2e-4):
                failures.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not failures


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
    unset = ("OPENBLAS_NUM_THREADS", "MLX_CACHE_SERVER_KERNEL_THREADS")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    code = "from mlx_cache_server.runtime import native; print(native.layers().pool_parts())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=base | env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == expected


def test_a_module_that_computes_nothing_starts_no_thread():
    """Importing the kernels costs a process nothing until it multiplies."""
    code = (
        "import threading\n"
        "from mlx_cache_server.runtime import native\n"
        "assert native.layers() is not None, native.problem\n"
        "import os; print(len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    baseline = subprocess.run(
        [sys.executable, "-c", "import mlx.core, os; print(len(os.listdir('/proc/self/task')))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert int(out.stdout) == int(baseline.stdout)


def tiny_model() -> nn.Module:
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    mx.random.seed(0)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


def test_a_models_decode_products_run_on_the_kernels_with_its_own_results():
    model = tiny_model()
    tokens = mx.array([[5, 17, 300]])
    before = np.array(model(tokens))
    replaced = kernel_linear.install(model)
    # 2 layers x (q, k, v, o with biases on q, k, v; gate, up, down) and the tied embedding
    assert replaced == 2 * 7 + 1
    assert type(model.model.embed_tokens) is kernel_linear.Embedding
    after, calls = counted(lambda: model(tokens))
    assert calls > 0
    np.testing.assert_allclose(np.array(after), before, rtol=1e-4, atol=1e-4)
    fast_path.FAST_PATH.off = frozenset({"linear"})
    try:
        _, calls = counted(lambda: model(tokens))
    finally:
        fast_path.FAST_PATH.off = frozenset()
    assert calls == 0  # off: mlx-lm's own call


def test_a_draft_pass_stays_within_what_the_kernels_compute_as_single_steps():
    """A verified draft's tokens are a single step's only where its pass takes the same
    kernels: our products for all its rows, our attention for each stream's positions."""
    from mlx_cache_server.engine.drafting import MAX_DRAFT
    from mlx_cache_server.engine.speculative import MAX_POSITIONS
    from mlx_cache_server.runtime.kernel_attention import MAX_QUERIES

    assert MAX_DRAFT + 1 <= MAX_QUERIES
    assert MAX_POSITIONS <= ops().gemm_max_rows() == fast_path.MAX_ROWS
