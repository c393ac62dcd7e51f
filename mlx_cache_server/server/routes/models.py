"""GET /v1/models, GET /v1/models/{id}; POST /v1/models/{id}/load and /unload (admin)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends

from ...models.engine_build import CONTEXT_KEYS
from ...models.loader import local_folder
from ...models.pool import ModelState
from ...serving.openai_bodies import ModelCard, ModelList
from ..auth import Admin, authorize
from ..state import ServerState, State, pool_errors

router = APIRouter(tags=["models"], dependencies=[Depends(authorize)])
admin = APIRouter(tags=["models"], dependencies=[Admin])  # the admin key, not a tenant's


@router.get("/v1/models", response_model=ModelList, summary="List the configured models")
async def list_models(state: State) -> ModelList:
    return ModelList(data=[_card(state, s) for s in state.models.states()])


@admin.post(
    "/v1/models/{model_id:path}/load",
    response_model=ModelCard,
    summary="Load a model now (admin)",
)
async def load_model(model_id: str, state: State) -> ModelCard:
    with pool_errors(state.models):
        spec = await state.models.load(model_id)
    return _card_of(state, spec.id)


@admin.post(
    "/v1/models/{model_id:path}/unload",
    response_model=ModelCard,
    summary="Unload a model now (admin); refused while it has requests running",
)
async def unload_model(model_id: str, state: State) -> ModelCard:
    with pool_errors(state.models):
        spec = state.models.spec(model_id)
        await state.models.unload(model_id)
    return _card_of(state, spec.id)


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, summary="Describe a model")
async def get_model(model_id: str, state: State) -> ModelCard:
    with pool_errors(state.models):
        spec = state.models.spec(model_id)
    return _card_of(state, spec.id)


def _card_of(state: ServerState, model_id: str) -> ModelCard:
    return next(_card(state, s) for s in state.models.states() if s.spec.id == model_id)


def _card(state: ServerState, s: ModelState) -> ModelCard:
    served = state.models.get(s.spec.id) if s.status == "loaded" else None
    if served is None:
        context = _configured_context(state, s)
    elif served.engine is not None:
        context = served.engine.context_length
    else:
        context = served.embeddings.embedder.context_length
    return ModelCard(
        id=s.spec.id,
        type=state.models.loader.kind(s.spec),
        created=state.started,
        status=s.status,
        loaded=s.status == "loaded",
        context_length=context,
        aliases=sorted(state.models.names(s.spec) - {s.spec.id}),
        pinned=s.spec.pinned,
        ttl=s.spec.ttl,
        memory_bytes=s.bytes,
    )


def _configured_context(state: ServerState, s: ModelState) -> int | None:
    """An unloaded model's context: its setting, else its config.json's, if on disk."""
    configured = s.spec.settings(state.settings).context_length
    if configured is not None:
        return configured
    folder = local_folder(s.spec)  # a hub id not fetched yet: known once loaded
    try:
        config = json.loads((folder / "config.json").read_text()) if folder else {}
    except (OSError, ValueError):
        return None
    values = [config.get(key) for key in CONTEXT_KEYS]
    return next((v for v in values if isinstance(v, int) and v > 0), None)
