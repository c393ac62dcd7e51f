"""Serving one model sharded over the processes `mlx.launch` starts (`engine.sharded_steps`).

Every rank loads its shard: some heads of every layer (tensor parallel, mlx-lm's
`Model.shard`) or, with `--pipeline`, some of the layers (`model.model.pipeline`).
Rank 0 serves HTTP; the others only run the engine's steps (`follow`). What the
other ranks cannot see (a disk tier, several models loaded and unloaded on demand,
a quantized KV cache run outside the batch) is refused at start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..settings import Settings

log = logging.getLogger("mlx_cache_server.sharded")


def launched_group() -> mx.distributed.Group | None:
    """The group of processes `mlx.launch` started this one in; None when run alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def refusal(settings: Settings, n_models: int) -> str | None:
    """Why these settings cannot be served sharded, or None."""
    if n_models > 1 or settings.memory_budget is not None:
        return "a sharded server serves one model: drop the other --model flags and [[models]]"
    if settings.cache_dir:
        return "a sharded server has no disk tier yet: drop --cache-dir"
    if settings.draft_model:
        return "a sharded server has no draft model yet: drop --draft-model"
    if settings.kv_bits is not None:
        return "a sharded server keeps the KV cache unquantized: drop --kv-bits"
    if not settings.shard_timeout >= 1:  # an idle rank 0 waits 0.1 s for requests each step
        return "--shard-timeout must be at least 1 second"
    return None


def load_shard(path: str, group: mx.distributed.Group, pipeline: bool) -> tuple[Any, Any]:
    """This rank's shard of the model at `path` (a local folder), and the tokenizer.

    mlx-lm's `sharded_load` does the same after fetching a hub id's files; a local
    folder needs no fetch, nor the index file it reads to fetch only a shard's.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(Path(path), lazy=True, strict=False)
    if pipeline:
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"mlx-lm cannot split {config.get('model_type')} models by layers")
        model.model.pipeline(group)
    else:
        if not hasattr(model, "shard"):
            raise ValueError(f"mlx-lm cannot split {config.get('model_type')} models by heads")
        check_heads(config, group.size())
        model.shard(group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # all loaded
    return model, tokenizer


def check_heads(config: dict[str, Any], processes: int) -> None:
    """mlx-lm splits every layer's heads evenly, and gives a wrong model when they do not
    divide (mlx-lm 0.32; uneven splits are proposed upstream in
    https://github.com/ml-explore/mlx-lm/pull/1863): refuse that with what to do instead."""
    text = config.get("text_config", config)
    for key, what in (
        ("num_attention_heads", "attention"),
        ("num_key_value_heads", "KV"),
        ("linear_num_key_heads", "linear-attention key"),
        ("linear_num_value_heads", "linear-attention value"),
    ):
        heads = text.get(key)
        if isinstance(heads, int) and heads % processes:
            raise ValueError(
                f"the model's {heads} {what} heads per layer do not split over {processes} "
                "processes: launch a number of them that divides it, or split by layers "
                "(--pipeline) if mlx-lm can for this model"
            )


def watch(engine: Any, timeout: float, on_failure: Callable[[str], None]) -> None:
    """On rank 0, beside its engine: a step running past `timeout` seconds is taken to wait
    on a process that died; its requests end with an error and `on_failure` is told."""
    while engine.failure is None:
        since = engine.stepping_since
        if since is not None and time.monotonic() - since > timeout:
            why = f"a step waited over {timeout:g}s for the other processes"
            engine.abandon(why)
            on_failure(why)
            return
        time.sleep(min(1.0, timeout / 4))
