"""Attention through numpy (`mlx_cache_server.runtime.cpu_attention`) against MLX's own kernel."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlx_cache_server.runtime import cpu_attention, fast_path, kernel_attention, native
from mlx_cache_server.runtime.fast_path import FAST_PATH


def qkv(batch: int, heads: int, kv_heads: int, queries: int, keys: int, dim: int, seed: int = 0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, queries, dim)) * 2
    k = mx.random.normal((batch, kv_heads, keys, dim)) * 2
    v = mx.random.normal((batch, kv_heads, keys, dim))
    return q, k, v


def left_padding_mask(batch: int, queries: int, keys: int, padding: list[int]) -> mx.array:
    """A boolean (batch, 1, queries, keys) mask: causal, and each row's first keys padding."""
    positions = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None, :]
    pad = mx.arange(keys)[None, :] >= mx.array(padding)[:, None]
    return (positions[None] & pad[:, None, :])[:, None]


SHAPES = {
    "GQA, a prefill chunk on a long context": (1, 9, 3, 100, 4100, 64),
    "no GQA, two sequences": (2, 4, 4, 37, 300, 32),
    "one query": (1, 8, 2, 1, 2000, 64),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_kind", ["none", "causal", "boolean", "additive"])
def test_equals_mlx_within_float32_tolerance(shape, mask_kind):
    batch, heads, kv_heads, queries, keys, dim = SHAPES[shape]
    q, k, v = qkv(batch, heads, kv_heads, queries, keys, dim)
    mask = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind in ("boolean", "additive"):
        mask = left_padding_mask(batch, queries, keys, [0, 7][:batch])
        if mask_kind == "additive":
            mask = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    scale = dim**-0.5
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = cpu_attention.attention(q, k, v, scale, mask)
    assert got.shape == expected.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=2e-5)


DECODE_SHAPES = {
    "GQA, streams over a short context": (16, 9, 3, 1, 161, 64),
    "no GQA, two streams over a longer one": (2, 4, 4, 1, 384, 32),
}


@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("mask_kind", ["none", "causal", "boolean", "additive", "per head"])
def test_a_decode_steps_attention_equals_mlx_within_float32_tolerance(shape, mask_kind):
    batch, heads, kv_heads, queries, keys, dim = DECODE_SHAPES[shape]
    q, k, v = qkv(batch, heads, kv_heads, queries, keys, dim, seed=3)
    mask = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind in ("boolean", "additive"):
        mask = left_padding_mask(batch, queries, keys, [(7 * i + 5) % 50 for i in range(batch)])
        if mask_kind == "additive":
            mask = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    if mask_kind == "per head":  # an additive bias of each query head's own (as MLA passes)
        mask = mx.random.normal((batch, heads, queries, keys), key=mx.random.key(4)) * 3
    scale = dim**-0.5
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = cpu_attention.decode_attention(q, k, v, scale, mask)
    assert got.shape == expected.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=2e-5)


def test_a_decode_step_reads_the_caches_keys_in_place():
    """The keys and values a batch's cache returns are a slice of its buffer: strided."""
    cache = BatchKVCache(left_padding=[0, 3])
    k, v = (mx.random.normal((2, 2, 40, 16), key=mx.random.key(i)) for i in (1, 2))
    cache.update_and_fetch(k, v)
    mask = cache.make_mask(1)
    q = mx.random.normal((2, 4, 1, 16), key=mx.random.key(3))
    keys, values = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert not np.asarray(keys).flags.c_contiguous  # the case under test
    expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=mask)
    got = cpu_attention.decode_attention(q, keys, values, 0.25, mask)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=2e-5)


def test_query_chunks_give_the_same_rows(monkeypatch):
    q, k, v = qkv(1, 9, 3, 100, 1000, 64, seed=1)
    whole = cpu_attention.attention(q, k, v, 0.125, "causal")
    monkeypatch.setattr(cpu_attention, "CHUNK_SCORES", 9 * 1000 * 7)  # chunks of 7 queries
    chunked = cpu_attention.attention(q, k, v, 0.125, "causal")
    # Rows are independent; only BLAS's blocking over the chunk's size differs, and with it
    # the order of float32 sums over 1,000 keys: OpenBLAS's Haswell kernels (what
    # OPENBLAS_CORETYPE selects on this workplace's machines) differ by up to 2.3e-6.
    np.testing.assert_allclose(np.array(chunked), np.array(whole), rtol=1e-5, atol=1e-5)


