"""gpt-oss's harmony format: its replies split into reasoning, content and tool calls, its
forced calls generated in its own markup, and its history given as its template reads it.

A harmony chat is a run of messages, each `<|start|>HEADER<|message|>BODY` and an end:
`<|end|>` (more follows), `<|call|>` (a tool call: the model waits for its result) or
`<|return|>` (the answer is done). The header names the author ("assistant"), the channel
(`<|channel|>analysis`, `commentary` or `final`), maybe a recipient (` to=functions.NAME`,
written before or after the channel) and a content type (` json`, ` <|constrain|>json`).
The generation prompt is `<|start|>assistant`, so a reply begins inside its first header.
gpt-oss stops on `<|call|>` and `<|return|>`, which are then not in the reply's text, and
a reply may end inside a message (max_tokens).

How a reply is read (`HarmonySplit`), the same streamed piece by piece or whole:
- an analysis message's body is reasoning, as generated: the template writes an earlier
  turn's thinking back between `<|message|>` and `<|end|>`, so nothing is trimmed;
- a message to `functions.NAME` is a call of NAME, its body the arguments, streamed as
  they come after a delta with the call's id and name; with tool_choice "none" dropped;
- a message to another recipient (the built-in python or browser tools, which this server
  does not run) is the model's working: reasoning;
- final messages, and commentary without a recipient, are content;
- markup never reaches reasoning, content or arguments: a header is held back until its
  `<|message|>`, and text that may be the start of an end marker until ruled out;
- a reply that opens with no header (a header is short and holds no newline) is content,
  as it came.

A forced call (`forced_call_grammar`) is generated in the form the template writes an
assistant's call back: ` to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`
after the generation prompt, ARGS as the template's `tojson` writes them (", " and ": "),
so the next turn's prompt holds the tokens generated. gpt-oss writes a call of its own
accord as `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`: it is
read the same, but the template writes it back in its form, so the next turn reuses the
prompt before it only (as after a final answer, whose analysis the template drops).

`history` gives the template an assistant turn's thinking where it reads it, `thinking`.
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
from collections.abc import Callable
from typing import Any

from .openai_bodies import FunctionCallDelta, ToolCall, ToolCallDelta
from .structured import TEMPLATE_JSON, checked, tool_call_schema

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
# What ends a message's body; a `<|start|>` without an end before it ends one too.
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
HEADER_LIMIT = 256  # longer, or with a newline, it is no header: the reply is plain text

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")


def is_harmony(tokenizer: Any) -> bool:
    """Whether the model chats in harmony: its template writes harmony's markers (or,
    without a template, its vocabulary has them)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return CHANNEL in template and START in template
    with contextlib.suppress(KeyError, TypeError):
        return _by_vocabulary[tokenizer]
    vocab = getattr(tokenizer, "get_vocab", None)
    known = vocab() if callable(vocab) else {}
    found = CHANNEL in known and START in known
    with contextlib.suppress(TypeError):  # built once per tokenizer: it is every request's
        _by_vocabulary[tokenizer] = found
    return found


