"""GET /v1/models"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ...serving.errors import APIError
from ...serving.schemas import ModelCard, ModelList
from ..auth import authorize
from ..state import State

router = APIRouter(tags=["models"], dependencies=[Depends(authorize)])


@router.get("/v1/models", response_model=ModelList, summary="List the served model")
async def list_models(state: State) -> ModelList:
    return ModelList(data=[ModelCard(id=state.engine.model_id, created=state.started)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, summary="Describe a model")
async def get_model(model_id: str, state: State) -> ModelCard:
    if model_id not in state.model_aliases:
        raise APIError(
            404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found"
        )
    return ModelCard(id=state.engine.model_id, created=state.started)
