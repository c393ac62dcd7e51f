"""Chat completions: OpenAI's chat messages in, the engine's events out as chat chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from ..engine import Candidate, Delta, Engine, Event, TokenLogprob
from ..settings import Settings
from .errors import APIError
from .generation import (
    RequestContext,
    collect,
    new_id,
    now,
    off_loop,
    tracked,
    until_disconnected,
)
from .limits import check_model, check_prompt_chars, reserve_slot, sampling_params
from .metrics import Metrics
from .schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ResponseMessage,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)
from .sse import EventStream, sse_stream

ROUTE = "/v1/chat/completions"


class ChatCompletionsServing:
    def __init__(
        self, engine: Engine, settings: Settings, metrics: Metrics, aliases: set[str]
    ) -> None:
        self.engine, self.settings, self.metrics, self.aliases = engine, settings, metrics, aliases

    async def create(
        self, req: ChatCompletionRequest, request: Request, tenant: str | None
    ) -> ChatCompletion | EventStream:
        engine, settings = self.engine, self.settings
        check_model(req.model, engine, self.aliases)
        if len(req.messages) > settings.max_messages:
            raise APIError(
                400,
                f"Too many messages: {len(req.messages)}; this server accepts at most "
                f"{settings.max_messages}.",
                param="messages",
            )
        check_prompt_chars(sum(map(_chars, req.messages)), engine, "messages")
        want_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true.", param="top_logprobs")
        slot = reserve_slot(engine, settings)
        try:
            tokens = await off_loop(render, engine, req)
            params = sampling_params(
                req,
                prompt_tokens=len(tokens),
                max_tokens=req.max_completion_tokens or req.max_tokens,
                logprobs=want_logprobs,
                engine=engine,
                settings=settings,
                prompt_param="messages",
            )
        except BaseException:
            slot.release()
            raise
        cid, created = new_id("chatcmpl"), now()
        ctx = RequestContext(cid, ROUTE, req.model, tenant)
        events = tracked(engine, tokens, params, ctx, settings.request_timeout, self.metrics, slot)
        if req.stream:
            return EventStream(_stream(events, cid, created, req, want_logprobs is not None))
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
    """The prompt's tokens: the messages through the model's chat template."""
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


def _stream(
    events: AsyncIterator[Event],
    cid: str,
    created: int,
    req: ChatCompletionRequest,
    logprobs: bool,
) -> AsyncIterator[str]:
    usage_asked = req.include_usage

    def chunk(choice: ChunkChoice | None, usage: Usage | None = None) -> ChatCompletionChunk:
        out = ChatCompletionChunk(
            id=cid, created=created, model=req.model, choices=[choice] if choice else []
        )
        if usage_asked:
            out.usage = usage  # null on every chunk but the last
        return out

    def delta(event: Delta) -> ChatCompletionChunk:
        lp = _logprobs_out(event.logprobs) if logprobs else None
        return chunk(ChunkChoice(index=0, delta=ChunkDelta(content=event.text), logprobs=lp))

    return sse_stream(
        events,
        start=lambda: chunk(ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))),
        delta=delta,
        finish=lambda reason: chunk(ChunkChoice(index=0, delta=ChunkDelta(), finish_reason=reason)),
        usage=(lambda usage: chunk(None, usage)) if usage_asked else None,
    )
