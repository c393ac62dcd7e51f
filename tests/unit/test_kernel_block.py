"""A Llama block as two ops around attention (`runtime/kernel_block.py`): the same bits
as mlx-lm's block, for every cache, batch and chunk a model runs, and only on blocks it
can run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlx_cache_server.runtime import cpu_fast_path, forward_together, kernel_block, native
from mlx_cache_server.runtime.fast_path import FAST_PATH
from tests.tiny_model import build_tiny_model

built = pytest.mark.skipif(
    mx.default_device() != mx.cpu or native.layers() is None or not native.layers().has_block(),
    reason=f"the layers' extension is not built here: {native.problem}",
)


def outputs(model: nn.Module) -> list[np.ndarray]:
    """A batch of two rows, one left-padded: a prompt of 96 tokens (more rows than the
    kernels library's products take), a step, a pass of three; a lone sequence's prompt
    and step; a call without a cache; a quantized and a rotating cache's; and the caches'
    contents."""
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79] * 12, [2, 71, 82, 81, 82, 84, 59, 4] * 12])
    batch = [BatchKVCache(left_padding=[0, 3]) for _ in model.layers]
    alone = [KVCache() for _ in model.layers]
    out = [
        model(prompt, cache=batch),
        model(mx.array([[26], [53]]), cache=batch),
        model(mx.array([[26, 7, 9], [53, 1, 2]]), cache=batch),
        model(prompt[:1, :5], cache=alone),
        model(mx.array([[4]]), cache=alone),
        model(prompt[:1, :7]),
    ]
    attn = model.layers[0].self_attn
    caches = [[RotatingKVCache(max_size=8) for _ in model.layers]]
    if attn.k_proj.weight.shape[0] // attn.n_kv_heads % 32 == 0:  # what quantizing takes
        caches.append([QuantizedKVCache(group_size=32) for _ in model.layers])
    for cache in caches:
        out += [model(prompt[:1, :12], cache=cache), model(mx.array([[5]]), cache=cache)]
    out += [batch[-1].keys, batch[-1].values, alone[0].keys]
    mx.eval(out)
    return [np.asarray(o) for o in out]


@pytest.fixture
def counted(monkeypatch) -> list[str]:
    """The block ops' calls, by name"""
    ops, calls = native.layers(), []
    proxy = type("Counted", (), {})()
    for name in dir(ops):
        if not name.startswith("_"):
            op = getattr(ops, name)
            setattr(proxy, name, lambda *a, op=op, n=name: calls.append(n) or op(*a))
    monkeypatch.setattr(native, "layers", lambda: proxy)
    return calls


@built
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4, "rope_traditional": True},
        {"hidden_size": 256, "intermediate_size": 512},  # products the kernels library takes
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"head_dim": 32},  # heads wider than hidden_size / heads
    ],
    ids=["grouped", "one-kv-head", "traditional-rope", "wide", "scaled-rope", "head-dim"],
)
def test_the_block_gives_the_model_s_own_bits(tmp_path, monkeypatch, counted, config):
    model = load(str(build_tiny_model(tmp_path, **config)))[0]
    cpu_fast_path.install(model)
    assert all(type(layer) is kernel_block.Block for layer in model.layers)
    ours = outputs(model)
    assert counted.count("block_input") >= 8 * len(model.layers)  # every call above
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"block"}))
    assert all(np.array_equal(a, b) for a, b in zip(outputs(model), ours, strict=True))
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"block", "swiglu"}))  # mlx-lm's SwiGLU too
    assert all(np.array_equal(a, b) for a, b in zip(outputs(model), ours, strict=True))


@built
@pytest.mark.parametrize("served", ["tiny", "default"])
def test_a_pass_s_live_positions_only_have_the_same_bits(tmp_path, served):
    """Rows padded to the longest: computed or not, a live position's logits and KV are
    the same, to the bit where the kernels library takes every product (each row summed
    alone: the default model), to float32 rounding where the BLAS's sums depend on the
    rows beside (the tiny model's); the fillers' KV is zeros, their outputs finite."""
    from mlx_cache_server.models.default_model import default_model_dir
    from mlx_cache_server.runtime.live_positions import live_positions

    exact = served == "default" and native.layers() is not None
    model = load(str(build_tiny_model(tmp_path) if served == "tiny" else default_model_dir()))[0]
    cpu_fast_path.install(model)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79] * 3] * 3)
    step = mx.array([[26, 7, 9, 4, 1], [53, 1, 2, 8, 8], [5, 6, 7, 3, 3]])
    lengths = [5, 1, 2]
    got = []
    for live in (False, True):
        cache = [BatchKVCache(left_padding=[0, 2, 1]) for _ in model.layers]
        model(prompt, cache=cache)
        if live:
            with live_positions(lengths, 5):
                out = model(step, cache=cache)
        else:
            out = model(step, cache=cache)
        got.append([np.asarray(a) for a in (out, cache[0].keys[..., 24:29, :], cache[-1].values)])
    (full, full_keys, _), (ragged, keys, values) = got
    assert np.isfinite(ragged).all()
    same = np.array_equal if exact else lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-4)
    for b, n in enumerate(lengths):
        assert same(ragged[b, :n], full[b, :n])
        assert same(keys[b, :, :n], full_keys[b, :, :n])
        assert not keys[b, :, n:].any() and not values[b, :, 24 + n : 29].any()


