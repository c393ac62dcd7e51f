"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API)"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...serving.anthropic_input import CountTokensRequest, MessagesRequest
from ..auth import Tenant
from ..state import ServerState, State
from ..while_loading import ANTHROPIC, respond

router = APIRouter(tags=["messages"])


@router.post("/v1/messages", summary="Create a message (Anthropic's API)")
async def create_message(req: MessagesRequest, request: Request, state: State, tenant: Tenant):
    return await respond(
        state,
        _model_for(state, req.model),
        lambda served: served.messages.create(req, request, tenant),
        ANTHROPIC if req.stream else None,
    )


@router.post("/v1/messages/count_tokens", summary="Count a message's input tokens")
async def count_tokens(req: CountTokensRequest, state: State, tenant: Tenant):
    async with state.model(_model_for(state, req.model)) as served:
        return await served.messages.count_tokens(req)


def _model_for(state: ServerState, name: str) -> str:
    """Agents send Claude's model names: unless a model is configured under one, they mean
    the default model, whatever `--answer-any-model` says of other names."""
    return state.answering(name, always=name.startswith("claude"))
