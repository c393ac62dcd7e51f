"""Tools for a model whose chat template knows none: the server's own tool protocol.

Agents send tools with `tool_choice: auto` whatever the model; refusing them
(as a template without tools once made us do) fails every turn. So such a
model is given what a tool-calling template would give it, in Hermes' words and
markup, which most instruction-tuned models have seen: the tools, as JSON, at the
start of the system prompt; calls as
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`; results in user turns, as
`<tool_response>...</tool_response>`.

With `auto`, the reply runs under a lazy grammar: free text, until the model
writes `<tool_call>`; from there, a call of one of the tools whose arguments
validate against its schema, then the closing marker, then free text again.
A forced call is the same markup, its opening marker written into the prompt.

History renders calls and results exactly as generated (compact JSON), so a
turn's prompt begins with the tokens of the turn before it, and the cache
serves them. The tools come before the system text, as Anthropic's own cache
orders them: an agent's system text names its working directory, and a session
in another folder then still shares the tools' thousands of tokens with the last.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import StructTag

from .content import concat
from .structured import COMPACT, checked, tool_call_schema

START, END = "<tool_call>", "</tool_call>"
PREFIX = START + "\n"  # what a forced call's prompt ends with


def tools_section(tools: list[dict[str, Any]]) -> str:
    # Compact: an agent's tools are thousands of tokens, and a small model's context is short.
    listed = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\nFor each function call, return a json object with function "
        f"name and arguments within {START}{END} XML tags:\n{START}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + END
    )


def lazy_grammar(tools: list[dict[str, Any]]) -> str:
    """Free text with any number of calls of `tools` in it, each valid."""
    schema = {**tool_call_schema(tools), "x-guidance": {**COMPACT, "lenient": True}}
    tag = StructTag(trigger=START, begin=PREFIX, grammar=schema, end="\n" + END)
    return checked(StructTag.to_grammar([tag], assume_special=False), "tools", strict=False)


def markup(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls (chat's `tool_calls`, arguments as objects) as generated."""
    out = []
    for call in calls:
        function = call.get("function") or {}
        body = {"name": function.get("name"), "arguments": function.get("arguments")}
        out.append(f"{PREFIX}{json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n{END}")
    return "\n".join(out)


def parse(text: str) -> dict[str, Any]:
    """The call between the markers; ValueError if it is not one."""
    call = json.loads(text)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("not a call")
    return call


def history(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as a template without tools can render them: the tools section at
    the start of the (first) system turn (so that a change in the system text keeps the
    tools' KV in the cache), calls as markup in assistant turns, results as
    user turns; consecutive user turns joined, as templates that insist on alternating
    roles need."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = markup(message.pop("tool_calls"))
            text = message.get("content") or ""
            message["content"] = f"{text}\n{calls}" if text else calls
        elif message.get("role") == "tool":  # its content may hold images: `concat`
            result = concat("<tool_response>\n", message.get("content") or "", "\n</tool_response>")
            message = {"role": "user", "content": result}
        last = out[-1] if out else None
        if last is not None and last["role"] == "user" == message["role"]:
            last["content"] = concat(last["content"], "\n", message["content"])
            continue
        out.append(message)
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": concat(section, "\n\n", out[0]["content"])}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
