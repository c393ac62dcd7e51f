"""A model as the server serves it: a generating model's engine with one serving class per
API surface, or an embedding model's embedder with the embeddings API's; and the pool of
the configured models, each served so once `ModelLoader` has loaded it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine import Engine
from ..models.embedding import Embedder
from ..models.loader import ModelLoader, Serve
from ..models.pool import ModelPool
from ..models.specs import ModelNames, ModelSpec
from ..settings import Settings
from .anthropic import MessagesServing
from .chat import ChatCompletionsServing
from .completions import CompletionsServing
from .defaults import SamplingDefaults, sampling_defaults
from .embeddings import EmbeddingsServing
from .metrics import Metrics
from .response_file import stored_responses_path
from .response_store import ResponseStore
from .responses import ResponsesServing


@dataclass(eq=False)
class ServedModel:
    """A loaded model: a generating model's engine and serving classes, or an embedding
    model's (`ServerState.model` hands each request the kind its API needs)."""

    spec: ModelSpec
    settings: Settings  # the server's, with the model's own overrides
    engine: Engine | None = None
    defaults: SamplingDefaults | None = None
    chat: ChatCompletionsServing | None = None
    completions: CompletionsServing | None = None
    messages: MessagesServing | None = None
    responses: ResponsesServing | None = None
    embeddings: EmbeddingsServing | None = None

    @property
    def embedder(self) -> Embedder | None:
        """An embedding model's embedder; None for a generating model."""
        return self.embeddings.embedder if self.embeddings is not None else None

    def close_serving(self) -> None:
        """Stop what the serving classes run themselves: an embedding model's requests'
        thread, idle once the model is closed (it has none running)."""
        if self.embeddings is not None:
            self.embeddings.close()


def serve_engine(
    spec: ModelSpec, engine: Engine, settings: Settings, metrics: Metrics, names: ModelNames
) -> ServedModel:
    """One serving class per API surface over the engine; `names`: what requests may send."""
    defaults = sampling_defaults(settings, engine.generation_config)
    chat = ChatCompletionsServing(engine, settings, metrics, names, defaults)
    return ServedModel(
        spec=spec,
        engine=engine,
        settings=settings,
        defaults=defaults,
        chat=chat,
        completions=CompletionsServing(engine, settings, metrics, names, defaults),
        messages=MessagesServing(chat),
        responses=ResponsesServing(chat, _response_store(settings, engine.model_id)),
    )


def serving(metrics: Metrics, names: Callable[[ModelSpec], ModelNames]) -> Serve[ServedModel]:
    """How `ModelLoader` serves what it loads: an engine by `serve_engine`, an embedder by
    the embeddings API's serving class; `names`: what requests may send for a model."""

    def serve(spec: ModelSpec, settings: Settings, loaded: Engine | Embedder) -> ServedModel:
        if isinstance(loaded, Embedder):
            embeddings = EmbeddingsServing(loaded, settings, metrics)
            return ServedModel(spec=spec, settings=settings, embeddings=embeddings)
        return serve_engine(spec, loaded, settings, metrics, names(spec))

    return serve


def _response_store(settings: Settings, model_id: str) -> ResponseStore:
    """A model's stored responses: with a cache dir, in a file beside the disk tier."""
    if not settings.cache_dir:
        return ResponseStore()
    path = stored_responses_path(settings.cache_dir, model_id)
    return ResponseStore(path=path, model_id=model_id)


def model_pool(
    settings: Settings,
    specs: list[ModelSpec],
    metrics: Metrics,
    clock: Callable[[], float] = time.monotonic,
    group: Any = None,
) -> ModelPool[ServedModel]:
    """The pool of the configured models, loaded by `ModelLoader`, none loaded yet."""
    loader = ModelLoader(settings, serving(metrics, lambda spec: pool.naming(spec)), group)
    pool = ModelPool(
        specs,
        loader,
        budget=settings.memory_budget,
        load_timeout=settings.model_load_timeout,
        clock=clock,
        answer_any=settings.answer_any_model,
    )
    return pool
