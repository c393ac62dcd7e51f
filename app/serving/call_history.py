"""An assistant's past tool calls as the model's own chat template can render them.

Clients send back the calls they were given, with the ids they were given (`call_...`
on chat completions, `toolu_...` on Messages, whatever another server issued). Some
templates require ids of their own form: Mistral's insists on 9 alphanumeric
characters and raises on any other. There every id is rendered as a 9-character one
derived from it, the same each time (so a conversation's prompt begins with the
tokens of its previous turn, and the cache serves them), a call and its result alike.

Some templates drop `tool_calls` altogether (LFM2.5's writes only `content`): the call
would vanish from the history, leaving an empty assistant turn before its result.
There the calls are written into the content in the model's own call syntax, as it
generated them.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _parser_name(tokenizer: Any) -> str:
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1]


def needs_short_ids(tokenizer: Any) -> bool:
    """Whether the template requires Mistral's 9-character alphanumeric call ids."""
    template = getattr(tokenizer, "chat_template", None)
    return _parser_name(tokenizer) == "mistral" or (
        isinstance(template, str) and "[CALL_ID]" in template
    )


def short_id(call_id: Any) -> str:
    """`call_id` as 9 alphanumeric characters: itself where it is already one, else
    characters drawn from its hash, so the same id always renders the same."""
    text = call_id if isinstance(call_id, str) else ""
    if _SHORT_ID.fullmatch(text):
        return text
    number = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHABET))
        out.append(_ALPHABET[digit])
    return "".join(out)


def with_short_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every call id, and every result's `tool_call_id`, shortened."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "id": short_id(call.get("id"))} for call in message["tool_calls"]
            ]
        if "tool_call_id" in message:
            message["tool_call_id"] = short_id(message["tool_call_id"])
        out.append(message)
    return out


def drops_calls(tokenizer: Any) -> bool:
    """Whether the template knows tools but never writes an assistant's `tool_calls`."""
    template = getattr(tokenizer, "chat_template", None)
    return (
        bool(getattr(tokenizer, "has_tool_calling", False))
        and isinstance(template, str)
        and "tool_calls" not in template
    )


def with_calls_in_content(messages: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """The messages with each assistant's calls written before its content in the model's
    call syntax (where there is one to write them in: pythonic, for now)."""
    if _parser_name(tokenizer) != "pythonic":
        return messages
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    out = []
    for message in messages:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        written = pythonic(calls) if calls else None
        if written is not None:
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{start}{written}{end}{message.get('content') or ''}"
        out.append(message)
    return out


def pythonic(calls: list[dict[str, Any]]) -> str | None:
    """Calls (arguments as objects) as `[name(key=value, ...), ...]`, values as JSON, which
    mlx-lm's pythonic parser reads back; None if one cannot be written so."""
    written = []
    for call in calls:
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            return None
        if not isinstance(arguments, dict):
            return None
        if not all(isinstance(k, str) and _IDENTIFIER.fullmatch(k) for k in arguments):
            return None
        args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
        written.append(f"{name}({args})")
    return f"[{', '.join(written)}]"
