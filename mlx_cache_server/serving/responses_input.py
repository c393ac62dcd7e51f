"""The Responses API's request, in chat completions' terms: input items become chat
messages, tools become chat's functions.

Turns are merged as a chat template expects them: one leading system turn (the
instructions and developer messages), no two user turns in a row, and an
assistant's text and calls in one turn, as the model produced them (so its
tokens stay cached). A namespace's tools (Codex groups its sub-agent tools and
each MCP server's in one) are offered as `namespace.name`; the calls come back
with the bare name and the namespace apart, as Codex reads them. The provider's
own tools (web search, file search, a hosted shell, ...) and the items of their
calls are accepted and not offered: nothing here runs them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import llguidance
from pydantic import Field

from ..engine.constraint import on_deep_stack
from .api_errors import APIError
from .chat import chat_request
from .content import Piece, appended, image_part, joined
from .images import ImageReader
from .lark_regex import NotRegular, lark_to_regex
from .openai_bodies import ChatCompletionRequest, TextRequest
from .schema_costs import pattern_problem

# A custom (free-form) tool is offered to the model as a function of one string, since
# that is what chat templates and tool parsers know; its call goes back to the client
# as a custom_tool_call with that string as its input. The tool's input grammar (say,
# Codex's apply_patch in Lark) is shown to the model in its description and, when it
# is regular, enforced as the string's pattern (`lark_regex`).
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}
# The provider's own tools, and the built-in ones whose calls come back as their own
# item types (a shell, apply_patch as a tool type): accepted, never offered.
HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "web_search_2025_08_26", "file_search", "code_interpreter", "computer",
                "computer_use_preview", "computer_use", "image_generation", "local_shell", "shell",
                "apply_patch", "mcp", "tool_search", "programmatic_tool_calling"}  # fmt: skip
# Input items of those tools' calls (and items that stand for stored ones): accepted and left
# out of the prompt, as the tools themselves are. An `additional_tools` item's tools are
# offered as the request's own (`offered_tools`); the item itself says nothing more.
HOSTED_ITEMS = {"web_search_call", "file_search_call", "code_interpreter_call",
                "computer_call", "computer_call_output", "image_generation_call",
                "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
                "apply_patch_call", "apply_patch_call_output", "mcp_call", "mcp_list_tools",
                "mcp_approval_request", "mcp_approval_response", "tool_search_call",
                "tool_search_output", "compaction", "compaction_trigger", "item_reference",
                "additional_tools", "configuration_update", "program",
                "program_output"}  # fmt: skip


log = logging.getLogger("mlx_cache_server.requests")


@dataclass(frozen=True)
class Offered:
    """A tool as the client named it: its kind ("function" or "custom") and namespace."""

    kind: str
    name: str
    namespace: str | None = None


def qualified(name: str, namespace: str | None) -> str:
    """The name the model sees and calls a tool by."""
    return f"{namespace}.{name}" if namespace else name


class ResponsesRequest(TextRequest):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None  # accepted and ignored, as in chat completions
    parallel_tool_calls: bool | None = None


def to_chat(
    req: ResponsesRequest, images: ImageReader | None = None
) -> tuple[ChatCompletionRequest, dict[str, Offered]]:
    """The same request in chat completions' terms, and the tools offered by the names the
    model calls them by; or a 400 naming what cannot be. With `images` (a vision model),
    `input_image` parts of messages and of tool outputs are images."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = input_items(req)
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        kind, where = item.get("type") or _untyped(item), f"input[{i}]"
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"Unknown role {role!r}.", param=f"{where}.role")
            role = "system" if role == "developer" else role
            text = _content(item.get("content"), where, images if role == "user" else None)
            if last is not None and last["role"] == role and role in ("system", "user"):
                last["content"] = appended(last["content"], text, "\n\n")
            else:
                messages.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = _named(item, "call_id", where), _named(item, "name", where)
            namespace = item.get("namespace")
            name = qualified(name, namespace if isinstance(namespace, str) else None)
            arguments = item.get("arguments", "")
            if kind == "custom_tool_call":
                if not isinstance(item.get("input"), str):
                    raise APIError(400, "'input' must be a string.", param=f"{where}.input")
                arguments = _custom_arguments(item["input"])
            if not isinstance(arguments, str):
                raise APIError(400, "'arguments' must be a string of JSON.",
                               param=f"{where}.arguments")  # fmt: skip
            function = {"name": name, "arguments": arguments}
            call = {"id": call_id, "type": "function", "function": function}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same turn's text or calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            content = (
                output if isinstance(output, str) else _content(output, f"{where}.output", images)
            )
            call_id = _named(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            # The thinking of the assistant turn that follows, as it was generated: a template
            # that writes thinking back renders those tokens.
            thought = "".join(
                str(part.get("text") or "")
                for part in item.get("content") or []
                if isinstance(part, dict) and part.get("type") == "reasoning_text"
            )
            continue
        elif kind in HOSTED_ITEMS:
            continue
        else:
            raise APIError(400, f"Unsupported input item type {kind!r}.", param=where)
        turn = messages[-1]
        if thought is not None and turn["role"] == "assistant":
            turn.setdefault("reasoning_content", thought)
        thought = None
    if not messages:
        raise APIError(400, "The input is empty.", param="input")
    tools, offered = _tools(offered_tools(req))
    choice, tools = _tool_choice(req.tool_choice, offered, tools)
    chat = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools or None,
        "tool_choice": choice if tools else None,
        "response_format": _format(req.text),
    }
    return chat_request(chat), offered