@built
def test_weights_the_ops_refuse_send_the_block_to_mlx_lm_s(tmp_path, monkeypatch):
    model = load(str(build_tiny_model(tmp_path)))[0]
    cpu_fast_path.install(model)
    q = model.layers[0].self_attn.q_proj
    original = np.asarray(q.weight)
    q.weight = mx.array(np.ascontiguousarray(original.T)).T  # the same values, transposed
    mx.eval(q.weight)
    ours = outputs(model)  # no error: layer 0 runs as mlx-lm's, layer 1 as two nodes
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"block"}))
    assert all(np.array_equal(a, b) for a, b in zip(outputs(model), ours, strict=True))


@built
@pytest.mark.skipif(
    FAST_PATH.kernels("attention") is None,
    reason="attention through numpy evaluates the block's input",
)
def test_a_step_is_two_nodes_a_block_around_attention(tmp_path):
    model = load(str(build_tiny_model(tmp_path)))[0]
    cpu_fast_path.install(model)
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), model(mx.array([[4]]), cache=cache))
    text = dot.read_text()
    n = len(model.layers)
    assert text.count('"MlxcsBlockInput"') == n and text.count('"MlxcsBlockOutput"') == n
    # the output head, which is not a block's, is our product too (`kernel_linear`)
    assert text.count('"MlxcsLinear"') == 1
    assert '"Matmul"' not in text and '"Sigmoid' not in text


def test_the_block_s_swiglu_is_mlx_lm_s_bit_for_bit():
    if mx.default_device() != mx.cpu or native.layers() is None:
        pytest.skip(f"the layers' extension is not built here: {native.problem}")
    rng = np.random.default_rng(0)
    scaled = [rng.standard_normal(50_000) * s for s in (0.1, 1.0, 4.0, 30.0, 90.0)]
    edges = [0.0, -0.0, 88.0, -88.0, 88.5, -88.5, 1e30, -1e30, np.inf, -np.inf, np.nan, 1e-40]
    any_bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    gate = np.concatenate([*scaled, edges]).astype(np.float32)
    gate = np.concatenate([gate, any_bits.view(np.float32)])  # NaNs, infinities, subnormals
    up = rng.standard_normal(gate.size).astype(np.float32)
    theirs = np.asarray(swiglu(mx.array(gate), mx.array(up)))
    ours = np.asarray(native.layers().swiglu(mx.array(gate), mx.array(up)))  # the node
    same = (theirs.view(np.uint32) == ours.view(np.uint32)) | (np.isnan(theirs) & np.isnan(ours))
    assert same.all(), gate[~same][:5]


@built
def test_only_blocks_it_computes_as_the_model_are_swapped(tmp_path):
    biased = load(str(build_tiny_model(tmp_path / "b", attention_bias=True)))[0]
    cpu_fast_path.install(biased)
    assert not any(type(layer) is kernel_block.Block for layer in biased.layers)
    half = load(str(build_tiny_model(tmp_path / "h")))[0]
    half.set_dtype(mx.bfloat16)
    cpu_fast_path.install(half)
    assert type(half.layers[0]) is llama.TransformerBlock
    model = load(str(build_tiny_model(tmp_path / "m")))[0]
    cpu_fast_path.install(model)
    assert forward_together.supports(model)  # it calls the parts, which are the same


@built
def test_other_input_goes_to_mlx_lm_s_block(tmp_path):
    model = load(str(build_tiny_model(tmp_path)))[0]
    cpu_fast_path.install(model)
    layer = model.layers[0]
    x = mx.random.normal((1, 3, layer.input_layernorm.weight.shape[0]))
    half = x.astype(mx.bfloat16)
    expected = llama.TransformerBlock.__call__(layer, half)
    assert np.array_equal(
        np.asarray(layer(half).astype(mx.float32)), np.asarray(expected.astype(mx.float32))
    )


def test_nothing_is_swapped_without_the_extension(tmp_path, monkeypatch):
    model = load(str(build_tiny_model(tmp_path)))[0]
    monkeypatch.setattr(native, "layers", lambda: None)
    assert kernel_block.install(model) == 0
    assert type(model.layers[0]) is llama.TransformerBlock
