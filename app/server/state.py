"""What the server shares between requests, typed: one object on `app.state.server`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from ..engine import Engine
from ..serving.anthropic import MessagesServing
from ..serving.chat import ChatCompletionsServing
from ..serving.completions import CompletionsServing
from ..serving.defaults import SamplingDefaults
from ..serving.metrics import Metrics
from ..serving.responses import ResponsesServing
from ..settings import Settings


@dataclass
class ServerState:
    engine: Engine
    settings: Settings  # the one source of every limit
    metrics: Metrics
    started: int  # when the server started, as models' `created`
    model_aliases: set[str]  # names a request may use for the served model
    defaults: SamplingDefaults  # sampling for what a request leaves out
    chat: ChatCompletionsServing
    completions: CompletionsServing
    messages: MessagesServing
    responses: ResponsesServing


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
