"""Attention on our kernel (`mlx_cache_server/runtime/kernel_attention.py`) against MLX's own."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base

from mlx_cache_server.runtime import kernel_attention, native
from mlx_cache_server.runtime.fast_path import FAST_PATH

pytestmark = pytest.mark.skipif(
    FAST_PATH.kernels("attention") is None, reason=f"no kernels' module here: {native.problem}"
)


def operands(b, heads, kv_heads, n_q, n_k, dim=64, vdim=None, seed=0, room=0):
    """Queries, and keys and values as a cache hands them out: the first `n_k` positions
    of buffers `room` positions longer."""
    mx.random.seed(seed)
    q = mx.random.normal((b, heads, n_q, dim)) * 0.5
    k = mx.random.normal((b, kv_heads, n_k + room, dim))[..., :n_k, :]
    v = mx.random.normal((b, kv_heads, n_k + room, vdim or dim))[..., :n_k, :]
    return q, k, v


def theirs(q, k, v, mask, scale=0.125):
    return base.scaled_dot_product_attention(q, k, v, cache=None, scale=scale, mask=mask)


def ours(q, k, v, mask, scale=0.125):
    out = kernel_attention.attention(q, k, v, scale, mask)
    assert out is not None, "the kernel declined"
    return out


CASES = [  # batch, heads, kv heads, queries, keys, dim, vdim
    (1, 9, 3, 1, 1500, 64, None),  # the default model's decode step
    (1, 9, 3, 8, 1500, 64, None),  # a draft's pass
    (4, 9, 3, 1, 300, 64, None),  # four streams
    (2, 4, 4, 3, 17, 80, None),  # no grouping; head size with a tail past 16 lanes
    (1, 8, 2, 16, 40, 32, 48),  # values wider than keys
    (3, 2, 1, 2, 2, 16, None),  # as few keys as queries
]


@pytest.mark.parametrize(
    "case,mask", [(c, m) for c in CASES for m in ("causal", None) if m or c[3] == 1]
)
def test_equals_mlx_within_float32_rounding(case, mask):
    b, heads, kv_heads, n_q, n_k, dim, vdim = case
    q, k, v = operands(b, heads, kv_heads, n_q, n_k, dim, vdim, room=7)
    np.testing.assert_allclose(
        np.array(ours(q, k, v, mask)), np.array(theirs(q, k, v, mask)), rtol=2e-5, atol=2e-6
    )


def test_boolean_masks_per_sequence_as_batches_make_them():
    """Left padding and gaps hidden per row; a row masked everywhere averages the values,
    as MLX's kernel gives it."""
    b, n_q, n_k = 3, 4, 50
    q, k, v = operands(b, 6, 2, n_q, n_k, seed=1)
    rng = np.random.default_rng(1)
    m = rng.random((b, 1, n_q, n_k)) > 0.3
    m[1, 0, 2] = False  # a fully masked row
    mask = mx.array(m)
    np.testing.assert_allclose(
        np.array(ours(q, k, v, mask)), np.array(theirs(q, k, v, mask)), rtol=2e-5, atol=2e-6
    )


def test_additive_masks_with_heads_and_minus_infinity():
    q, k, v = operands(2, 4, 2, 3, 30, seed=2)
    rng = np.random.default_rng(2)
    m = rng.standard_normal((2, 4, 3, 30)).astype(np.float32)
    m[:, :, :, :5] = -np.inf
    np.testing.assert_allclose(
        np.array(ours(q, k, v, mx.array(m))),
        np.array(theirs(q, k, v, mx.array(m))),
        rtol=2e-5,
        atol=2e-6,
    )


def test_masks_across_the_pieces_of_a_long_row():
    """Keys past KEY_SPLIT (256) are cut into pieces computed apart and combined: a piece
    masked whole (to -inf, or to False), scores far below the others', a row masked
    everywhere by a boolean mask."""
    b, n_q, n_k = 2, 3, 700
    q, k, v = operands(b, 4, 2, n_q, n_k, seed=3)
    rng = np.random.default_rng(3)
    adds = rng.standard_normal((b, 4, n_q, n_k)).astype(np.float32)
    adds[:, :, :, 256:512] = -np.inf  # the second piece, whole
    adds[0, :, :, :256] -= 60.0  # the first piece's weights vanish beside the third's
    bools = rng.random((b, 1, n_q, n_k)) > 0.3
    bools[:, :, 0, 512:] = False
    bools[1, 0, 1] = False  # a row masked everywhere averages the values
    for mask in (mx.array(adds), mx.array(bools)):
        np.testing.assert_allclose(
            np.array(ours(q, k, v, mask)), np.array(theirs(q, k, v, mask)), rtol=2e-5, atol=2e-6
        )


