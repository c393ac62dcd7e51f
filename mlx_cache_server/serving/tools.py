"""Tool calls: OpenAI's `tools` and `tool_choice` in, `tool_calls` out.

With `tool_choice` "auto" the model decides, in its own tool-call markup (the
markers and parser mlx-lm infers from its chat template); the markup is cut out
of the text, never sent as content. With "required" or a named function the
call is forced by a grammar (`structured.forced_call_grammar`; for gpt-oss's harmony,
`harmony.forced_call_grammar`) and is the whole reply. With "none" no call is made
or read. A model whose template knows no tools gets the server's own protocol for
them (`prompted_tools`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine import Engine
from ..engine.text import overlap
from . import call_formats, call_history, call_markup, harmony, prompted_tools
from .api_errors import APIError
from .openai_bodies import ChatCompletionRequest, FunctionCall, ToolCall
from .structured import checked, forced_call_grammar


@dataclass
class ToolPlan:
    mode: str  # "none", "auto" or "forced"
    tools: list[dict[str, Any]]  # what the template is shown
    grammar: str | None = None  # forced: the call's grammar
    templated: bool = True  # the chat template renders tools and tool calls itself
    prefix: str = ""  # forced: text the reply starts with, written into the prompt
    prompted: list[dict[str, Any]] | None = None  # tools described by `prompted_tools`
    form: call_markup.CallFormat | None = None  # forced: the model's own call markup
    # forced, in markup other than JSON: the whole call's text -> the call (else JSON)
    read: Callable[[str], list[ToolCall]] | None = None
    names: tuple[str, ...] = ()  # forced: the tools the call may be of

    @property
    def lazy(self) -> bool:
        """Whether the grammar is `auto`'s lazy one: free text, any calls in it valid."""
        return self.mode == "auto" and self.grammar is not None


def plan_tools(req: ChatCompletionRequest, engine: Engine) -> ToolPlan:
    """What the request's tools ask of this model, or a 400 saying why it cannot be done."""
    extra = req.model_extra or {}
    for legacy in ("functions", "function_call"):
        if legacy in extra:
            raise APIError(
                400,
                f"'{legacy}' is deprecated and not supported: send 'tools' and 'tool_choice'.",
                param=legacy,
            )
    tools = req.tools or []
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(
                400,
                'Each tool must be {"type": "function", "function": {"name": ...}}.',
                param=f"tools[{i}]",
            )
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    templated = _templated(engine.tokenizer)
    shown = tools if templated else []
    prompted = None if templated or not tools else tools
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise APIError(400, "tool_choice needs tools.", param="tool_choice")
        return ToolPlan("none", shown if tools else [], templated=templated, prompted=prompted)
    if choice == "auto":
        if templated:
            return ToolPlan("auto", shown, templated=templated)
        grammar = None
        if req.response_format is None or req.response_format.get("type") == "text":
            grammar = prompted_tools.lazy_grammar(tools)  # else the reply's format rules
        return ToolPlan("auto", [], grammar, templated=False, prompted=tools)
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise APIError(400, f"tool_choice names no tool given: {name!r}.", param="tool_choice")
    else:
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise APIError(
            400, "A forced tool call and response_format cannot be combined.", param="tool_choice"
        )
    names = tuple(t["function"]["name"] for t in chosen)
    if harmony.is_harmony(engine.tokenizer):  # the call in harmony's markup, as written back
        return ToolPlan("forced", shown, harmony.forced_call_grammar(chosen), names=names)
    form = call_formats.call_format(engine.tokenizer) if templated else None
    if form is not None and form.supports(chosen):  # the model's own markup, written back
        marker = call_markup.token_marker(engine.tokenizer)
        grammar = checked(form.grammar(chosen, marker), "tools", strict=False)
        read = (
            None
            if isinstance(form, call_markup.JsonBetweenMarkers)
            else _reader(form, engine, tools)
        )
        return ToolPlan("forced", shown, grammar, prefix=form.prefix, form=form, read=read,
                        names=names)  # fmt: skip
    if templated:
        return ToolPlan("forced", shown, forced_call_grammar(chosen), names=names)
    grammar = forced_call_grammar(chosen)
    return ToolPlan("forced", [], grammar, templated=False, prefix=prompted_tools.PREFIX,
                    prompted=tools, names=names)  # fmt: skip


def compiles_grammar(req: ChatCompletionRequest, engine: Engine) -> bool:
    """Whether `plan_tools` compiles a grammar for the request: a forced call, or `auto`
    under the server's own protocol (a template that knows no tools). A tool-aware
    template's `auto` and `none` compile nothing."""
    if not req.tools or req.tool_choice == "none":
        return False
    return not _templated(engine.tokenizer) or req.tool_choice not in (None, "auto")


def _templated(tokenizer: Any) -> bool:
    """Whether the chat template renders tools and calls itself: mlx-lm knows its call
    markup, or it is harmony's (which mlx-lm has no parser for: `harmony` reads it)."""
    return bool(getattr(tokenizer, "has_tool_calling", False)) or harmony.is_harmony(tokenizer)


