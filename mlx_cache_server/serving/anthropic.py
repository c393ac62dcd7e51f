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
from typing import Any, Literal

import pydantic_core
from fastapi import Request
from pydantic import Field

from ..engine import Delta, Event, Failed, Finished, Started
from .api_errors import APIError
from .chat import ChatCompletionsServing, chat_request, check_request_chars
from .generation import (
    collect,
    compiling,
    failure_status,
    off_loop,
    until_disconnected,
    with_pauses,
)
from .limits import check_model
from .openai_bodies import ChatCompletionRequest, TextRequest, ToolCallDelta, _Request
from .sse import EventStream
from .template import render
from .tools import compiles_grammar, plan_tools

ROUTE = "/v1/messages"
PING_EVERY = 5.0  # seconds without an event before a ping: agents warn of stalls after ~20
# Anthropic's own tools, run on its servers: nothing here runs them, so none is offered.
SERVER_TOOLS = ("web_search", "web_fetch", "code_execution", "tool_search_tool", "mcp_toolset")
# Blocks of Anthropic's server tools in an assistant turn: never ours to render.
SERVER_BLOCKS = {"server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                 "code_execution_tool_result", "bash_code_execution_tool_result",
                 "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                 "tool_search_tool_result", "container_upload"}  # fmt: skip


class AnthropicMessage(_Request):
    # Claude Code sends "system" turns among the messages (the agent types it offers).
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(TextRequest):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(default=1, ge=1)


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The same request in chat completions' terms, or a 400 naming what cannot be."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls, thoughts = [], [], []
        for j, block in enumerate(blocks):
            kind, where = block.get("type"), f"messages[{i}].content[{j}]"
            text = _block_text(block, where) if m.role != "assistant" or kind == "text" else None
            if text is not None:
                texts.append(text)
            elif kind == "tool_result" and m.role == "user":
                text = _text(block.get("content"), f"{where}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                messages.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id")), "content": text}
                )
            elif kind == "tool_use" and m.role == "assistant":
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                function = {"name": str(block.get("name")), "arguments": arguments}
                calls.append({"id": str(block.get("id")), "type": "function", "function": function})
            elif kind == "thinking" and m.role == "assistant":
                # As generated: a template that writes thinking back renders those tokens.
                thoughts.append(str(block.get("thinking") or ""))
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue  # another server's encrypted thinking: nothing to render
            elif kind in SERVER_BLOCKS and (m.role == "assistant" or kind == "container_upload"):
                continue  # Anthropic's server tools (and their files), never offered here
            else:
                raise APIError(400, f"Unsupported content block {kind!r} here.", param=where)
        role = m.role
        if role == "system":  # before any turn, it is the system prompt's; after, a user's
            started = any(x["role"] != "system" for x in messages)
            if not started and messages:
                messages[0]["content"] += "\n\n" + "\n\n".join(texts)
                continue
            role = "user" if started else "system"
        if role == "system":
            messages.append({"role": "system", "content": "\n\n".join(texts)})
        elif role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                out["tool_calls"] = calls
            if thoughts:
                out["reasoning_content"] = "".join(thoughts)
            messages.append(out)
        elif texts:
            text = "\n\n".join(texts)
            if messages and messages[-1]["role"] == "user":  # Anthropic merges such turns
                messages[-1]["content"] += "\n\n" + text
            else:
                messages.append({"role": "user", "content": text})
    tools = _tools(req.tools or [], _loaded(req.messages))
    chat = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "tools": tools or None,
        "tool_choice": _tool_choice(req.tool_choice) if tools else None,
        "response_format": _format(req),
    }
    if not messages:
        raise APIError(400, "The messages have no content.", param="messages")
    return chat_request(chat)


def _format(req: MessagesRequest) -> dict[str, Any] | None:
    """Structured output (`output_config.format`, as Claude Code asks for its titles) as
    chat's response_format."""
    config = (req.model_extra or {}).get("output_config")
    spec = config.get("format") if isinstance(config, dict) else None
    if not isinstance(spec, dict):
        return None
    if spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": '
                       "{...}}.", param="output_config.format")  # fmt: skip
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


def _tools(tools: list[dict[str, Any]], loaded: set[str]) -> list[dict[str, Any]]:
    """The tools to offer, as chat's functions: Anthropic's server tools left out, and
    `defer_loading` ones until a tool search has loaded them (a `tool_reference`)."""
    out = []
    for i, t in enumerate(tools):
        kind = str(t.get("type") or "custom")
        if kind.startswith(SERVER_TOOLS) or (
            t.get("defer_loading") and t.get("name") not in loaded
        ):
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"A tool of type {kind!r} needs a 'name'.", param=f"tools[{i}]")
        parameters = t.get("input_schema") or {"type": "object", "properties": {}}
        function = {"name": t.get("name"), "description": t.get("description", "")}
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def _loaded(messages: list[AnthropicMessage]) -> set[str]:
    """Tools a tool search loaded in the conversation: `tool_reference` blocks' names."""
    names: set[str] = set()
    for m in messages:
        for block in m.content if isinstance(m.content, list) else []:
            inner = block.get("content") if block.get("type") == "tool_result" else None
            for b in [block, *(inner if isinstance(inner, list) else [])]:
                if isinstance(b, dict) and b.get("type") == "tool_reference":
                    names.add(str(b.get("tool_name")))
    return names


def _block_text(block: dict[str, Any], where: str) -> str | None:
    """What a model that reads text takes from a user-side block; None for blocks that are
    not text-like (tool results, calls, thinking), which the caller handles."""
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise APIError(400, "A text block needs its 'text'.", param=f"{where}.text")
        return block["text"]
    if kind == "image":
        return "[An image was attached here; this server passes text only.]"
    if kind == "tool_reference":
        return f"Tool loaded: {block.get('tool_name')}"
    if kind == "search_result":
        body = _text(block.get("content"), f"{where}.content")
        return "\n".join(str(x) for x in (block.get("title"), block.get("source"), body) if x)
    if kind == "document":
        source = block.get("source") if isinstance(block.get("source"), dict) else {}
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            body = source["data"]
        elif source.get("type") == "content":
            body = _text(source.get("content"), f"{where}.source.content")
        else:  # a PDF or a file by URL or id: nothing here reads those
            body = "[A document was attached here; this server passes text only.]"
        return f"{block['title']}\n{body}" if isinstance(block.get("title"), str) else body
    return None


def _text(blocks: Any, param: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, "Expected a string or a list of text blocks.", param=param)
    texts = []
    for j, block in enumerate(blocks):
        text = _block_text(block, f"{param}[{j}]") if isinstance(block, dict) else None
        if text is None:
            raise APIError(400, "Only text-like blocks are supported here.", param=f"{param}[{j}]")
        texts.append(text)
    return "\n\n".join(texts)


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    kind = (choice or {"type": "auto"}).get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, f"Unknown tool_choice type {kind!r}.", param="tool_choice")


class MessagesServing:
    def __init__(self, chat: ChatCompletionsServing) -> None:
        self.chat = chat

    def served_as(self, name: str) -> str:
        """Claude model names mean the served model (agents send theirs), as do the
        configured aliases (`--model-alias`)."""
        return self.chat.engine.model_id if name.startswith("claude") else name

    async def create(self, req: MessagesRequest, request: Request, tenant: str | None) -> Any:
        chat = await off_loop(to_chat, req)
        chat.model = self.served_as(req.model)
        run = await self.chat.start(chat, tenant, route=ROUTE)
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
        chat = await off_loop(to_chat, req)
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
        tokens = await off_loop(render, engine, chat, tools, strip, kwargs)
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
