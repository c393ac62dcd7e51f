"""A forced tool call in the model's own markup: one small description per call format.

A forced call (`tool_choice` "required" or a named function) is generated under a
grammar. Written as bare JSON, it forces a model out of the markup it was trained
on, and its template writes the call back in that markup next turn, so the next
request reuses none of it. Each format here answers the same small protocol:

- `start`: the opening marker; `prefix`: what the prompt ends with (the marker and
  what the template writes right after it);
- `end`: what closes a call (stripped before the model's own parser reads it);
- `grammar(tools, marker)`: a Lark grammar (llguidance's) for the rest of one call
  of one of `tools`, exactly as the template writes it back, its arguments held to
  the tool's schema (closed, as `closed_schema` reads it). `marker(text)` is the
  grammar's spelling of a marker (a special token where the model has one);
- `writes(template)`, where a format has it: whether the model's template writes its
  calls in this form (one parser may read two, Mistral's and LongCat's).

`call_formats` picks the format for a model (`call_format`) and holds the formats of
the models whose markup is a variation on these.

The prompt is the template's own write-back of a call turn, cut where the call's
opening marker stands (`prompt_text`): where a generation prompt opens a thinking
block (`<think>`) and the template writes back `<think></think>` or nothing before
a call, the forced call's prompt is what the template writes back, so the next
request's prompt begins with this one's tokens and the call's.

Invariants:
- Each format's grammar admits, for a call the template renders, exactly the text
  between the prompt's `prefix` and the end of the turn, and the model's parser
  (mlx-lm's `tool_parser`, or the format's own `parse` where that one misreads the
  markup: `call_formats.tool_parser`) reads the call back from it.
- String-typed parameters of the XML formats are raw text, as the templates write
  them (no `<`, no surrounding white space, which the parsers strip); other values
  are JSON or Python literals the way the template writes them. Gemma 4's and
  pythonic values are written as `call_values` describes (numbers as Python prints
  them, Gemma's keys in its template's sorted order).
- A template that writes no call (LFM2.5's) has its calls written back into the
  content by `call_history`: that write-back is the one the grammar admits, and the
  forced call's prompt is the generation prompt and `prefix` (`prompt_text` is None).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_lm.tool_parsers import mistral

from .call_values import (
    GEMMA_QUOTE,
    GEMMA_TEXT,
    GemmaValues,
    Rules,
    plain_parameters,
    python_scalar,
)
from .closed_schema import closed
from .schema_bounds import check_schema
from .structured import TEMPLATE_JSON, forced_call_grammar

Marker = Callable[[str], str]

INTEGER = r"/-?(0|[1-9][0-9]*)/"
NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?/"
RAW = r"/([^<\s]([^<]*[^<\s])?)?/"  # text a template writes as is, its parser strips


def literal(text: str) -> str:
    """A Lark string for `text`."""
    return json.dumps(text, ensure_ascii=False)


def plain(text: str) -> str:
    """A marker spelled as its text (a tokenizer whose markers are ordinary text)."""
    return literal(text)


def json_value(schema: dict[str, Any]) -> str:
    """JSON valid against `schema`, written as templates' `tojson` writes it."""
    return "%json " + json.dumps({**schema, "x-guidance": {**TEMPLATE_JSON, "lenient": True}})


