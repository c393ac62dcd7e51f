"""An assistant's past tool calls as the model's own chat template can render them.

Clients send back the calls they were given, with the ids they were given (`call_...`
on chat completions, `toolu_...` on Messages, whatever another server issued). Some
templates require ids of their own form: Mistral's insists on 9 alphanumeric
characters and raises on any other. There every id is rendered as a 9-character one
derived from it, the same each time (so a conversation's prompt begins with the
tokens of its previous turn, and the cache serves them), a call and its result alike.
An id the model generated in that form is the tail of the id the client is given
(`call_id`: `call_` and it; `toolu_` and it on Messages), and renders back as it was
generated.

Such a template also requires user and assistant turns to alternate, a call's results
standing for none: a user turn right after a tool's result (a client's next question,
or Messages' tool_result and text in one user message) is refused. There the results
are followed by an empty assistant turn, which is what the client's history says: the
model has not answered them (`with_answers_after_results`).

Some templates drop `tool_calls` altogether (LFM2.5's writes only `content`): the call
would vanish from the history, leaving an empty assistant turn before its result.
There the calls are written into the content in the model's own call syntax, as it
generated them.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any

_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")
_OUR_ID = re.compile(r"(?:call_|toolu_)([A-Za-z0-9]{9})")  # `call_id`'s, as the APIs send it
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


def call_id(model_id: Any = None) -> str:
    """A new call's id: `call_` and the model's own id where it wrote one in the short
    form (which `short_id` renders back as it), else `call_` and random hex."""
    if isinstance(model_id, str) and _SHORT_ID.fullmatch(model_id):
        return f"call_{model_id}"
    return f"call_{uuid.uuid4().hex[:24]}"


def short_id(call_id: Any) -> str:
    """`call_id` as 9 alphanumeric characters: itself where it is already one, the
    model's own id where it is one `call_id` built on it, else characters drawn from its
    hash, so the same id always renders the same."""
    text = call_id if isinstance(call_id, str) else ""
    if _SHORT_ID.fullmatch(text):
        return text
    ours = _OUR_ID.fullmatch(text)
    if ours is not None:
        return ours[1]
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


def with_answers_after_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with an empty assistant turn between a tool's result and a user turn
    right after it, for a template that requires the two to alternate."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "user" and out and out[-1].get("role") == "tool":
            out.append({"role": "assistant", "content": ""})
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
