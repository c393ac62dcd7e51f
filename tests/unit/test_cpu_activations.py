"""SwiGLU on our primitive, else through numpy (`mlx_cache_server.runtime.cpu_activations`), against
mlx-lm's own."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations

from mlx_cache_server.runtime import cpu_activations, fast_path, native
from mlx_cache_server.runtime.fast_path import FAST_PATH

extension = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.layers() is None,
    reason=f"the layers' extension is not built here: {native.problem}",
)


@pytest.fixture
def no_extension(monkeypatch):
    """numpy's path, as where the extension cannot be built"""
    monkeypatch.setattr(native, "layers", lambda: None)


@pytest.mark.parametrize("shape", [(1, 240, 1536), (16, 1, 1536), (2, 37, 128)])
def test_numpy_s_equals_mlx_lm_within_float32_tolerance(shape, monkeypatch, no_extension):
    monkeypatch.setattr(fast_path, "MIN_ELEMENTS", 0)
    mx.random.seed(3)
    gate, x = mx.random.normal(shape) * 6, mx.random.normal(shape)  # large gates: exp's range
    got = cpu_activations.swiglu(gate, x)
    expected = activations.swiglu(gate, x)
    assert got.shape == expected.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-6)


@extension
@pytest.mark.parametrize("shape", [(1, 1, 1536), (2, 37, 128), (3, 5)])
def test_ours_equals_mlx_lm_bit_for_bit(shape):
    mx.random.seed(3)
    gate, x = mx.random.normal(shape) * 6, mx.random.normal(shape)
    expected = np.asarray(activations.swiglu(gate, x))
    assert np.array_equal(np.asarray(cpu_activations.swiglu(gate, x)), expected)
    # operands a transpose or a broadcast leave strided
    wide = mx.random.normal((shape[-1], 4))
    assert np.array_equal(
        np.asarray(cpu_activations.swiglu(wide.T, wide.T * 2)),
        np.asarray(activations.swiglu(wide.T, wide.T * 2)),
    )
    row = mx.broadcast_to(x[..., :1], x.shape)
    assert np.array_equal(
        np.asarray(cpu_activations.swiglu(gate, row)), np.asarray(activations.swiglu(gate, row))
    )


@extension
def test_float32_of_any_size_is_our_node(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(activations, "swiglu", lambda g, x: calls.append(g.shape) or g)
    small = cpu_activations.swiglu(mx.ones((1, 1, 64)), mx.ones((1, 1, 64)))
    mx.export_to_dot(str(tmp_path / "s.dot"), small)
    assert "MlxcsSwiGLU" in (tmp_path / "s.dot").read_text()
    cpu_activations.swiglu(mx.ones((1, 1, 64), mx.float16), mx.ones((1, 1, 64), mx.float16))
    assert calls == [(1, 1, 64)]


def test_small_or_other_dtypes_go_to_mlx_lm(monkeypatch, no_extension):
    calls = []
    monkeypatch.setattr(activations, "swiglu", lambda g, x: calls.append(g.shape) or g)
    big = mx.ones((4, 8, 1024))
    cpu_activations.swiglu(big, big)  # float32, large: numpy's
    assert calls == []
    cpu_activations.swiglu(mx.ones((1, 1, 64)), mx.ones((1, 1, 64)))  # one decode row: small
    cpu_activations.swiglu(big.astype(mx.float16), big.astype(mx.float16))
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"swiglu"}))
    cpu_activations.swiglu(big, big)
    assert len(calls) == 3


def test_install_routes_the_models_mlp_here(tiny_model, monkeypatch, no_extension):
    import mlx_lm.models.llama as llama

    model, tokenizer = tiny_model
    monkeypatch.setattr(llama, "swiglu", activations.swiglu)  # undone after the test
    monkeypatch.setattr(fast_path, "MIN_ELEMENTS", 0)
    tokens = mx.array(tokenizer.encode("Hello there, how are you?"))[None]
    before = model(tokens)
    assert cpu_activations.install(model)
    assert llama.swiglu is cpu_activations.swiglu
    np.testing.assert_allclose(np.array(model(tokens)), np.array(before), rtol=1e-4, atol=1e-4)
