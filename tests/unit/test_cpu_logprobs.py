"""Logits normalized through numpy (`runtime.cpu_logprobs`) against MLX's logsumexp."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from mlx_cache_server.mlx_adapter.model_patches import GENERATE as generate  # the module
from mlx_cache_server.runtime import cpu_logprobs
from mlx_cache_server.runtime.fast_path import FAST_PATH, Route

INF = float("inf")


@pytest.mark.parametrize("keepdims", [True, False])
@pytest.mark.parametrize("shape", [(8, 49152), (3, 300), (2, 2, 300)])
def test_equals_mlx_within_float32_tolerance(shape, keepdims):
    mx.random.seed(5)
    logits = mx.random.normal(shape) * 12
    got = cpu_logprobs.logsumexp(logits, axis=-1, keepdims=keepdims)
    expected = mx.logsumexp(logits, axis=-1, keepdims=keepdims)
    assert got.shape == expected.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-6, atol=1e-5)


def test_rows_masked_by_a_grammar_and_infinite_rows_give_what_mlx_gives():
    logits = mx.array([[-INF, -INF, -INF], [0.0, -INF, 2.0], [INF, 0.0, 1.0], [3.0, 3.0, 3.0]])
    got = cpu_logprobs.logsumexp(logits, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.array(got), np.array(mx.logsumexp(logits, -1, keepdims=True)))


def test_a_row_gives_the_same_beside_any_others():
    mx.random.seed(6)
    rows = mx.random.normal((6, 4000)) * 8
    together = cpu_logprobs.logsumexp(rows, axis=-1).tolist()
    for i in range(4):
        assert cpu_logprobs.logsumexp(rows[i : i + 3], axis=-1).tolist() == together[i : i + 3]


def test_other_axes_dtypes_and_off_go_to_mlx(monkeypatch):
    calls = []
    original = mx.logsumexp

    def spy(a, axis=None, keepdims=False):
        calls.append((a.dtype, axis))
        return original(a, axis=axis, keepdims=keepdims)

    monkeypatch.setattr(mx, "logsumexp", spy)
    rows = mx.ones((3, 16))
    cpu_logprobs.logsumexp(rows, axis=-1)  # float32, 3 rows: numpy's
    assert calls == []
    cpu_logprobs.logsumexp(rows[:2], axis=-1)  # one or two streams: MLX's
    cpu_logprobs.logsumexp(rows, axis=0)
    cpu_logprobs.logsumexp(rows)
    cpu_logprobs.logsumexp(rows.astype(mx.float16), axis=-1)
    monkeypatch.setattr(FAST_PATH, "off", frozenset({"logsumexp"}))
    cpu_logprobs.logsumexp(rows, axis=-1)
    assert [axis for _, axis in calls] == [-1, 0, None, -1, -1]


def test_install_routes_the_batch_generators_normalization_here(tiny_model, monkeypatch):
    """mlx-lm's BatchGenerator calls the installed logsumexp for every step; its greedy
    tokens are the ones MLX's own normalization gives; mlx.core is left as it is."""
    model, tokenizer = tiny_model
    prompts = [tokenizer.encode(t) for t in ("one two three", "four five", "six")]

    def tokens() -> list[list[int]]:
        gen = generate.BatchGenerator(model, stop_tokens=[], prefill_batch_size=3)
        gen.insert(prompts, max_tokens=[6] * 3, samplers=[make_sampler(0.0)] * 3)
        out: dict[int, list[int]] = {}
        while len(out) < 3 or any(len(v) < 6 for v in out.values()):
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
        gen.close()
        return [out[uid] for uid in sorted(out)]

    monkeypatch.setattr(generate, "mx", mx)  # MLX's, whatever a server installed before
    expected = tokens()
    calls, route = [], FAST_PATH.logsumexp
    monkeypatch.setattr(
        FAST_PATH, "logsumexp", lambda *a: calls.append(route(*a) is Route.NUMPY) or route(*a)
    )
    assert cpu_logprobs.install()
    assert not cpu_logprobs.install()  # once is enough
    assert mx.logsumexp is not generate.mx.logsumexp and generate.mx.array is mx.array
    assert tokens() == expected
    assert sum(calls) >= 6  # each step's 3 rows through numpy
