"""POST /v1/completions (legacy text completions)"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from ..auth import Tenant
from ..deps import EngineDep
from ..engine import Delta, Engine, Event, TokenLogprob
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
        top_logprobs=[{c.text: c.logprob for c in t.top} for t in items],
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
    prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    check_prompt_chars(chars, engine, "prompt")
    slot = reserve_slot(engine, state.limits)
    try:
        tokens, text = await off_loop(prompt_tokens, engine, req)
        params = sampling_params(
            req,
            prompt_tokens=len(tokens),
            max_tokens=req.max_tokens,
            logprobs=req.logprobs,
            engine=engine,
            limits=state.limits,
            prompt_param="prompt",
        )
    except BaseException:
        slot.release()
        raise
    cid, created = new_id("cmpl"), now()
    ctx = RequestContext(cid, "/v1/completions", req.model, tenant)
    events = tracked(engine, tokens, params, ctx, state.limits, state.metrics, slot)
    echo = text if req.echo else ""
    if req.stream:
        logprobs = req.logprobs is not None
        return sse_response(
            _stream(events, cid, created, req.model, echo, req.include_usage, logprobs)
        )
    result = await until_disconnected(request, collect(events))
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


def _stream(
    events: AsyncIterator[Event],
    cid: str,
    created: int,
    model: str,
    echo: str,
    include_usage: bool,
    logprobs: bool,
) -> AsyncIterator[str]:
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}
    offset = len(echo)  # where the next text starts in the whole completion

    def delta(event: Delta) -> dict:
        nonlocal offset
        lp = _logprobs(event.logprobs, offset).model_dump() if logprobs else None
        offset += len(event.text)
        return {"text": event.text, "logprobs": lp, "finish_reason": None}

    return sse_stream(
        events,
        base,
        include_usage,
        start=lambda: {"text": echo, "logprobs": None, "finish_reason": None} if echo else None,
        delta=delta,
        finish=lambda reason: {"text": "", "logprobs": None, "finish_reason": reason},
    )
