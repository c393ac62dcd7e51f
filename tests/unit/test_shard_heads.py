"""Splitting a model by heads is refused, with what to do, where a layer's heads do not
divide by the processes: attention's, and a hybrid's linear attention's too."""

from __future__ import annotations

import pytest

from mlx_cache_server.models.sharding import check_heads

QWEN3_5 = {"num_attention_heads": 4, "num_key_value_heads": 2, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4}  # fmt: skip


def test_heads_that_divide_are_split():
    check_heads(QWEN3_5, 2)
    check_heads({"text_config": QWEN3_5}, 2)


@pytest.mark.parametrize("key", sorted(QWEN3_5))
def test_any_kind_of_heads_that_do_not_divide_is_refused(key):
    with pytest.raises(ValueError, match="do not split over 2 processes"):
        check_heads({**QWEN3_5, key: 3}, 2)
