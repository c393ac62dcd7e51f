"""Anthropic's Messages API (`POST /v1/messages`), as Claude Code speaks it.

A thin translator: the request becomes a chat request, which runs through the
chat surface's own start (checks, template, tools, constraints, the engine and
the cache); the reply comes back as Anthropic's content blocks, stop reasons,
usage and stream events. `input_tokens` counts the uncached part of the prompt
only, `cache_read_input_tokens` what the cache served, as Anthropic reports.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic_core
from fastapi import Request

from ..engine import Delta, Event, Failed, Finished, Started
from .anthropic_input import CountTokensRequest, MessagesRequest, to_chat
from .chat import ChatCompletionsServing, check_request_chars
from .generation import (
    collect,
    compiling,
    failure_status,
    off_loop,
    until_disconnected,
    with_pauses,
)
from .images import reader_for
from .limits import check_model
from .openai_bodies import ToolCallDelta
from .sse import EventStream
from .template import render
from .tools import compiles_grammar, plan_tools

ROUTE = "/v1/messages"
PING_EVERY = 5.0  # seconds without an event before a ping: agents warn of stalls after ~20


class MessagesServing:
    def __init__(self, chat: ChatCompletionsServing) -> None:
        self.chat = chat

    def served_as(self, name: str) -> str:
        """Claude model names mean the served model (agents send theirs), as do the
        configured aliases (`--model-alias`)."""
        return self.chat.engine.model_id if name.startswith("claude") else name

    async def create(self, req: MessagesRequest, request: Request, tenant: str | None) -> Any:
        images = reader_for(self.chat.engine.vision)  # checked in the translation, kept opened
        chat = await off_loop(to_chat, req, images)
        chat.model = self.served_as(req.model)
        run = await self.chat.start(chat, tenant, route=ROUTE, images=images)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if req.stream:
            return EventStream(_stream(run, mid, req.model))
        result = await until_disconnected(request, collect(run.events))
        thought, text, calls = run.reply.whole_all(result.text)
        reason = _stop_reason(result.finish_reason, result.stop_sequence, bool(calls))
        content: list[dict[str, Any]] = []
        if thought:  # a reasoning model's thinking, as a thinking block (as streamed: not empty)
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        for call in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_use_id(call.id),
                    "name": call.function.name,
                    "input": _input(call.function.arguments),
                }
            )
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": result.stop_sequence if reason == "stop_sequence" else None,
            "usage": _usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens),
        }

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        images = reader_for(self.chat.engine.vision)
        chat = await off_loop(to_chat, req, images)
        chat.model = self.served_as(req.model)
        engine = self.chat.engine
        check_model(chat.model, engine, self.chat.aliases)
        await off_loop(check_request_chars, chat, engine)
        tools = (
            await compiling(plan_tools, chat, engine, param="tools")
            if compiles_grammar(chat, engine)
            else plan_tools(chat, engine)
        )
        strip = self.chat.settings.strip_attribution_header
        kwargs = self.chat.settings.chat_template_kwargs
        tokens = await off_loop(render, engine, chat, tools, strip, kwargs, images)
        return {"input_tokens": len(tokens)}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its tool_use block's `input`: of a call cut off by max_tokens,
    what of them parses, as the `anthropic` SDK reads a streamed block's partial JSON."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        try:  # pydantic's own JSON reader; allow_partial since pydantic 2.7
            value = pydantic_core.from_json(arguments, allow_partial=True)
        except (ValueError, TypeError):
            return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop_reason(finish: str | None, stop_sequence: str | None, called: bool) -> str:
    if finish == "length":  # first: a call cut off here is not one to run
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def _usage(prompt: int, cached: int, completion: int) -> dict[str, int]:
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _stream(run: Any, mid: str, model: str) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, content blocks, message_delta, message_stop."""
    blocks = _Blocks()
    yield _sse("ping", {})  # bytes at once: the prompt may take long to prefill
    async with contextlib.aclosing(with_pauses(run.events, PING_EVERY)) as events:
        async for event in events:
            for out in _on(event, run, blocks, mid, model):
                yield out
            if isinstance(event, Finished | Failed):
                return  # nothing, not even a ping, after the end


def _on(event: Event | None, run: Any, blocks: _Blocks, mid: str, model: str) -> list[str]:
    """The stream's events for one engine event (None: nothing for a while)."""
    if event is None:
        return [_sse("ping", {})]
    if isinstance(event, Started):
        message = {
            "id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(event.prompt_tokens, event.cached_tokens, 0),
        }  # fmt: skip
        return [_sse("message_start", {"message": message})]
    if isinstance(event, Delta):
        thought, text, calls = run.reply.feed_all(event.text)
        return blocks.add(text, calls, thought)
    if isinstance(event, Finished):
        thought, text, calls = run.reply.finish_all()
        out = [*blocks.add(text, calls, thought), *blocks.close()]
        reason = _stop_reason(event.reason, event.stop_sequence, run.reply.calls > 0)
        stop = event.stop_sequence if reason == "stop_sequence" else None
        usage = {"output_tokens": event.completion_tokens}
        out.append(_sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                          "usage": usage}))  # fmt: skip
        return [*out, _sse("message_stop", {})]
    if isinstance(event, Failed):
        status, _ = failure_status(event)
        kind = {503: "overloaded_error", 408: "timeout_error", 400: "invalid_request_error"}.get(
            status, "api_error"
        )
        return [_sse("error", {"error": {"type": kind, "message": event.message}})]
    return []


class _Blocks:
    """Opens and closes content blocks as thinking, text and tool-call deltas arrive."""

    def __init__(self) -> None:
        # The open block's kind: "thinking", "text", "tool_use" or None.
        self.index, self.open = -1, None
        self.json = True  # the open tool_use block's arguments are JSON (else not streamed)

    def add(self, text: str, calls: list[ToolCallDelta], thought: str = "") -> list[str]:
        out = []
        if thought:
            if self.open != "thinking":
                out += self.close()
                block = {"type": "thinking", "thinking": "", "signature": ""}
                out += self._start(block, "thinking")
            delta = {"type": "thinking_delta", "thinking": thought}
            out.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        if text:
            if self.open != "text":
                out += self.close()
                out += self._start({"type": "text", "text": ""}, "text")
            delta = {"type": "text_delta", "text": text}
            out.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        for call in calls:
            if call.id is not None:  # a new call
                out += self.close()
                name = call.function.name if call.function else ""
                block = {"type": "tool_use", "id": _tool_use_id(call.id), "name": name, "input": {}}
                out += self._start(block, "tool_use")
            arguments = call.function.arguments if call.function else None
            if call.id is not None:
                # A call cut off in markup other than JSON has its markup as arguments:
                # no partial JSON, which clients parse as it comes; its input stays {}.
                self.json = not arguments or arguments.lstrip().startswith("{")
            if arguments and self.json:
                delta = {"type": "input_json_delta", "partial_json": arguments}
                out.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # Anthropic's thinking blocks end with their signature
            delta = {"type": "signature_delta", "signature": ""}
            out.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))
        self.open = None
        return [*out, _sse("content_block_stop", {"index": self.index})]

    def _start(self, block: dict[str, Any], kind: str) -> list[str]:
        self.index, self.open = self.index + 1, kind
        return [_sse("content_block_start", {"index": self.index, "content_block": block})]
