"""Text completions (legacy): a prompt in, the engine's events out as completion chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from ..engine import Delta, Engine, Event, TokenLogprob
from .api_errors import APIError
from .generation import (
    RequestContext,
    Surface,
    collect,
    new_id,
    now,
    off_loop,
    tracked,
    until_disconnected,
)
from .limits import check_model, check_prompt_chars, reserve_slot, sampling_params
from .openai_bodies import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)
from .sse import EventStream, sse_stream

ROUTE = "/v1/completions"


class CompletionsServing(Surface):
    async def create(
        self, req: CompletionRequest, request: Request, tenant: str | None
    ) -> Completion | EventStream:
        engine, settings = self.engine, self.settings
        check_model(req.model, engine, self.aliases)
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), engine, "prompt")
        slot = reserve_slot(engine, settings)
        try:
            tokens, text = await off_loop(prompt_tokens, engine, req)
            params = sampling_params(
                req,
                prompt_tokens=len(tokens),
                max_tokens=req.max_tokens,
                logprobs=req.logprobs,
                engine=engine,
                settings=settings,
                defaults=self.defaults,
                prompt_param="prompt",
            )
        except BaseException:
            slot.release()
            raise
        cid, created = new_id("cmpl"), now()
        ctx = RequestContext(cid, ROUTE, req.model, tenant)
        events = tracked(engine, tokens, params, ctx, settings.request_timeout, self.metrics, slot)
        echo = text if req.echo else ""
        if req.stream:
            return EventStream(_stream(events, cid, created, req, echo))
        result = await until_disconnected(request, collect(events))
        lp = _logprobs(result.logprobs, len(echo)) if req.logprobs is not None else None
        return Completion(
            id=cid,
            created=created,
            model=req.model,
            choices=[
                CompletionChoice(
                    index=0,
                    text=echo + result.text,
                    logprobs=lp,
                    finish_reason=result.finish_reason,
                )
            ],
            usage=result.usage(),
        )


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


def _stream(
    events: AsyncIterator[Event],
    cid: str,
    created: int,
    req: CompletionRequest,
    echo: str,
) -> AsyncIterator[str]:
    offset = len(echo)  # where the next text starts in the whole completion
    usage_asked, logprobs = req.include_usage, req.logprobs is not None

    def chunk(choice: CompletionChoice | None, usage: Usage | None = None) -> CompletionChunk:
        out = CompletionChunk(
            id=cid, created=created, model=req.model, choices=[choice] if choice else []
        )
        if usage_asked:
            out.usage = usage  # null on every chunk but the last
        return out

    def delta(event: Delta) -> list[CompletionChunk]:
        nonlocal offset
        lp = _logprobs(event.logprobs, offset) if logprobs else None
        offset += len(event.text)
        return [chunk(CompletionChoice(index=0, text=event.text, logprobs=lp, finish_reason=None))]

    return sse_stream(
        events,
        start=lambda: (
            [chunk(CompletionChoice(index=0, text=echo, finish_reason=None))] if echo else []
        ),
        delta=delta,
        finish=lambda reason: [chunk(CompletionChoice(index=0, text="", finish_reason=reason))],
        usage=(lambda usage: chunk(None, usage)) if usage_asked else None,
    )
