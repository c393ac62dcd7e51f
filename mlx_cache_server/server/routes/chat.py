"""POST /v1/chat/completions"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...serving.openai_bodies import ChatCompletion, ChatCompletionRequest, ErrorResponse
from ..auth import Tenant
from ..state import State
from ..while_loading import OPENAI, respond

router = APIRouter(tags=["chat"])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
}


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=ERRORS,
    summary="Create a chat completion",
)
async def create_chat_completion(
    req: ChatCompletionRequest, request: Request, state: State, tenant: Tenant
):
    return await respond(
        state,
        req.model,
        lambda served: served.chat.create(req, request, tenant),
        OPENAI if req.stream else None,
    )
