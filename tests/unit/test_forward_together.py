"""One pass over a prompt's chunk and the streams' tokens computes what two passes do."""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from mlx_cache_server.runtime.forward_together import forward_together, logits, supports
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    kind, _, tied = request.param.partition("-")
    path = build_tiny_model(
        tmp_path_factory.mktemp(request.param), model_type=kind, tie_word_embeddings=bool(tied)
    )
    return load(str(path))[0]


def filled(model, lengths: list[int], seed: int) -> list[BatchKVCache]:
    """A batch cache holding random prompts of `lengths`, left-padded as mlx-lm pads them."""
    longest = max(lengths)
    cache = [BatchKVCache(left_padding=[longest - n for n in lengths]) for _ in model.layers]
    prompts = mx.random.randint(
        0, model.args.vocab_size, (len(lengths), longest), key=mx.random.key(seed)
    )
    mx.eval(model(prompts, cache=cache), [c.state for c in cache])
    return cache


def arrays(cache: list[BatchKVCache]) -> list[np.ndarray]:
    return [
        np.array(a) for c in cache for a in (c.keys[..., : c._idx, :], c.values[..., : c._idx, :])
    ]


@pytest.mark.parametrize("prompt_wanted", [True, False])
def test_one_pass_gives_each_part_what_its_own_pass_gives(model, prompt_wanted):
    streams, prompt = filled(model, [7, 19, 12], seed=1), filled(model, [40], seed=2)
    streams_apart, prompt_apart = copy.deepcopy(streams), copy.deepcopy(prompt)
    step = mx.array([[3], [5], [8]])
    chunk = mx.random.randint(0, model.args.vocab_size, (1, 33), key=mx.random.key(3))

    expected = model(step, cache=streams_apart)
    expected_prompt = model.model(chunk, cache=prompt_apart)
    parts = [(step, streams), (chunk, prompt)]
    hidden, prompt_hidden = forward_together(model, parts, wanted=[True, prompt_wanted])
    got = logits(model, hidden)
    mx.eval(expected, expected_prompt, got, [c.state for c in streams + prompt + prompt_apart])

    # The same values but for the last bits a matrix product's rows may differ in when the
    # matrix has more of them.
    assert got.shape == expected.shape
    assert np.allclose(np.array(got), np.array(expected), atol=1e-4)
    assert (np.array(got.argmax(-1)) == np.array(expected.argmax(-1))).all()
    if prompt_wanted:
        assert np.allclose(np.array(prompt_hidden), np.array(expected_prompt), atol=1e-4)
    else:  # left out after its last keys and values, which its cache took all the same
        assert prompt_hidden is None
    for ours, theirs in zip(
        arrays(streams + prompt), arrays(streams_apart + prompt_apart), strict=True
    ):
        assert ours.shape == theirs.shape
        assert np.allclose(ours, theirs, atol=1e-4)
    assert [c.offset.tolist() for c in prompt] == [c.offset.tolist() for c in prompt_apart]


def test_other_models_are_not_taken(model):
    assert supports(model)

    class Wrapped:  # a model of another module (a VL wrapper, say): its own pass is unknown
        def __init__(self, inner):
            self.model = inner.model

    assert not supports(Wrapped(model))


def test_a_model_with_sliding_window_layers_is_not_taken(tmp_path: Path):
    # Such a layer takes a mask of its own, which the pass does not make.
    path = build_tiny_model(
        tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=4
    )
    assert not supports(load(str(path))[0])