def parameters(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool["function"]
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    check_schema(schema, f"tools[{index}].function.parameters")
    return closed(schema)


class CallFormat(Protocol):
    start: str
    prefix: str
    end: str
    writes_end: bool  # whether the grammar writes `end` (else the turn's end token ends it)

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str: ...

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        """Whether the format's grammar holds the calls to every keyword of the tools'
        schemas (else the call is forced as the server's bare JSON, which does)."""
        ...


def _choice(alternatives: list[str]) -> str:
    return "(" + " | ".join(alternatives) + ")"


def call_rules(calls: list[str], tail: str) -> str:
    """The grammar: one of `calls` (Lark expressions), then `tail` (markers)."""
    return f"start: {_choice(calls)} {tail}\n"


@dataclass(frozen=True)
class JsonBetweenMarkers:
    """Hermes-style (`json_tools`): {"name", "arguments"} JSON between `<tool_call>`
    markers, the call's JSON as the template's `tojson` writes it. The engine ends the
    reply after the JSON (the end-of-turn token), as it always has for this format."""

    start: str = "<tool_call>"
    prefix: str = "<tool_call>\n"
    end: str = "</tool_call>"
    writes_end: bool = False

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return True  # the arguments are the tool's whole JSON schema

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        return forced_call_grammar(tools, TEMPLATE_JSON)


@dataclass(frozen=True)
class XmlParameters:
    """Tagged parameters, one per argument, in the order the schema names them:
    qwen3_coder (`<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n`),
    minimax_m2 (`<invoke name="NAME">\\n<parameter name="P">VALUE</parameter>\\n`) and
    glm47 (`NAME<arg_key>P</arg_key><arg_value>VALUE</arg_value>`). `scalars` says how
    the template writes a number or boolean: "python" (`|string`: True) or "json"."""

    start: str
    prefix: str
    end: str
    head: str  # before the name
    name_end: str  # after it
    open_param: str  # before a parameter's name
    param_sep: str  # between its name and its value
    close_param: str  # after its value
    close: str  # after the last parameter, before `end`
    scalars: str = "json"
    writes_end: bool = True
    text: str = RAW  # a string value as the template writes it

    def opening(self, name: str) -> str:
        """What the call writes before its first parameter."""
        return self.head + name + self.name_end

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return all(plain_parameters(tool, nested=False) for tool in tools)

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        calls = []
        for i, tool in enumerate(tools):
            schema = parameters(tool, i)
            required = set(schema.get("required") or ())
            parts = []
            for name, prop in (schema.get("properties") or {}).items():
                one = (
                    f"{marker(self.open_param + name + self.param_sep)} "
                    f"{self.value(prop if isinstance(prop, dict) else {})} "
                    f"{marker(self.close_param)}"
                )
                parts.append(f"({one})" if name in required else f"({one})?")
            name = marker(self.opening(tool["function"]["name"]))
            calls.append(" ".join([name, *parts]) + f" {marker(self.close)}")
        return call_rules(calls, marker(self.end))

    def value(self, prop: dict[str, Any]) -> str:
        """How the template writes a value of `prop`: strings raw, the rest as literals."""
        choices = prop.get("enum") if "enum" in prop else None
        if "const" in prop:
            choices = [prop["const"]]
        if choices is not None and all(isinstance(c, str) for c in choices):
            return _choice([literal(c) for c in choices]) if choices else '""'
        kind = prop.get("type")
        if kind == "string":
            return self.text
        if kind == "integer":
            return INTEGER
        if kind == "number":
            return NUMBER
        if kind == "boolean":
            words = ("True", "False") if self.scalars == "python" else ("true", "false")
            return _choice([literal(w) for w in words])
        return json_value(prop)


@dataclass(frozen=True)
class KimiSections:
    """kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{JSON}<|tool_call_end|><|tool_calls_section_end|>`, the
    call's id its index, as the template writes it back."""

    start: str = "<|tool_calls_section_begin|>"
    prefix: str = "<|tool_calls_section_begin|>"
    end: str = "<|tool_calls_section_end|>"
    writes_end: bool = True

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return True  # the arguments are the tool's whole JSON schema

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        calls = []
        for i, tool in enumerate(tools):
            name = literal(f"functions.{tool['function']['name']}:0")
            calls.append(
                f"{marker('<|tool_call_begin|>')} {name} {marker('<|tool_call_argument_begin|>')} "
                f"{json_value(parameters(tool, i))} {marker('<|tool_call_end|>')}"
            )
        return call_rules(calls, marker(self.end))


_MISTRAL_CALL = re.compile(r"\s*(?:\[TOOL_CALLS\]\s*)?([\w.-]+)\[CALL_ID\]([A-Za-z0-9]+)\[ARGS\]")


@dataclass(frozen=True)
class MistralCalls:
    """mistral, where the template writes a call's id (Mistral Small 3.2 and later):
    `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{JSON}`, ID 9 alphanumerics, and the turn's end
    after the last call. mlx-lm's parser takes the id for the name there (mlx-lm 0.32;
    no upstream issue names it, the nearest is
    https://github.com/ml-explore/mlx-lm/issues/1639), so `parse` reads these calls,
    their ids with them: the client's id for a call is built on the generated one, and
    `call_history` renders it back as those characters."""

    start: str = "[TOOL_CALLS]"
    prefix: str = "[TOOL_CALLS]"
    end: str = ""
    writes_end: bool = False

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return True  # the arguments are the tool's whole JSON schema

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        calls = [
            f"{marker(tool['function']['name'] + '[CALL_ID]')} /[A-Za-z0-9]{{9}}/ "
            f"{marker('[ARGS]')} {json_value(parameters(tool, i))}"
            for i, tool in enumerate(tools)
        ]
        return call_rules(calls, "")

    def writes(self, template: Any) -> bool:
        """Whether `template` writes calls in this form (older Mistral templates write a
        JSON list after `[TOOL_CALLS]`, which stays the server's bare JSON call)."""
        return isinstance(template, str) and "[CALL_ID]" in template

    def parse(self, text: str, tools: Any = None) -> list[dict[str, Any]]:
        """The calls in `text` (after the first `[TOOL_CALLS]`), each with its `id`;
        text without `[CALL_ID]` goes to mlx-lm's parser, which reads the older forms."""
        if "[CALL_ID]" not in text:
            parsed = mistral.parse_tool_call(text, tools)
            return parsed if isinstance(parsed, list) else [parsed]
        decoder, calls, at = json.JSONDecoder(), [], 0
        while text[at:].strip():
            head = _MISTRAL_CALL.match(text, at)
            if head is None:
                raise ValueError(f"Could not parse tool call from: {text}")
            arguments, at = decoder.raw_decode(text, head.end())
            calls.append({"name": head[1], "arguments": arguments, "id": head[2]})
        return calls


@dataclass(frozen=True)
class GemmaCall:
    """gemma4: `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, the arguments in the
    template's own value syntax (`call_values.GemmaValues`: `<|"|>` strings, keys in
    `dictsort` order), as it writes the call back."""

    start: str = "<|tool_call>"
    prefix: str = "<|tool_call>"
    end: str = "<tool_call|>"
    writes_end: bool = True
    quote: str = GEMMA_QUOTE  # what a string stands between
    text: str = GEMMA_TEXT  # a string's text
    nested: bool = True  # whether the parser reads objects and lists

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return all(plain_parameters(tool, nested=self.nested) for tool in tools)

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        values = GemmaValues(marker, self.quote, self.text)
        calls = []
        for i, tool in enumerate(tools):
            head = literal(f"call:{tool['function']['name']}{{")
            calls.append(f'{head} {values.fields(parameters(tool, i))} "}}"')
        return call_rules(calls, marker(self.end)) + values.text()


@dataclass(frozen=True)
class PythonCall:
    """pythonic (LFM2.5): `<|tool_call_start|>[NAME(key=VALUE, ...)]<|tool_call_end|>`.
    Its template drops `tool_calls`; `call_history.pythonic` writes them into the turn's
    content instead, so the call is generated as that writes it: arguments in the order
    given (the schema's), each value as `json.dumps` writes it."""

    start: str = "<|tool_call_start|>"
    prefix: str = "<|tool_call_start|>"
    end: str = "<|tool_call_end|>"
    writes_end: bool = True

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return all(plain_parameters(tool, nested=True) for tool in tools)

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        rules = Rules("python")
        calls = []
        for i, tool in enumerate(tools):
            schema = parameters(tool, i)
            required = set(schema.get("required") or ())
            items = [
                (f"{literal(name + '=')} {self.value(prop)}", name in required)
                for name, prop in (schema.get("properties") or {}).items()
            ]
            head = literal(f"[{tool['function']['name']}(")
            calls.append(f'{head} {rules.listed(items, ", ")} ")]"')
        return call_rules(calls, marker(self.end)) + rules.text()

    def value(self, prop: Any) -> str:
        prop = prop if isinstance(prop, dict) else {}
        return python_scalar(prop) or json_value(prop)


QWEN3_CODER = XmlParameters(
    start="<tool_call>", prefix="<tool_call>\n", end="</tool_call>",
    head="<function=", name_end=">\n", open_param="<parameter=", param_sep=">\n",
    close_param="\n</parameter>\n", close="</function>\n", scalars="python",
)  # fmt: skip
MINIMAX_M2 = XmlParameters(
    start="<minimax:tool_call>", prefix="<minimax:tool_call>\n", end="</minimax:tool_call>",
    head='<invoke name="', name_end='">\n', open_param='<parameter name="', param_sep='">',
    close_param="</parameter>\n", close="</invoke>\n",
)  # fmt: skip
GLM47 = XmlParameters(
    start="<tool_call>", prefix="<tool_call>", end="</tool_call>",
    head="", name_end="", open_param="<arg_key>", param_sep="</arg_key><arg_value>",
    close_param="</arg_value>", close="",
)  # fmt: skip


def token_marker(tokenizer: Any) -> Marker:
    """Fixed text as the model's tokenizer holds it: each of its added tokens (`<arg_key>`,
    `<|tool_call_begin|>`) that the text holds is that one token, as the template's text
    tokenizes, and the rest is text. Only that token: a special token's bytes are no text
    a grammar can match, and an alternative of its text as well let llguidance's mask
    allow the token where its forced bytes then refused it (a failed request)."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    if not added:
        return plain
    found = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))))

    def marker(text: str) -> str:
        parts, at = [], 0
        for match in found.finditer(text):
            if match.start() > at:
                parts.append(literal(text[at : match.start()]))
            parts.append(f"<[{added[match.group()]}]>")
            at = match.end()
        if at < len(text) or not parts:
            parts.append(literal(text[at:]))
        return " ".join(parts)

    return marker


def prompt_text(
    render: Callable[[list[dict[str, Any]], bool], str],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    form: CallFormat,
) -> str | None:
    """The prompt of a forced call: the template's write-back of a turn that calls one
    of `tools` (a result after it, as the next request has), cut at the call's opening
    marker, then `form.prefix`. None where the template writes no call there (the
    caller then uses the generation prompt)."""
    name = tools[0]["function"]["name"]
    call = {"id": "call00000", "type": "function",
            "function": {"name": name, "arguments": {}}}  # fmt: skip
    turn = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00000", "name": name, "content": ""},
    ]
    try:
        head, full = render(messages, False), render([*messages, *turn], False)
    except Exception:
        return None
    shared = 0
    for a, b in zip(head, full, strict=False):
        if a != b:
            break
        shared += 1
    at = full.find(form.start, shared)
    return None if at < 0 else full[:at] + form.prefix
