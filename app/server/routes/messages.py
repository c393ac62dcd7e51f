"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API)"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...serving.anthropic import CountTokensRequest, MessagesRequest
from ..auth import Tenant
from ..state import State

router = APIRouter(tags=["messages"])


@router.post("/v1/messages", summary="Create a message (Anthropic's API)")
async def create_message(req: MessagesRequest, request: Request, state: State, tenant: Tenant):
    return await state.messages.create(req, request, tenant)


@router.post("/v1/messages/count_tokens", summary="Count a message's input tokens")
async def count_tokens(req: CountTokensRequest, state: State, tenant: Tenant):
    return await state.messages.count_tokens(req)
