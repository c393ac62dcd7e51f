"""OpenAI's Responses API (`POST /v1/responses`), as Codex CLI speaks it.

A thin translator, as `anthropic` is: input items become a chat request
(`responses_input`), run through the chat surface's start (template, tools,
constraints, engine, cache); the reply comes back as output items (`message`,
`function_call`, `custom_tool_call`) with usage
whose `input_tokens_details.cached_tokens` is what the cache served, or as the
Responses stream events, each with its `sequence_number`. Responses are stored
(unless `store: false`) for `previous_response_id` (`response_store`).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from ..engine import Delta, Failed, Finished, Started
from .api_errors import APIError
from .chat import ChatCompletionsServing, Run
from .generation import (
    collect,
    compiling,
    failure_status,
    off_loop,
    until_disconnected,
    with_pauses,
)
from .images import reader_for
from .openai_bodies import FunctionCall, ToolCall, ToolCallDelta
from .response_store import ResponseStore
from .responses_input import Offered, ResponsesRequest, input_items, offered_tools, to_chat
from .sse import KEEP_ALIVE, KEEP_ALIVE_EVERY, EventStream

ROUTE = "/v1/responses"
__all__ = ["ResponsesRequest", "ResponsesServing", "failed_stream"]


def failed_stream(req: ResponsesRequest, code: str, message: str) -> str:
    """The whole stream of a response that failed before it started (its model's load, say):
    `response.created`, then `response.failed` with the error, as a failed generation ends."""
    response = _Response(req, f"resp_{uuid.uuid4().hex[:24]}", int(time.time()), {})
    failed = response.body([], None, None, "failed")
    failed["error"] = {"code": code, "message": message}
    created = response.event(
        "response.created", response=response.body([], None, None, "in_progress")
    )
    return created + response.event("response.failed", response=failed)


class ResponsesServing:
    def __init__(self, chat: ChatCompletionsServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create(
        self,
        req: ResponsesRequest,
        request: Request | None,
        tenant: str | None,
        kept: ResponseStore | None = None,
    ) -> Any:
        """`request`: the HTTP request, None over a WebSocket (whose requests are streamed).
        `kept`: a WebSocket connection's own memory of its last response, looked in first
        for `previous_response_id` and given every response whatever `store` says."""
        conversation = list(input_items(req))
        if req.previous_response_id is not None:
            earlier = self._earlier(tenant, req.previous_response_id, kept)
            conversation = [*earlier, *conversation]
        stores = [self.store] if req.store is not False else []
        stores += [kept] if kept is not None else []
        if (req.model_extra or {}).get("generate") is False:
            return _warm_up(req, tenant, conversation, stores)
        whole = req.model_copy(update={"input": conversation, "previous_response_id": None})
        # Custom tools' grammars are read and checked in the translation: grammar work.
        translate = compiling if _grammars_in(offered_tools(whole)) else off_loop
        images = reader_for(self.chat.engine.vision)  # checked in the translation, kept opened
        chat, offered = await translate(to_chat, whole, images)
        run = await self.chat.start(chat, tenant, route=ROUTE, images=images)
        response = _Response(req, f"resp_{uuid.uuid4().hex[:24]}", int(time.time()), offered)
        if stores:
            response.on_done = lambda items: _put(stores, tenant, response.id,
                                                  [*conversation, *items])  # fmt: skip
        if req.stream:
            return EventStream(response.stream(run))
        assert request is not None, "only a streamed request comes without its HTTP request"
        result = await until_disconnected(request, collect(run.events))
        thought, text, calls = run.reply.whole_all(result.text)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        items = []
        if thought:  # as streamed: a thinking block with no text is left out
            cut = status == "incomplete" and not text and not calls  # cut while thinking
            items.append(_reasoning(response.reasoning_id, thought, status if cut else "completed"))
        items += [_message(response.message_id, text or "", status)] if text else []
        items += [_call_item(call, offered, status) for call in calls]
        usage = _usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens)
        response.on_done(items)
        return response.body(items, result.finish_reason, usage)

    def _earlier(self, tenant: str | None, response_id: str, kept: ResponseStore | None) -> list:
        """The conversation of `response_id`: the connection's, else a stored one (or 404)."""
        if kept is not None:
            with contextlib.suppress(APIError):  # not the connection's: maybe stored
                return kept.conversation(tenant, response_id)
        return self.store.conversation(tenant, response_id)


def _put(stores: list[ResponseStore], tenant: str | None, rid: str, items: list) -> None:
    for store in stores:
        store.put(tenant, rid, items)


def _warm_up(
    req: ResponsesRequest, tenant: str | None, conversation: list, stores: list[ResponseStore]
) -> Any:
    """A `generate: false` request (Codex's first on a new WebSocket, with no input): a
    response with no output, kept like any other for the next to name in
    `previous_response_id`. Nothing is computed: the request that follows prefills it all,
    through the cache as ever."""
    response = _Response(req, f"resp_{uuid.uuid4().hex[:24]}", int(time.time()), {})
    _put(stores, tenant, response.id, conversation)
    done = response.body([], "stop", _usage(0, 0, 0))
    if not req.stream:
        return done
    started = response.body([], None, None, "in_progress")
    events = [response.event("response.created", response=started),
              response.event("response.completed", response=done)]  # fmt: skip
    return EventStream(_replay(events))


async def _replay(events: list[str]) -> AsyncIterator[str]:
    for event in events:
        yield event


def _custom_input(arguments: str) -> str:
    """A custom call's input from the arguments the model wrote: the string, or as much of
    it as came before the reply was cut off; the arguments as they came if they are not
    that string (the model's own words are all there is)."""
    with contextlib.suppress(ValueError):
        value = json.loads(arguments)
        if isinstance(value, dict) and isinstance(value.get("input"), str):
            return value["input"]
    start = re.match(r'\s*\{\s*"input"\s*:\s*"', arguments)
    if start is not None:
        rest = arguments[start.end() :]
        for cut in range(min(len(rest), 6) + 1):  # an escape may be cut in the middle
            with contextlib.suppress(ValueError):
                return json.loads(f'"{rest[: len(rest) - cut]}"')
    return arguments


def _reasoning(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [part]}  # fmt: skip


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message", "id": item_id, "status": status, "role": "assistant",
        "content": [part],
    }  # fmt: skip


