"""Pooling hidden states into one vector, and reading it from sentence-transformers files."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_cache_server.models.embedding import Pooling, pool, sentence_transformers_pooling

HIDDEN = mx.array(np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2))  # right-padded rows


def test_each_mode_reads_only_the_real_tokens_of_a_padded_row():
    lengths = [3, 1]  # the second row: one token, then padding
    assert pool(HIDDEN, lengths, "last").tolist() == [[4, 5], [6, 7]]
    assert pool(HIDDEN, lengths, "mean").tolist() == [[2, 3], [6, 7]]


def test_the_files_name_the_pooling_and_whether_vectors_are_normalized(tmp_path):
    assert sentence_transformers_pooling(tmp_path) is None  # not a sentence-transformers folder
    modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    assert sentence_transformers_pooling(tmp_path) == Pooling("last", normalize=False)
    modules.append({"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert sentence_transformers_pooling(tmp_path) == Pooling("mean", normalize=True)


def test_what_a_causal_model_cannot_reproduce_is_refused(tmp_path):
    modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    with pytest.raises(ValueError, match="pooling"):  # the first token sees only itself
        sentence_transformers_pooling(tmp_path)
    modules.append({"path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):  # a projection this server does not run
        sentence_transformers_pooling(tmp_path)
