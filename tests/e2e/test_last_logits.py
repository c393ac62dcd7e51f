"""`last_logits` returns what the model's last row would be, computing only that row."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_cache_server.mlx_adapter.last_logits import last_logits
from tests.tiny_model import CONFIG


class Spy(nn.Module):
    """An output projection recording how many positions it was given."""

    def __init__(self, project) -> None:
        super().__init__()
        self.project = project
        self.positions: list[int] = []

    def __call__(self, x: mx.array) -> mx.array:
        self.positions.append(x.shape[1])
        return self.project(x)


@pytest.mark.parametrize("tied", [False, True])
def test_last_row_equals_the_full_forward_pass(tied):
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict({**CONFIG, "tie_word_embeddings": tied}))
    prompt = mx.array([[5, 17, 3, 40, 41, 42, 9, 11]])
    cache = make_prompt_cache(model)
    model(prompt[:, :3], cache=cache)
    want = model(prompt[:, 3:], cache=make_cache_like(model, prompt[:, :3]))[:, -1, :]
    got = last_logits(model, prompt[:, 3:], cache)
    assert got.shape == want.shape
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    # Put back as it was: the next full forward pass projects every position again.
    assert model(prompt).shape == (1, prompt.shape[1], CONFIG["vocab_size"])
    assert "as_linear" not in vars(model.model.embed_tokens)


def test_the_projection_sees_only_the_last_position():
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    spy = Spy(model.lm_head)
    model.lm_head = spy
    last_logits(model, mx.array([[1, 2, 3, 4, 5]]), make_prompt_cache(model))
    model(mx.array([[1, 2, 3]]))
    assert spy.positions == [1, 3]
    assert model.lm_head is spy


def make_cache_like(model, prefix: mx.array) -> list:
    cache = make_prompt_cache(model)
    model(prefix, cache=cache)
    return cache