def test_small_quantized_or_other_dtypes_go_to_mlx_lm(monkeypatch):
    """Where our kernels' module is not there (kernel_attention's routes are below)."""
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"attention.kernel"}))
    calls, decoded = [], []
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a) or a[0])
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: decoded.append(a) or a[0])
    big = qkv(1, 9, 3, 100, 4100, 64)
    small = qkv(1, 9, 3, 2, 100, 64)

    def run(q, k, v, cache=None):
        return cpu_attention.scaled_dot_product_attention(
            q, k, v, cache=cache, scale=0.125, mask=None
        )

    run(*big, cache=KVCache())
    assert len(calls) == 1
    run(*small)  # too few scores to pay for the round trip
    run(*qkv(4, 9, 3, 1, 100, 64))  # one query a sequence: a decode step's own path
    run(*qkv(1, 9, 3, 1, fast_path.DECODE_MAX_KEYS, 64))  # ... up to so many keys
    run(*qkv(16, 9, 3, 1, 2000, 64))  # ... not past them: here, enough scores for numpy's
    run(*qkv(1, 9, 3, 1, fast_path.DECODE_MAX_KEYS + 1, 64))  # ... or MLX's
    run(*qkv(1, 128, 1, 1, 300, 64))  # many query heads to a key head: MLX's
    assert len(decoded) == 2 and len(calls) == 2
    run(*(a.astype(mx.float16) for a in big))
    quantized = QuantizedKVCache(group_size=64, bits=8)
    q, k, v = big
    qk, qv = mx.quantize(k, group_size=64, bits=8), mx.quantize(v, group_size=64, bits=8)
    out = cpu_attention.scaled_dot_product_attention(
        q, qk, qv, cache=quantized, scale=0.125, mask=None
    )
    assert out.shape == q.shape
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"attention"}))
    run(*big)
    run(*qkv(4, 9, 3, 1, 100, 64))
    assert len(calls) == 2 and len(decoded) == 2


def test_install_routes_the_models_attention_here(tiny_model, monkeypatch):
    model, tokenizer = tiny_model
    calls = []
    real = cpu_attention.attention

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu_attention, "attention", counting)
    monkeypatch.setattr(fast_path, "MIN_SCORES", 0)
    import mlx_lm.models.llama as llama
    from mlx_lm.models import base

    # mlx-lm's own attention (an engine built earlier in this process installed ours).
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    tokens = mx.array(tokenizer.encode("Hello there, how are you?"))[None]
    before = model(tokens)
    assert not calls
    assert cpu_attention.install(model)
    after = model(tokens)
    assert len(calls) == len(model.layers)
    np.testing.assert_allclose(np.array(after), np.array(before), rtol=1e-4, atol=1e-4)


def test_install_reaches_the_attention_of_a_wrapper_models_parts(monkeypatch):
    from mlx_lm.models import base, llama, smollm3

    # SmolLM3's module wraps llama's layers: the name to rebind is in llama's module.
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    args = smollm3.ModelArgs(
        model_type="smollm3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
    )  # fmt: skip
    assert cpu_attention.install(smollm3.Model(args))
    assert llama.scaled_dot_product_attention is cpu_attention.scaled_dot_product_attention


def test_one_chunk_of_scores_at_a_time(monkeypatch):
    q, k, v = qkv(1, 8, 8, 256, 8192, 32, seed=2)
    mx.eval(q, k, v)
    whole_scores = 8 * 256 * 8192 * 4  # bytes of the full score matrix
    monkeypatch.setattr(cpu_attention, "CHUNK_SCORES", 8 * 8192 * 16)  # 16 queries a chunk
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = cpu_attention.attention(q, k, v, 32**-0.5, "causal")
    mx.eval(out)
    assert mx.get_peak_memory() - before < whole_scores / 4


def test_a_few_queries_a_sequence_go_to_the_kernel(monkeypatch):
    if FAST_PATH.kernels("attention") is None:
        pytest.skip(f"no kernels' module here: {native.problem}")
    kernel, calls = [], []
    real = kernel_attention.run
    monkeypatch.setattr(kernel_attention, "run", lambda *a: kernel.append(a) or real(*a))
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a) or a[0])

    def run(q, k, v, mask=None, cache=None):
        return cpu_attention.scaled_dot_product_attention(
            q, k, v, cache=cache, scale=0.125, mask=mask
        )

    run(*qkv(1, 9, 3, 1, 3000, 64))  # a decode step over a long context
    run(*qkv(4, 9, 3, 1, 100, 64))  # four streams over a short one
    run(*qkv(1, 9, 3, 16, 4100, 64), mask="causal")  # a long draft's pass
    assert len(kernel) == 3 and not calls
    run(*qkv(1, 9, 3, 17, 4100, 64), mask="causal")  # a prefill chunk: numpy's softmax
    assert len(kernel) == 3 and len(calls) == 1
    run(*(a.astype(mx.float16) for a in qkv(1, 9, 3, 1, 300, 64)))  # not float32: MLX's
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"attention.kernel"}))
    run(*qkv(1, 9, 3, 1, 3000, 64))
    assert len(kernel) == 3
