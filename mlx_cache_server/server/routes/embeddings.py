"""POST /v1/embeddings"""

from __future__ import annotations

from fastapi import APIRouter

from ...serving.embeddings import EmbeddingList, EmbeddingRequest
from ..auth import Tenant
from ..state import State
from .chat import ERRORS

router = APIRouter(tags=["embeddings"])


@router.post(
    "/v1/embeddings", response_model=EmbeddingList, responses=ERRORS, summary="Create embeddings"
)
async def create_embeddings(req: EmbeddingRequest, state: State, tenant: Tenant) -> EmbeddingList:
    async with state.model(req.model, "embedding") as served:
        return await served.embeddings.create(req)