def offered_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The tools the request offers: its `tools`, then those of its `additional_tools` input
    items (how Codex sends its tools when it asks for OpenAI's "responses lite")."""
    extra = [
        tool
        for item in input_items(req)
        if isinstance(item, dict) and item.get("type") == "additional_tools"
        for tool in (item.get("tools") if isinstance(item.get("tools"), list) else [])
    ]
    return [*(req.tools or []), *extra]


def _untyped(item: dict[str, Any]) -> str:
    """The type of an item sent without one: a message, or (an id alone) a reference."""
    return "item_reference" if "role" not in item and "id" in item else "message"


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items: a string is one user message."""
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def _tools(given: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Offered]]:
    """Chat's functions for the function and custom tools (a namespace's among them), and
    each one's client-side names by the name the model calls it by."""
    tools: list[dict[str, Any]] = []
    offered: dict[str, Offered] = {}
    entries = []
    for i, tool in enumerate(given):
        if tool.get("type") == "namespace":
            ns, inner = tool.get("name"), tool.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise APIError(400, "A namespace needs a 'name' and a list of 'tools'.",
                               param=f"tools[{i}]")  # fmt: skip
            entries += [(t, ns, f"tools[{i}].tools[{j}]") for j, t in enumerate(inner)]
        else:
            entries.append((tool, None, f"tools[{i}]"))
    for tool, ns, where in entries:
        if not isinstance(tool, dict):
            raise APIError(400, "Each tool must be an object.", param=where)
        kind, name = tool.get("type"), tool.get("name")
        if isinstance(kind, str) and kind in HOSTED_TOOLS and ns is None:
            continue  # the provider's own tools: nothing here runs them, so none is offered
        if kind not in ("function", "custom"):
            raise APIError(400, f"Unsupported tool type {kind!r}.", param=where)
        if not isinstance(name, str) or not name:
            raise APIError(400, "Each tool needs a 'name'.", param=f"{where}.name")
        called = qualified(name, ns)
        if called in offered:
            raise APIError(400, f"Two tools are named {called!r}.", param=f"{where}.name")
        offered[called] = Offered(kind, name, ns)
        function = {"name": called, "description": _description(tool, where)}  # checks format
        if kind == "custom":
            parameters = _custom_parameters(tool, called, where)
        else:
            parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": {**function, "parameters": parameters}})
    return tools, offered


def _description(tool: dict[str, Any], where: str) -> str:
    text = tool.get("description") or ""
    if tool.get("type") != "custom" or tool.get("format") is None:
        return text
    spec = tool["format"]
    if isinstance(spec, dict) and spec.get("type") == "text":
        return text
    ok = isinstance(spec, dict) and spec.get("type") == "grammar"
    if not ok or not all(isinstance(spec.get(k), str) for k in ("syntax", "definition")):
        raise APIError(
            400,
            'A custom tool\'s format is {"type": "text"} or {"type": "grammar", "syntax": ..., '
            '"definition": ...}.',
            param=f"{where}.format",
        )
    grammar = f"The input follows this {spec['syntax']} grammar:\n{spec['definition']}"
    return f"{text}\n\n{grammar}" if text else grammar


