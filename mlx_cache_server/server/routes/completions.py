"""POST /v1/completions (legacy text completions)"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...serving.openai_bodies import Completion, CompletionRequest
from ..auth import Tenant
from ..state import State
from ..while_loading import OPENAI, respond
from .chat import ERRORS

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions", response_model=Completion, responses=ERRORS, summary="Create a completion"
)
async def create_completion(req: CompletionRequest, request: Request, state: State, tenant: Tenant):
    return await respond(
        state,
        req.model,
        lambda served: served.completions.create(req, request, tenant),
        OPENAI if req.stream else None,
    )