_by_vocabulary: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def route(header: str) -> tuple[str, str]:
    """What a message's body is, from its header: ("call", name), ("reasoning", "") or
    ("content", "")."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        to = recipient[1]
        if to.startswith("functions.") and len(to) > len("functions."):
            return "call", to[len("functions.") :]
        return "reasoning", ""
    channel = _CHANNEL.search(header)
    if channel is not None and channel[1] == "analysis":
        return "reasoning", ""
    return "content", ""


class HarmonySplit:
    """Reply text in; reasoning, content and tool-call deltas out.

    States: "header" (held until its `<|message|>`) and "body" (of `kind`: "reasoning",
    "content", "call" or "drop", a call tool_choice "none" leaves out).
    """

    def __init__(self, new_call: Callable[[str], ToolCall], keep_calls: bool = True) -> None:
        self.new_call = new_call  # a call of that name, with its id and no arguments yet
        self.keep_calls = keep_calls
        self.state, self.kind = "header", ""
        self.held = ""
        self.opened = 0  # messages begun
        self.thought = False  # an analysis message was begun
        self.calls: list[ToolCall] = []  # the calls so far, arguments as generated

    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        out = _Pieces()
        self.held += text
        while self._step(out):
            pass
        return out.reasoning, out.content, out.calls

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        """What was held back, at the reply's end: an unfinished end marker is body text;
        an unfinished header is markup, unless it holds none (plain text)."""
        out, held, self.held = _Pieces(), self.held, ""
        if self.state == "body":
            self._body(held, out)
        elif held.strip() and "<|" not in held:  # text with no markup, at the start or
            out.content += held  # after a message's end: the model's words, kept
        return out.reasoning, out.content, out.calls

    def whole(
        self, text: str, keep_cut: bool = False
    ) -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole reply's reasoning (None: it had no analysis), content (None: only calls)
        and calls; a call whose arguments are no JSON object (cut off) is content, as text,
        unless `keep_cut` (a forced call: a call cut off is still one, as streamed)."""
        reasoning, content, _ = self.feed(text)
        more_reasoning, more_content, _ = self.finish()
        content += more_content
        calls = []
        for call in self.calls:
            if keep_cut or _json_object(call.function.arguments):
                calls.append(call)
            else:
                content += call.function.arguments
        return (
            reasoning + more_reasoning if self.thought else None,
            None if calls and not content.strip() else content,
            calls,
        )

    def _step(self, out: _Pieces) -> bool:
        """One header or one end marker further; False when the held text needs more."""
        if self.state == "header":
            at = self.held.find(MESSAGE)
            # Read as the stream reads it, whole or not: text with a line break or past
            # a header's length before any `<|message|>` is no header but plain text.
            head = self.held if at < 0 else self.held[:at]
            if "\n" in head or len(head) > HEADER_LIMIT:
                self.state, self.kind = "body", "content"
                return True
            if at < 0:
                return False
            header, self.held = self.held[:at], self.held[at + len(MESSAGE) :]
            self._open(header, out)
            return True
        hits = [(i, end) for end in ENDS if (i := self.held.find(end)) >= 0]
        if not hits:
            keep = max(_partial_suffix(self.held, end) for end in ENDS)
            cut = len(self.held) - keep
            self._body(self.held[:cut], out)
            self.held = self.held[cut:]
            return False
        at, end = min(hits)
        self._body(self.held[:at], out)
        self.held, self.state = self.held[at + len(end) :], "header"
        return True

    def _open(self, header: str, out: _Pieces) -> None:
        self.state, self.opened = "body", self.opened + 1
        self.kind, name = route(header)
        self.thought = self.thought or self.kind == "reasoning"
        if self.kind == "call" and not self.keep_calls:
            self.kind = "drop"
        elif self.kind == "call":
            call = self.new_call(name)
            self.calls.append(call)
            function = FunctionCallDelta(name=name, arguments="")
            out.calls.append(
                ToolCallDelta(
                    index=len(self.calls) - 1, id=call.id, type="function", function=function
                )  # fmt: skip
            )

    def _body(self, text: str, out: _Pieces) -> None:
        if not text:
            return
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "content":
            out.content += text
        elif self.kind == "call":
            self.calls[-1].function.arguments += text
            out.arguments(len(self.calls) - 1, text)


class _Pieces:
    """What one piece of the reply adds."""

    def __init__(self) -> None:
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCallDelta] = []

    def arguments(self, index: int, text: str) -> None:
        # One entry per call in a chunk: clients read each index's first entry alone.
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index:
            last.function.arguments = (last.function.arguments or "") + text
        else:
            function = FunctionCallDelta(arguments=text)
            self.calls.append(ToolCallDelta(index=index, function=function))


def forced_call_grammar(tools: list[dict[str, Any]]) -> str:
    """A grammar for one call of one of `tools`, written as the template writes it back."""
    schema = tool_call_schema(tools)
    defs = schema.get("$defs") or {}
    options = {**TEMPLATE_JSON, "lenient": True}
    lines, names = ["%llguidance {}"], []
    for i, branch in enumerate(schema.get("anyOf", [schema])):
        name = branch["properties"]["name"]["const"]
        arguments = dict(branch["properties"]["arguments"])
        if defs:  # pointers into the call schema's `$defs` resolve from here too
            arguments["$defs"] = {**(arguments.get("$defs") or {}), **defs}
        arguments["x-guidance"] = options
        head = json.dumps(f" to=functions.{name}")
        lines.append(f'call{i}: {head} <|channel|> "commentary json" <|message|> args{i} <|call|>')
        lines.append(f"args{i}: %json {json.dumps(arguments, ensure_ascii=False)}")
        names.append(f"call{i}")
    lines.insert(1, "start: " + " | ".join(names))
    return checked("\n".join(lines) + "\n", "tools", strict=False)


def history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as the harmony template reads them: an assistant turn's thinking as
    `thinking`. Before a call the template writes content or thinking as its analysis and
    refuses both: the thinking is what the model wrote there, so it is kept."""
    out = []
    for message in messages:
        reasoning = message.get("reasoning_content")
        if message.get("role") == "assistant" and reasoning is not None:
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
            message["thinking"] = reasoning
            if message.get("tool_calls") and message.get("content") and reasoning:
                message["content"] = ""
        out.append(message)
    return out


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
