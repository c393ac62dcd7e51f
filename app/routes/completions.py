"""POST /v1/completions (legacy text completions)"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..auth import Tenant
from ..deps import EngineDep
from ..engine import Delta, Engine, Event, Failed, Finished, Started, TokenLogprob
from ..errors import APIError
from ..generation import (
    SSE_DONE,
    RequestContext,
    check_capacity,
    check_model,
    collect,
    make_usage,
    new_id,
    now,
    sampling_params,
    sse,
    sse_failure,
    tracked,
)
from ..schemas import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .chat import ERRORS

router = APIRouter(tags=["completions"])


def prompt_tokens(engine: Engine, req: CompletionRequest) -> tuple[list[int], str]:
    """The prompt as tokens, and as text (for echo)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "Send one prompt per request.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = list(engine.tokenizer.encode(prompt))
        text = prompt
    else:
        bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(
                400,
                f"Token ids must be in [0, {engine.vocab_size}); got {bad[0]}.",
                param="prompt",
            )
        tokens, text = list(prompt), engine.tokenizer.decode(list(prompt))
    if not tokens:
        raise APIError(400, "The prompt is empty.", param="prompt")
    return tokens, text


def _logprobs(items: list[TokenLogprob], start: int) -> CompletionLogprobs:
    offsets, pos = [], start
    for t in items:
        offsets.append(pos)
        pos += len(t.text)
    return CompletionLogprobs(
        tokens=[t.text for t in items],
        token_logprobs=[t.logprob for t in items],
        top_logprobs=[{text: lp for _, text, lp in t.top} for t in items],
        text_offset=offsets,
    )


@router.post(
    "/v1/completions", response_model=Completion, responses=ERRORS, summary="Create a completion"
)
async def create_completion(
    req: CompletionRequest, request: Request, engine: EngineDep, tenant: Tenant
):
    state = request.app.state
    check_model(req.model, engine, state.model_aliases)
    tokens, text = prompt_tokens(engine, req)
    params = sampling_params(
        req,
        prompt_tokens=len(tokens),
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        engine=engine,
        limits=state.limits,
        prompt_param="prompt",
    )
    check_capacity(engine, state.limits)
    cid, created = new_id("cmpl"), now()
    ctx = RequestContext(cid, "/v1/completions", req.model, tenant)
    events = tracked(engine, tokens, params, ctx, state.limits, state.metrics)
    echo = text if req.echo else ""
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(events, cid, created, req.model, echo, usage, req.logprobs is not None),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    result = await collect(events)
    lp = _logprobs(result.logprobs, len(echo)) if req.logprobs is not None else None
    return Completion(
        id=cid,
        created=created,
        model=req.model,
        choices=[
            CompletionChoice(
                index=0, text=echo + result.text, logprobs=lp, finish_reason=result.finish_reason
            )
        ],
        usage=result.usage(),
    )


async def _stream(
    events: AsyncIterator[Event],
    cid: str,
    created: int,
    model: str,
    echo: str,
    include_usage: bool,
    logprobs: bool,
) -> AsyncIterator[str]:
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}

    def chunk(text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        payload = {
            **base,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    prompt = cached = 0
    offset = len(echo)
    async for event in events:
        if isinstance(event, Started):
            prompt, cached = event.prompt_tokens, event.cached_tokens
            if echo:
                yield chunk(echo)
        elif isinstance(event, Delta):
            lp = None
            if logprobs:
                lp = _logprobs(event.logprobs, offset).model_dump()
            offset += len(event.text)
            yield chunk(event.text, logprobs=lp)
        elif isinstance(event, Finished):
            yield chunk("", finish=event.reason)
            if include_usage:
                usage = make_usage(prompt, cached, event.completion_tokens)
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
            yield SSE_DONE
        elif isinstance(event, Failed):
            yield sse_failure(event)
            yield SSE_DONE
