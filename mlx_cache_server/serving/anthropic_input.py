"""Anthropic's Messages request in chat completions' terms: its system text, turns and
blocks as chat messages (a user's image blocks as images for a vision model), its tools
and tool choice, its output format; or a 400 naming the block that cannot be."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from .api_errors import APIError
from .chat import chat_request
from .content import Piece, appended, image_part, joined
from .images import ImageReader
from .openai_bodies import ChatCompletionRequest, TextRequest, _Request

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


def to_chat(req: MessagesRequest, images: ImageReader | None = None) -> ChatCompletionRequest:
    """The same request in chat completions' terms, or a 400 naming what cannot be. With
    `images` (a vision model's reader), a user's image blocks, and those of its tool
    results, are images; otherwise each is a line saying one was there."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _system(req.system)})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls, thoughts = [], [], []
        for j, block in enumerate(blocks):
            kind, where = block.get("type"), f"messages[{i}].content[{j}]"
            text = _block_text(block, where) if m.role != "assistant" or kind == "text" else None
            if kind == "image" and images is not None and m.role == "user":
                texts.append(_image(block, where, images))
            elif text is not None:
                texts.append(text)
            elif kind == "tool_result" and m.role == "user":
                pieces = _pieces(block.get("content"), f"{where}.content", images) or [""]
                if block.get("is_error") and isinstance(pieces[0], str):
                    pieces = ["Error: " + pieces[0], *pieces[1:]]
                elif block.get("is_error"):  # an image first
                    pieces = ["Error: ", *pieces]
                call_id = str(block.get("tool_use_id"))
                messages.append(
                    {"role": "tool", "tool_call_id": call_id, "content": joined(pieces, "\n\n")}
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
            content = joined(texts, "\n\n")
            if messages and messages[-1]["role"] == "user":  # Anthropic merges such turns
                messages[-1]["content"] = appended(messages[-1]["content"], content, "\n\n")
            else:
                messages.append({"role": "user", "content": content})
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


def _system(system: str | list[dict[str, Any]]) -> str:
    """The system prompt's text: Anthropic's API takes a string or text blocks there, and
    refuses any other block (an image among them, say) rather than reading it as text."""
    for j, block in enumerate(system if isinstance(system, list) else []):
        if block.get("type") != "text":
            raise APIError(400, "The system prompt takes text blocks only; got a "
                           f"{block.get('type')!r} block.", param=f"system[{j}]")  # fmt: skip
    return _text(system, "system")


def _text(blocks: Any, param: str) -> str:
    return "\n\n".join(_pieces(blocks, param, images=None))  # type: ignore[arg-type]


def _pieces(blocks: Any, param: str, images: ImageReader | None) -> list[Piece]:
    """The text of each block, or with `images` an image block's image."""
    if blocks is None:
        return []
    if isinstance(blocks, str):
        return [blocks]
    if not isinstance(blocks, list):
        raise APIError(400, "Expected a string or a list of text blocks.", param=param)
    pieces: list[Piece] = []
    for j, block in enumerate(blocks):
        if images is not None and isinstance(block, dict) and block.get("type") == "image":
            pieces.append(_image(block, f"{param}[{j}]", images))
            continue
        text = _block_text(block, f"{param}[{j}]") if isinstance(block, dict) else None
        if text is None:
            raise APIError(400, "Only text-like blocks are supported here.", param=f"{param}[{j}]")
        pieces.append(text)
    return pieces


def _image(block: dict[str, Any], where: str, images: ImageReader) -> dict[str, Any]:
    """Chat's part for an image block (base64 data, or a URL where the server fetches them),
    checked here."""
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if source.get("type") == "url":
        return image_part(images.data_url(source.get("url"), f"{where}.source.url"))
    if source.get("type") != "base64":
        raise APIError(
            400, "An image must be sent as base64 data (source.type 'base64'); this server "
            "reads no file.", param=f"{where}.source",
        )  # fmt: skip
    media, data = source.get("media_type"), source.get("data")
    return image_part(images.base64_data_url(media, data, f"{where}.source.data"))


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    kind = (choice or {"type": "auto"}).get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, f"Unknown tool_choice type {kind!r}.", param="tool_choice")
