"""An engine built from the settings: the model loaded (or this rank's shard of it), its
prompt cache (with the disk tier, if any) and its steps."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_cache_server.prompt_cache import PromptCache, layers
from mlx_cache_server.prompt_cache.disk import DiskTier, DiskTierBusy, DiskTierUnavailable

from ..engine import Engine
from ..engine.draft_model import DraftModel
from ..engine.quantized_kv import check_quantized
from ..engine.sharded_steps import FollowerSteps, LeaderSteps, rank_bytes
from ..runtime import cpu_fast_path, native
from ..runtime.blas import describe as describe_blas
from ..runtime.fast_path import FAST_PATH
from ..settings import Settings
from .fingerprint import kv_fingerprint
from .folders import generation_config, model_folder
from .sharding import load_shard
from .specs import model_id as model_id_of
from .vision_load import ImageLimits, open_vision

log = logging.getLogger("mlx_cache_server")
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "context_length")  # configs name it so


def build_engine(
    settings: Settings, model_path: str, group: mx.distributed.Group | None = None
) -> Engine:
    """The engine for the model at `model_path`; with `group`, for this rank's shard of it
    (`sharding`), its steps decided by rank 0."""
    from mlx_lm import load

    if group is None:
        model, tokenizer = load(model_path)
    else:
        model, tokenizer = load_shard(model_path, group, settings.pipeline)
    FAST_PATH.on = settings.cpu_fast_path  # the one switch: off, every call is MLX's own
    if FAST_PATH.installs():
        if not cpu_fast_path.install(model):
            log.warning("this model's attention cannot take the CPU fast path: MLX's is used")
        if native.layers() is None:
            log.warning("our CPU kernels are off, MLX's own ops run: %s", native.problem)
        else:
            log.info("our CPU kernels: %s", native.variant)
    folder = model_folder(model_path)
    vision, no_images = None, "it is not a vision model"
    if folder is not None and group is None:  # after the fast path: it wraps its embedding
        limits = ImageLimits(
            settings.max_image_pixels, settings.max_images, settings.fetch_image_urls
        )
        vision, no_images = open_vision(folder, model, limits)
    model_config = generation_config(folder) if folder is not None else {}
    context = settings.context_length or context_length_of(model)
    model_id = settings.served_model_name or model_id_of(model_path)
    if settings.kv_bits is not None:
        check_quantized(model, settings.kv_group_size, settings.kv_bits)
    cache = None
    if not settings.no_cache:
        disk = None
        if settings.cache_dir:
            root = Path(settings.cache_dir).expanduser()
            kv = {"bits": settings.kv_bits, "group_size": settings.kv_group_size}
            images = vision.encoder if vision is not None else None
            fingerprint = kv_fingerprint(folder, model_path, model, kv, model_id, images)
            try:
                disk = DiskTier(root, fingerprint, settings.cache_disk_bytes)
            except DiskTierBusy as e:  # two servers writing one index would corrupt it
                log.warning("disk tier off: %s; give each server its own --cache-dir", e)
            except DiskTierUnavailable as e:
                log.warning("disk tier off: %s; serving from RAM alone (give --cache-dir a "
                            "writable folder to keep the cache across restarts)", e)  # fmt: skip
        measure = layers.nbytes
        if group is not None:
            measure = rank_bytes(model, group, settings.pipeline)
        cache = PromptCache(settings.cache_max_sequences, settings.cache_max_bytes, disk, measure)
        if vision is not None and disk is not None:  # its sequences hold image ids
            vision.ids.keep_in(disk.folder / "image-ids")
        if vision is not None and cache.byte_budget is not None:
            # The encoder's output kept for recent images is a cache too, of what their KV
            # is made from: its bytes come out of the cache's budget, not on top of it.
            share = vision.features.budget = min(vision.features.budget, cache.max_bytes // 4)
            cache.max_bytes -= share
    engine = Engine(
        model,
        tokenizer,
        model_id=model_id,
        cache=cache,
        context_length=context,
        completion_batch_size=settings.completion_batch_size,
        prefill_batch_size=settings.prefill_batch_size,
        prefill_step_size=settings.prefill_step_size,
        decode_gap=settings.decode_gap,
        max_prefill_wait=settings.max_prefill_wait,
        generation_config=model_config,
        kv_bits=settings.kv_bits,
        kv_group_size=settings.kv_group_size,
        speculation=(speculate := speculation_pays(settings)),
        draft=load_draft(settings, tokenizer) if settings.draft_model and speculate else None,
        vision=vision,
        no_images=no_images,
    )
    if cache is not None:
        log.info("prompt cache for %s: %s", model_id, _mode_in_words(engine))
    if cache is not None and cache.disk is not None and engine.cache_mode != "prefix":
        log.warning("the disk tier keeps attention-only models' caches: this model's "
                    "stays in RAM")  # fmt: skip
    if group is not None:
        engine.sharded = True
        if group.rank() == 0:
            engine.steps = LeaderSteps(engine.local_steps, group, cache, engine.stats)
        else:
            engine.steps = FollowerSteps(group, cache, engine.grammars, engine.stats)
    return engine


def speculation_pays(settings: Settings) -> bool:
    """Whether drafts are verified: asked for, and not on a CPU whose matmuls run on the
    reference BLAS, where a pass over a draft's tokens costs several single steps."""
    if settings.draft_model and not settings.speculation:
        log.warning("--draft-model is not used: --no-speculation turns drafting off")
    if not settings.speculation:
        return False
    if mx.default_device() == mx.cpu and not describe_blas()[1]:
        log.warning("speculation off: without OpenBLAS, a pass over a draft costs more than "
                    "the steps it saves")  # fmt: skip
        return False
    return True


def load_draft(settings: Settings, tokenizer: Any) -> DraftModel:
    """`--draft-model`, checked against the served model's tokenizer."""
    from mlx_lm import load

    model, theirs = load(settings.draft_model)
    if theirs.vocab != tokenizer.vocab:
        raise ValueError(
            f"the draft model {settings.draft_model} has another tokenizer than the served "
            "model: a draft model must share its tokenizer, token for token"
        )
    if FAST_PATH.installs():
        cpu_fast_path.install(model)
    return DraftModel(model, settings.num_draft_tokens)


def _mode_in_words(engine: Engine) -> str:
    if engine.cache_mode == "prefix":
        return "attention layers, any stored prefix reusable"
    if engine.cache_mode == "checkpointed":
        return ("attention and sliding-window layers stored by token; recurrent-state layers, if "
                "any, checkpointed where messages end")  # fmt: skip
    return "whole-sequence snapshots (reused only where a stored sequence ends)"


def weights_dtype(model) -> str:
    from mlx.utils import tree_flatten

    kinds = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())}
    return "/".join(sorted(kinds))


def context_length_of(model: Any) -> int:
    args = getattr(model, "args", None)
    for name in CONTEXT_KEYS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096