def _call_item(
    call: ToolCall, offered: dict[str, Offered], status: str = "completed"
) -> dict[str, Any]:
    """A call as its output item: by the tool's own name, its namespace apart (Codex refuses
    a qualified name), a custom tool's as a custom_tool_call."""
    arguments, suffix = call.function.arguments, call.id[5:]
    tool = offered.get(call.function.name) or Offered("function", call.function.name)
    namespace = {"namespace": tool.namespace} if tool.namespace else {}
    if tool.kind == "custom":
        return {
            "type": "custom_tool_call", "id": f"ctc_{suffix}", "call_id": call.id,
            "name": tool.name, **namespace, "input": _custom_input(arguments), "status": status,
        }  # fmt: skip
    return {
        "type": "function_call", "id": f"fc_{suffix}", "call_id": call.id, "name": tool.name,
        **namespace, "arguments": arguments, "status": status,
    }  # fmt: skip


def _usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class _Response:
    """One response object, as created, streamed and completed."""

    def __init__(
        self, req: ResponsesRequest, rid: str, created: int, offered: dict[str, Offered]
    ) -> None:
        self.req, self.id, self.created, self.offered = req, rid, created, offered
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex[:24]}"
        self.sequence = 0
        self.arguments: dict[int, str] = {}  # custom calls' arguments so far, by output index
        self.on_done: Callable[[list[dict[str, Any]]], None] = lambda items: None

    def body(self, items: list, finish: str | None, usage: dict | None, status: str = "") -> dict:
        status = status or ("incomplete" if finish == "length" else "completed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.req.model,
            "output": items,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "parallel_tool_calls": False,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "tool_choice": self.req.tool_choice or "auto",
            "tools": self.req.tools or [],
            "text": self.req.text or {"format": {"type": "text"}},
            "store": self.req.store is not False,
            "previous_response_id": self.req.previous_response_id,
            "metadata": {},
        }

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def stream(self, run: Run) -> AsyncIterator[str]:
        # Closed here, not left to the garbage collector: a client gone mid-stream ends
        # its generation at once.
        async with contextlib.aclosing(with_pauses(run.events, KEEP_ALIVE_EVERY)) as events:
            async for out in self._events(run, events):
                yield out

    async def _events(self, run: Run, events: AsyncIterator[Any]) -> AsyncIterator[str]:
        items: list[dict[str, Any]] = []  # output items, as they stand
        text: list | None = None  # the message item's output index and text, once text comes
        thinking: list | None = None  # the reasoning item's output index and text, while open
        blank = ""  # whitespace not yet sent: dropped if a call, not text, comes next
        calls: dict[int, int] = {}  # tool-call delta index -> output index
        cached = 0
        started = self.body([], None, None, "in_progress")
        yield self.event("response.created", response=started)
        async for event in events:
            if event is None:
                yield KEEP_ALIVE
            elif isinstance(event, Started):
                cached = event.cached_tokens
                yield self.event("response.in_progress", response=started)
            elif isinstance(event, Failed):
                _, kind = failure_status(event)
                failed = self.body(items, None, None, "failed")
                failed["error"] = {"code": kind, "message": event.message}
                yield self.event("response.failed", response=failed)
                return
            elif isinstance(event, Delta | Finished):
                end = isinstance(event, Finished)
                fed = run.reply.finish_all() if end else run.reply.feed_all(event.text)
                thought, piece, deltas = fed
                if thought:
                    if thinking is None:
                        thinking = [len(items), ""]
                        items.append(_reasoning(self.reasoning_id, "", "in_progress"))
                        for out in self._open(thinking[0], items[-1], "reasoning_text"):
                            yield out
                    thinking[1] += thought
                    yield self.event(
                        "response.reasoning_text.delta", item_id=self.reasoning_id,
                        output_index=thinking[0], content_index=0, delta=thought,
                    )  # fmt: skip
                if thinking is not None and (piece.strip() or deltas or end):
                    cut = end and event.reason == "length" and not piece.strip() and not deltas
                    for out in self._close_reasoning(items, thinking, cut):
                        yield out
                    thinking = None
                if text is None and piece and not piece.strip():
                    blank, piece = blank + piece, ""
                if piece:
                    piece, blank = blank + piece, ""
                    if text is None:
                        text = [len(items), ""]
                        items.append(_message(self.message_id, "", "in_progress"))
                        for out in self._open_message(text[0]):
                            yield out
                    text[1] += piece
                    yield self.event(
                        "response.output_text.delta", item_id=self.message_id,
                        output_index=text[0], content_index=0, delta=piece, logprobs=[],
                    )  # fmt: skip
                for out in self._calls(deltas, items, calls):
                    yield out
                if end:
                    status = "incomplete" if event.reason == "length" else "completed"
                    for out in self._close(items, text, calls, status):
                        yield out
                    usage = _usage(run.prompt_tokens, cached, event.completion_tokens)
                    done = self.body(items, event.reason, usage)
                    self.on_done(items)
                    yield self.event(f"response.{done['status']}", response=done)
                    return

    def _open(self, index: int, item: dict[str, Any], part_type: str) -> list[str]:
        part = {"type": part_type, "text": ""}
        return [
            self.event("response.output_item.added", output_index=index,
                       item={**item, "content": []}),
            self.event("response.content_part.added", item_id=item["id"], output_index=index,
                       content_index=0, part=part),
        ]  # fmt: skip

    def _close_reasoning(self, items: list, thinking: list, cut: bool) -> list[str]:
        index, whole = thinking
        items[index] = _reasoning(self.reasoning_id, whole, "incomplete" if cut else "completed")
        part = {"type": "reasoning_text", "text": whole}
        return [
            self.event("response.reasoning_text.done", item_id=self.reasoning_id,
                       output_index=index, content_index=0, text=whole),
            self.event("response.content_part.done", item_id=self.reasoning_id,
                       output_index=index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=items[index]),
        ]  # fmt: skip

    def _open_message(self, index: int) -> list[str]:
        item = {**_message(self.message_id, "", "in_progress"), "content": []}  # parts follow
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event(
                "response.content_part.added", item_id=self.message_id,
                output_index=index, content_index=0, part=part,
            ),
        ]  # fmt: skip

    def _calls(self, deltas: list[ToolCallDelta], items: list, calls: dict[int, int]) -> list[str]:
        out = []
        for delta in deltas:
            if delta.index not in calls:
                calls[delta.index] = len(items)
                call_id = delta.id or f"call_{uuid.uuid4().hex[:24]}"
                name = delta.function.name if delta.function else ""
                call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=""))
                item = _call_item(call, self.offered, "in_progress")
                items.append(item)
                added = self.event(
                    "response.output_item.added", output_index=calls[delta.index], item=dict(item)
                )
                out.append(added)
            fragment = delta.function.arguments if delta.function else None
            index = calls[delta.index]
            if fragment and items[index]["type"] == "custom_tool_call":
                # Its input is a string inside the arguments' JSON: sent whole at the end.
                self.arguments[index] = self.arguments.get(index, "") + fragment
            elif fragment:
                items[index]["arguments"] += fragment
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=items[index]["id"],
                        output_index=index,
                        delta=fragment,
                    )  # fmt: skip
                )
        return out

    def _close(
        self, items: list, text: list | None, calls: dict[int, int], status: str
    ) -> list[str]:
        out = []
        if text is not None:
            index, whole = text
            part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=self.message_id,
                                  output_index=index, content_index=0, text=whole,
                                  logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=self.message_id,
                                  output_index=index, content_index=0, part=part))  # fmt: skip
            items[index] = _message(self.message_id, whole, status)
            out.append(self.event("response.output_item.done", output_index=index,
                                  item=items[index]))  # fmt: skip
        for index in calls.values():
            item = {**items[index], "status": status}
            items[index] = item
            if item["type"] == "custom_tool_call":
                item["input"] = _custom_input(self.arguments.get(index, ""))
                if item["input"]:
                    out.append(self.event("response.custom_tool_call_input.delta",
                                          item_id=item["id"], output_index=index,
                                          delta=item["input"]))  # fmt: skip
                out.append(self.event("response.custom_tool_call_input.done", item_id=item["id"],
                                      output_index=index, input=item["input"]))  # fmt: skip
            else:
                out.append(self.event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))  # fmt: skip
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


def _grammars_in(tools: list[dict[str, Any]] | None) -> bool:
    """Whether any of the tools is a custom tool with a grammar to read."""
    return any(
        isinstance(t, dict) and isinstance(t.get("format"), dict)
        and t["format"].get("type") == "grammar"
        for t in tools or []
    )  # fmt: skip
