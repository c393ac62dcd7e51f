"""POST /v1/chat/completions"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from ..auth import Tenant
from ..deps import EngineDep
from ..engine import Candidate, Delta, Engine, Event, TokenLogprob
from ..errors import APIError
from ..generation import (
    RequestContext,
    check_model,
    check_prompt_chars,
    collect,
    new_id,
    now,
    off_loop,
    reserve_slot,
    sampling_params,
    sse_response,
    sse_stream,
    tracked,
    until_disconnected,
)
from ..schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ErrorResponse,
    ResponseMessage,
    TokenLogprobOut,
    TopLogprob,
)

router = APIRouter(tags=["chat"])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
}


def _message(m: ChatMessage, index: int) -> dict[str, Any]:
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"Only text content parts are supported; got a '{part.type}' part.",
                    param=f"messages[{index}].content[{j}]",
                )
            texts.append(part.text)
        content = "".join(texts)
    else:
        content = m.content or ""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = content
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _chars(m: ChatMessage) -> int:
    if isinstance(m.content, list):
        return sum(len(part.text or "") for part in m.content)
    return len(m.content or "")


def render(engine: Engine, req: ChatCompletionRequest) -> list[int]:
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if req.tools:
        kwargs["tools"] = req.tools
    try:
        tokens = engine.tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # the model's own template refused these messages
        raise APIError(
            400, f"The chat template rejected the messages: {e}", param="messages"
        ) from e
    return list(tokens)


def _logprobs_out(items: list[TokenLogprob]) -> ChoiceLogprobs:
    def entry(c: Candidate) -> TopLogprob:
        return TopLogprob(token=c.text, logprob=c.logprob, bytes=list(c.bytes))

    return ChoiceLogprobs(
        content=[
            TokenLogprobOut(**entry(t).model_dump(), top_logprobs=[entry(c) for c in t.top])
            for t in items
        ]
    )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=ERRORS,
    summary="Create a chat completion",
)
async def create_chat_completion(
    req: ChatCompletionRequest, request: Request, engine: EngineDep, tenant: Tenant
):
    state = request.app.state
    check_model(req.model, engine, state.model_aliases)
    if len(req.messages) > state.limits.max_messages:
        raise APIError(
            400,
            f"Too many messages: {len(req.messages)}; this server accepts at most "
            f"{state.limits.max_messages}.",
            param="messages",
        )
    check_prompt_chars(sum(map(_chars, req.messages)), engine, "messages")
    want_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true.", param="top_logprobs")
    slot = reserve_slot(engine, state.limits)
    try:
        tokens = await off_loop(render, engine, req)
        params = sampling_params(
            req,
            prompt_tokens=len(tokens),
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=want_logprobs,
            engine=engine,
            limits=state.limits,
            prompt_param="messages",
        )
    except BaseException:
        slot.release()
        raise
    cid, created = new_id("chatcmpl"), now()
    ctx = RequestContext(cid, "/v1/chat/completions", req.model, tenant)
    events = tracked(engine, tokens, params, ctx, state.limits, state.metrics, slot)
    if req.stream:
        logprobs = params.logprobs is not None
        return sse_response(_stream(events, cid, created, req.model, req.include_usage, logprobs))
    result = await until_disconnected(request, collect(events))
    return ChatCompletion(
        id=cid,
        created=created,
        model=req.model,
        choices=[
            ChatChoice(
                index=0,
                message=ResponseMessage(content=result.text),
                logprobs=_logprobs_out(result.logprobs) if want_logprobs is not None else None,
                finish_reason=result.finish_reason,
            )
        ],
        usage=result.usage(),
    )


def _stream(
    events: AsyncIterator[Event],
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
    logprobs: bool,
) -> AsyncIterator[str]:
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def delta(event: Delta) -> dict:
        lp = _logprobs_out(event.logprobs).model_dump() if logprobs else None
        return {"delta": {"content": event.text}, "logprobs": lp, "finish_reason": None}

    return sse_stream(
        events,
        base,
        include_usage,
        start=lambda: {
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        },
        delta=delta,
        finish=lambda reason: {"delta": {}, "logprobs": None, "finish_reason": reason},
    )
