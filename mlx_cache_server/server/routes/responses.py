"""POST /v1/responses (OpenAI's Responses API)"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...serving.responses import ResponsesRequest
from ..auth import Tenant
from ..state import State
from ..while_loading import respond, responses

router = APIRouter(tags=["responses"])


@router.post("/v1/responses", summary="Create a response (OpenAI's Responses API)")
async def create_response(req: ResponsesRequest, request: Request, state: State, tenant: Tenant):
    return await respond(
        state,
        req.model,
        lambda served: served.responses.create(req, request, tenant),
        responses(req) if req.stream else None,
    )