def _custom_parameters(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """The one-string parameters of a custom tool, the string held to the tool's grammar
    where that grammar is one regular expression (a Lark grammar that does not recurse,
    or a regex). A grammar that is not is shown to the model and left unenforced."""
    spec = tool.get("format")
    if not isinstance(spec, dict) or spec.get("type") != "grammar":
        return CUSTOM_PARAMETERS
    syntax, definition = spec["syntax"], spec["definition"]  # checked by _description
    try:
        if syntax == "lark":
            pattern = lark_to_regex(definition)
        elif syntax == "regex":
            pattern = definition
        else:
            raise NotRegular(f"unknown syntax {syntax!r}")
    except NotRegular as e:
        log.warning("custom tool %r: its grammar is not enforced: %s", name, e)
        return CUSTOM_PARAMETERS
    schema = {"type": "string", "pattern": f"^(?:{pattern})$"}
    error = pattern_problem(schema["pattern"]) or _pattern_error(schema)
    if error:
        log.warning("custom tool %r: its grammar is not enforced: %s", name, error)
        return CUSTOM_PARAMETERS
    return {**CUSTOM_PARAMETERS, "properties": {"input": schema}}


def _pattern_error(schema: dict[str, Any]) -> str | None:
    """What llguidance finds wrong with a string schema's pattern (its regex dialect is
    Rust's; a Lark grammar may hold Python's), or None."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        return str(e).split("\n", 1)[0]
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    error, messages = on_deep_stack(validate, grammar, None)
    return "; ".join(m.strip().split("\n", 1)[0] for m in messages) if error else None


def _custom_arguments(text: str) -> str:
    return json.dumps({"input": text}, ensure_ascii=False)


def _named(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{key}' is required here.", param=f"{where}.{key}")
    return value


def _content(content: Any, where: str, images: ImageReader | None) -> str | list[dict[str, Any]]:
    """A message's or tool output's content: its text, or with `images` chat's parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "Expected a string or a list of text parts.", param=where)
    texts: list[Piece] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images is not None:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise APIError(400, "An input_image needs its image_url (a base64 data URL); "
                               "this server reads no file_id.", param=f"{where}[{j}]")  # fmt: skip
            texts.append(image_part(images.data_url(url, f"{where}[{j}].image_url")))
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise APIError(
                400, f"This model reads text only: an {kind} part cannot be given to it. Send "
                "the text it holds as an input_text part.", param=f"{where}[{j}]",
                code="unsupported_content",
            )  # fmt: skip
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(
            part.get(key), str
        ):
            raise APIError(400, f"Unsupported content part {kind!r}.", param=f"{where}[{j}]")
        texts.append(part[key])
    return joined(texts, "")


def _tool_choice(
    choice: Any, offered: dict[str, Offered], tools: list[dict[str, Any]]
) -> tuple[Any, list[dict[str, Any]]]:
    """Chat's tool_choice, and the tools the model may call under it."""
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice needs a function or custom tool.",
                           param="tool_choice")  # fmt: skip
        return choice, tools
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom"):
        name = qualified(str(choice.get("name")), choice.get("namespace"))
        if name not in offered or offered[name].kind != kind:
            raise APIError(400, f"tool_choice names no {kind} tool given: {name!r}.",
                           param="tool_choice")  # fmt: skip
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        listed = choice.get("tools") if isinstance(choice.get("tools"), list) else []
        names = {qualified(str(t.get("name")), t.get("namespace")) for t in listed
                 if isinstance(t, dict)}  # fmt: skip
        allowed = [t for t in tools if t["function"]["name"] in names]
        if mode not in ("auto", "required") or (mode == "required" and not allowed):
            raise APIError(400, 'allowed_tools needs mode "auto" or "required" and, for '
                           "required, a tool given.", param="tool_choice")  # fmt: skip
        return mode, allowed
    if isinstance(kind, str) and kind in HOSTED_TOOLS:
        raise APIError(400, f"tool_choice forces {kind!r}, a tool this server does not run.",
                       param="tool_choice")  # fmt: skip
    raise APIError(400, f"Unsupported tool_choice {choice!r}.", param="tool_choice")


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    spec = (text or {}).get("format")
    if not isinstance(spec, dict) or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_schema":
        schema = {key: spec.get(key) for key in ("name", "schema", "strict")}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": spec.get("type")}