def _reader(
    form: call_markup.CallFormat, engine: Engine, tools: list[dict[str, Any]]
) -> Callable[[str], list[ToolCall]]:
    """A forced call's text in `form` read by the model's own parser; [] if it is none
    (cut off by max_tokens)."""
    text = ToolCallText(engine, tools)

    def read(generated: str) -> list[ToolCall]:
        body = generated.removesuffix(form.end) if form.writes_end else generated
        if form.writes_end and body == generated:
            return []  # the grammar did not reach the call's end
        return text.parse(body) or []

    return read


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates expect them: arguments as objects."""
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str) and not arguments.strip():
            function["arguments"] = {}  # a call without arguments, as some clients send it
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass  # not JSON: the template gets the string as it was sent
        out.append({**call, "function": function})
    return out


def tool_call(name: str, arguments: Any, model_id: Any = None) -> ToolCall:
    """A call to send, its id built on the model's own where it wrote one a template
    writes back (`call_history.call_id`)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    function = FunctionCall(name=name, arguments=arguments)
    return ToolCall(id=call_history.call_id(model_id), function=function)


def forced_call(text: str) -> list[ToolCall]:
    """The call a forced reply is (the grammar made it valid JSON); [] if it was cut off
    (`cut_off_call` reads that one)."""
    try:
        call = json.loads(text)
    except ValueError:
        return []
    return [tool_call(call["name"], call["arguments"])]


# How far a forced call in JSON got: its name (whole when its closing quote came), then the
# arguments' key; the grammar makes it compact, name first.
_PARTIAL_HEAD = re.compile(r'\{"name": ?"((?:[^"\\]|\\.)*)(?:(")(, ?"arguments": ?)?)?')


def cut_off_call(text: str, names: tuple[str, ...], markup: bool = False) -> ToolCall:
    """A forced call cut off by max_tokens, as far as it came, so that the client gets it as
    a call (with finish_reason "length" saying it is incomplete), never as the reply's text:
    its name where it was written whole, else the one tool it could still become (else what
    there is of it); its arguments the text generated after their key. In markup other than
    JSON (`markup`), the arguments are the markup as generated and the name the longest
    tool's name in it."""
    if markup:
        written = [n for n in names if n in text]
        name = max(written, key=len) if written else _only(names, "")
        return tool_call(name, text)
    head = _PARTIAL_HEAD.match(text)
    if head is None:
        return tool_call(_only(names, ""), "")
    if head[2] is not None:  # the name whole; the arguments, what came of them
        with contextlib.suppress(ValueError):
            return tool_call(json.loads(f'"{head[1]}"'), text[head.end() :] if head[3] else "")
    return tool_call(_only(tuple(n for n in names if n.startswith(head[1])), head[1]), "")


def _only(names: tuple[str, ...], otherwise: str) -> str:
    return names[0] if len(names) == 1 else otherwise


class ToolCallText:
    """Separates a streamed reply into content and tool calls in the model's own markup
    (or, for a template without tools, `prompted_tools`' markup).

    Text that may be the start of a call marker is held back until ruled out, so
    no markup reaches the content.
    """

    def __init__(self, engine: Engine, tools: list[dict[str, Any]], prompted: bool = False) -> None:
        tokenizer = engine.tokenizer
        if prompted:
            self.start, self.end = prompted_tools.START, prompted_tools.END
            self.parser = lambda text, _tools: prompted_tools.parse(text)
        else:
            self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
            self.parser = call_formats.tool_parser(tokenizer)
        self.tools = tools
        self.pending, self.inside = "", False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content safe to send, and the calls completed, after `text` more of the reply."""
        self.pending += text
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.pending.find(self.start)
                if at < 0:
                    keep = overlap(self.pending, self.start)
                    cut = len(self.pending) - keep
                    content += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    return content, calls
                content += self.pending[:at]
                self.pending, self.inside = self.pending[at + len(self.start) :], True
            at = self.pending.find(self.end) if self.end else -1
            if at < 0:
                return content, calls
            parsed = self.parse(self.pending[:at])
            if parsed is None:  # not a call after all: the client sees what the model wrote
                content += self.start + self.pending[: at + len(self.end)]
            calls += parsed or []
            self.pending, self.inside = self.pending[at + len(self.end) :], False

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: an unclosed call is parsed if it can be (some
        templates end a call at the end token), else given back as the text it is."""
        rest, self.pending = self.pending, ""
        if self.inside:
            parsed = self.parse(rest)
            return ("", parsed) if parsed is not None else (self.start + rest, [])
        return rest, []

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in one call's markup; None if it is none (a model's slip, or markup
        quoted in its prose), which then stays text: dropping it left replies empty."""
        try:
            parsed = self.parser(text, self.tools)
        except Exception:
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            arguments = item.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    continue
            if isinstance(arguments, dict):  # a call whose arguments are no object is none
                calls.append(tool_call(item["name"], arguments, item.get("id")))
        return calls or None
