"""RoPE and RMSNorm as one MLX op each (`runtime/kernel_layers.py`): the same bits as
MLX's own functions, for every shape, stride and option a model hands them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from mlx_cache_server.runtime import kernel_layers, native
from tests.tiny_model import build_tiny_model

built = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.layers() is None,
    reason=f"the layers' extension is not built here: {native.problem}",
)


def same_bits(a: mx.array, b: mx.array) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    )


@built
@pytest.mark.parametrize(
    "dims, size, traditional, base, scale",
    [
        (64, 64, False, 1e5, 1.0),  # the default model's
        (32, 64, True, 1e4, 0.5),  # pairs side by side; half the head rotated
        (16, 48, False, 5e5, 2.0),
        (128, 128, False, 1e6, 1.0),
    ],
)
@pytest.mark.parametrize(
    "shape, offset",
    [
        ((1, 9, 1, None), 1500),  # a decode step
        ((2, 3, 5, None), mx.array([7, -3])),  # a batch, one row left-padded
        ((3, 2, 17, None), mx.array(100_000)),  # far positions
        ((1, 4, 512, None), 0),  # a prefill chunk
        ((2, 2, 3, None), mx.array([5])),
    ],
)
@pytest.mark.parametrize("layout", ["dense", "transposed", "every other"])
def test_rope_gives_mlx_s_bits(dims, size, traditional, base, scale, shape, offset, layout):
    theirs = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    ours = kernel_layers.RoPE(theirs, native.layers())
    b, heads, positions, _ = shape
    if layout == "dense":
        x = mx.random.normal((b, heads, positions, size))
    elif layout == "transposed":  # as attention hands it: (batch, positions, heads, size)
        x = mx.random.normal((b, positions, heads, size)).transpose(0, 2, 1, 3)
    else:  # no axis dense
        x = mx.random.normal((b, heads, positions, 2 * size))[..., ::2]
    assert same_bits(ours(x, offset=offset), theirs(x, offset=offset))


@built
@pytest.mark.parametrize("size", [576, 64, 5, 2048])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 3)])
def test_rms_norm_gives_mlx_s_bits(size, shape):
    theirs = nn.RMSNorm(size, eps=1e-5)
    theirs.weight = mx.random.normal((size,))
    ours = kernel_layers.RMSNorm(theirs, native.layers())
    x = mx.random.normal((*shape, size)) * 3
    assert same_bits(ours(x), theirs(x))
    strided = mx.random.normal((size, 4)).T  # rows that are columns of another array
    assert same_bits(ours(strided), theirs(strided))


@built
def test_other_dtypes_and_shapes_go_to_mlx():
    ops = native.layers()
    rope = kernel_layers.RoPE(nn.RoPE(32), ops)
    norm = kernel_layers.RMSNorm(nn.RMSNorm(32), ops)
    half = mx.random.normal((1, 2, 3, 32)).astype(mx.float16)
    assert same_bits(rope(half, offset=4), nn.RoPE(32)(half, offset=4))
    assert same_bits(norm(half), nn.RMSNorm(32)(half))
    three = mx.random.normal((2, 3, 32))  # (batch, positions, size): MLX's path takes it
    assert same_bits(rope(three, offset=1), nn.RoPE(32)(three, offset=1))
    with pytest.raises(ValueError):  # an offset per row of another batch: MLX's error
        rope(mx.random.normal((2, 1, 3, 32)), offset=mx.array([1, 2, 3]))
    with pytest.raises(ValueError):  # not an integer: MLX's error, not a truncation
        rope(mx.random.normal((2, 1, 3, 32)), offset=mx.array([1.5, 2.0]))


@built
def test_a_model_s_output_keeps_its_bits_with_the_layers_swapped(tmp_path):
    model = load(str(build_tiny_model(tmp_path)))[0]
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4]])
    steps = mx.array([[26], [53]])

    def run() -> list[np.ndarray]:
        cache = [BatchKVCache(left_padding=[0, 3]) for _ in model.layers]
        first = model(prompt, cache=cache)
        return [np.asarray(first), np.asarray(model(steps, cache=cache))]

    before = run()
    swapped = kernel_layers.install(model)
    layer = model.layers[0]
    assert isinstance(layer.self_attn.rope, kernel_layers.RoPE)
    assert isinstance(layer.input_layernorm, kernel_layers.RMSNorm)
    assert isinstance(model.model.norm, kernel_layers.RMSNorm)
    assert swapped == 3 * len(model.layers) + 1  # a RoPE and two norms a layer, the last norm
    after = run()
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


@built
def test_nothing_is_swapped_without_the_extension(tmp_path, monkeypatch):
    model = load(str(build_tiny_model(tmp_path)))[0]
    monkeypatch.setattr(native, "layers", lambda: None)
    assert kernel_layers.install(model) == 0
    assert type(model.layers[0].self_attn.rope) is nn.RoPE