@pytest.mark.parametrize("n_k", [700, 704, 37])
@pytest.mark.parametrize("as_array", [False, True])
def test_a_query_gets_the_same_bits_alone_as_in_a_pass(n_k, as_array):
    """Why a draft's pass can equal single steps: query i of a causal pass is the single
    step at its position, over the keys up to it; also where the mask is an array, as a
    batch's cache makes it, whose row runs on over the keys masked past the query."""
    n_q = 8
    q, k, v = operands(1, 9, 3, n_q, n_k, seed=3)
    mask = "causal"
    if as_array:
        mask = mx.array(np.arange(n_k - n_q, n_k)[:, None] >= np.arange(n_k)[None, :])
    together = np.array(ours(q, k, v, mask))
    for i in range(n_q):
        upto = n_k - n_q + i + 1
        alone = ours(q[:, :, i : i + 1], k[:, :, :upto], v[:, :, :upto], None)
        assert np.array_equal(np.array(alone)[:, :, 0], together[:, :, i]), f"query {i}"


def test_a_sequence_gets_the_same_bits_alone_as_in_a_batch():
    """Rows are computed by key head in units of several rows: which rows share a unit
    (other sequences', a pass's other positions) does not change a row's bits."""
    q, k, v = operands(3, 9, 3, 5, 260, seed=4)
    mask = mx.array(np.random.default_rng(4).random((3, 1, 5, 260)) > 0.2)
    together = np.array(ours(q, k, v, mask))
    for s in range(3):
        alone = ours(q[s : s + 1], k[s : s + 1], v[s : s + 1], mask[s : s + 1])
        assert np.array_equal(np.array(alone)[0], together[s]), f"sequence {s}"
        for i in range(5):
            one = ours(
                q[s : s + 1, :, i : i + 1],
                k[s : s + 1],
                v[s : s + 1],
                mask[s : s + 1, :, i : i + 1],
            )
            assert np.array_equal(np.array(one)[0, :, 0], together[s, :, i]), (s, i)


def test_nan_scores_give_nan_as_mlx_does():
    q, k, v = operands(1, 2, 1, 1, 40, seed=5)
    k = mx.where(mx.arange(40)[None, None, :, None] == 3, mx.array(float("nan")), k)
    assert np.isnan(np.array(ours(q, k, v, None))).all()
    assert np.isnan(np.array(theirs(q, k, v, None))).all()


def test_large_scores_stay_finite():
    """The exp is range-reduced: scores in the hundreds do not overflow."""
    q, k, v = operands(1, 2, 1, 1, 64, seed=4)
    q = q * 400
    got, expected = np.array(ours(q, k, v, None)), np.array(theirs(q, k, v, None))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_declines_what_it_does_not_compute():
    q, k, v = operands(1, 4, 2, 17, 40)
    assert kernel_attention.attention(q, k, v, 0.1, "causal") is None  # too many queries
    q, k, v = operands(1, 3, 2, 1, 40)
    assert kernel_attention.attention(q, k, v, 0.1, None) is None  # heads not grouped evenly
    q, k, v = operands(1, 4, 2, 5, 3)
    assert kernel_attention.attention(q, k, v, 0.1, None) is None  # more queries than keys
    q, k, v = operands(2, 4, 2, 2, 30)
    for mask in (mx.ones((3, 1, 2, 30), mx.bool_), mx.ones((3, 30)), mx.ones((2, 30), mx.int32)):
        assert kernel_attention.attention(q, k, v, 0.1, mask) is None  # not these rows' mask
    assert kernel_attention.attention(q, k, v, 0.1, "sliding") is None


def test_operands_strided_along_their_last_axis():
    """Keys and values as a transposed view (their last axis strided): copied for the
    kernel, the same result."""
    mx.random.seed(6)
    q = mx.random.normal((2, 4, 3, 32))
    k = mx.random.normal((2, 2, 32, 50)).swapaxes(-1, -2)
    v = mx.random.normal((2, 2, 48, 50)).swapaxes(-1, -2)
    np.testing.assert_allclose(
        np.array(ours(q, k, v, "causal")), np.array(theirs(q, k, v, "causal")),
        rtol=2e-5, atol=2e-6,
    )  # fmt: skip


@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_a_pass_s_live_queries_only_have_the_same_bits_and_the_fillers_are_zeros(mask):
    from mlx_cache_server.runtime.live_positions import live_positions

    q, k, v = operands(4, 9, 3, 8, 600)
    held = mask
    if mask == "bool":
        held = mx.array(np.random.default_rng(0).random((4, 1, 8, 600)) > 0.2)
    lengths = [8, 1, 3, 0]
    full = np.asarray(ours(q, k, v, held))
    with live_positions(lengths, 8):
        live = np.asarray(ours(q, k, v, held))
        other = np.asarray(ours(q[:, :, :4], k, v, "causal"))  # another width: every query
    for b, n in enumerate(lengths):
        assert np.array_equal(live[b, :, :n], full[b, :, :n])
        assert not live[b, :, n:].any()
    assert np.array_equal(other, np.asarray(ours(q[:, :, :4], k, v, "causal")))
