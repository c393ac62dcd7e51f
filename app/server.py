"""The FastAPI application and the engine it serves from."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from fastapi import FastAPI

from prompt_cache import PromptCache

from . import errors
from .engine import Engine
from .generation import Limits
from .routes import chat, completions, health, models
from .settings import Settings

log = logging.getLogger("mlx_cache_server")


def create_app(engine: Engine, limits: Limits | None = None) -> FastAPI:
    app = FastAPI(
        title="mlx-cache-server",
        summary="OpenAI-compatible MLX server with a shared prefix-sharing prompt cache",
        version="0.1.0",
    )
    app.state.engine = engine
    app.state.limits = limits or Limits()
    app.state.started = int(time.time())
    app.state.model_aliases = model_aliases(engine.model_id)
    errors.install(app)
    for module in (chat, completions, models, health):
        app.include_router(module.router)
    return app


def model_aliases(model_id: str) -> set[str]:
    """Names a request may use for the served model."""
    return {model_id, Path(model_id).name, "default"}


def build_engine(settings: Settings, model_path: str) -> Engine:
    from mlx_lm import load

    model, tokenizer = load(model_path)
    context = settings.context_length or _context_length(model)
    cache = None
    if not settings.no_cache:
        cache = PromptCache(settings.cache_max_sequences, settings.cache_max_bytes)
    return Engine(
        model,
        tokenizer,
        model_id=settings.served_model_name or _model_id(model_path),
        cache=cache,
        context_length=context,
        completion_batch_size=settings.completion_batch_size,
        prefill_batch_size=settings.prefill_batch_size,
        prefill_step_size=settings.prefill_step_size,
    )


def limits_of(settings: Settings) -> Limits:
    return Limits(
        max_tokens_cap=settings.max_tokens_cap, default_max_tokens=settings.default_max_tokens
    )


def _model_id(model_path: str) -> str:
    path = Path(model_path)
    return path.name if path.exists() else model_path


def weights_dtype(model) -> str:
    from mlx.utils import tree_flatten

    kinds = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())}
    return "/".join(sorted(kinds))


def _context_length(model) -> int:
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096
