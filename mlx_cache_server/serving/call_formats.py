"""Which call format a model writes, and the formats that vary `call_markup`'s shapes.

mlx-lm picks a model's tool parser from the markers its chat template holds (Kimi K3's
from the tokens of its vocabulary, Laguna's from its config); `call_format` picks the
format by the module of that parser (`FORMATS`). The formats here reuse `call_markup`'s
shapes with the markers of their models, where the markup is the same shape:

- function_gemma (FunctionGemma): Gemma 4's value syntax between `<start_function_call>`
  markers, strings between `<escape>` tokens. mlx-lm's parser reads flat arguments only
  and ends a call at its first `}` (mlx-lm 0.32; a fix was proposed and closed unmerged,
  https://github.com/ml-explore/mlx-lm/pull/1628): strings hold none, and tools with
  objects or lists keep the bare JSON call.
- longcat (LongCat): GLM-4.7's tagged parameters under `<longcat_...>` tags, a new line
  after the name and around each value. Its parser fails on a call with no argument
  (mlx-lm 0.32, no upstream issue found; a tool that may be called without one keeps
  the bare JSON call), and LongCat's first template wrote calls as JSON (`writes`: only
  a template that writes `<longcat_arg_key>` gets this markup).
- minicpm5 (MiniCPM5): `<function name="NAME"><param name="P">VALUE</param></function>`,
  no wrapper; its template wraps a value holding `<`, `&` or a new line in CDATA, so a
  string is generated without them.
- muse_spark (Muse Spark): each call is a message of its own, its header addressed to
  the tool (`<|start|>assistant to=NAME<|message|>`), then `<atem:function_calls>`
  markup. The header names the tool before the markup opens, so the forced call starts
  at ` to=` (the generation prompt is `<|start|>assistant`) and writes the name in both.
  Strings are written bare and the parser reads any value that is JSON as JSON: a
  string that reads as JSON is not generated.
- kimi_k3 (Kimi K3's XTML): `<|open|>call tool="NAME" index="1"<|sep|>`, one typed
  `argument` per key (`type="string"` raw text, the rest JSON).
- laguna: glm47's parser and GLM-4.7's markup (its module re-exports glm47's).

Invariants:
- Each format's grammar admits only a call its model's parser (`tool_parser`) reads back
  as generated: the tool's name and its arguments, each of its schema's type.
- The layouts follow the parsers and the published renderings of a call (FunctionGemma's
  template, Muse Glimmer's for the same ATEM markup, Kimi K3's encoder, LongCat's and
  MiniCPM5's outputs); this server has none of these templates among its fixtures, and
  one that spaces a call otherwise costs the next turn's reuse of it, not the call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .call_markup import (
    GLM47,
    MINIMAX_M2,
    QWEN3_CODER,
    RAW,
    CallFormat,
    GemmaCall,
    JsonBetweenMarkers,
    KimiSections,
    Marker,
    MistralCalls,
    PythonCall,
    XmlParameters,
    call_rules,
    json_value,
    literal,
    parameters,
    plain,
)
from .call_values import SCALARS, choice, plain_parameters

# FunctionGemma's string text: its parser ends a call at the first `}`.
FUNCTION_GEMMA_TEXT = r"/[^<}\x00]*/"
# MiniCPM5's raw text: what its template writes without a CDATA block, stripped.
MINICPM_TEXT = r"/([^<&\s]([^<&\n]*[^<&\s])?)?/"
# Kimi K3's string text: kept as written (its parser strips nothing).
XTML_TEXT = r"/[^<]*/"
# Text `json.loads` reads (Python's: NaN and Infinity too, or anything opening as an
# array, object or string), which Muse's parser would read as JSON, not as the string.
JSON_TEXT = (
    r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
    r'|true|false|null|NaN|-?Infinity|["\[{](.|\n)*/'
)
MUSE_TEXT = "MUSE_TEXT"  # the terminal of a string Muse's parser reads as one


def _names(tool: dict[str, Any], word: re.Pattern[str]) -> bool:
    """Whether the tool's name and its parameters' names are each one `word`."""
    props = (tool["function"].get("parameters") or {}).get("properties") or {}
    return all(word.fullmatch(name) for name in [tool["function"]["name"], *props])


def _string_choices(tool: dict[str, Any]) -> list[str]:
    """The strings of the tool's parameters' enums and constants."""
    props = (tool["function"].get("parameters") or {}).get("properties") or {}
    found = []
    for prop in props.values():
        found += [prop["const"]] if "const" in prop else prop.get("enum") or []
    return [c for c in found if isinstance(c, str)]


def _reads_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class FunctionGemmaCall(GemmaCall):
    """function_gemma: `<start_function_call>call:NAME{key:VALUE,...}<end_function_call>`,
    flat arguments in Gemma's syntax, strings between `<escape>` tokens."""

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        # The parser reads a name and keys of word characters, and a call up to its first
        # `}`: an enum string holding one (or a `<`) cannot be written.
        return super().supports(tools) and all(
            _names(tool, re.compile(r"\w+"))
            and not any(set(c) & set("}<") for c in _string_choices(tool))
            for tool in tools
        )


@dataclass(frozen=True)
class LongcatParameters(XmlParameters):
    """longcat: GLM-4.7's shape, a call holding at least one argument."""

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        # Its parser finds the name before the first argument, so a call without one
        # is no call: each tool must have an argument the schema requires.
        return super().supports(tools) and all(
            (tool["function"].get("parameters") or {}).get("required") for tool in tools
        )

    def writes(self, template: Any) -> bool:
        """Whether `template` writes tagged arguments (LongCat-Flash-Chat's wrote JSON
        between the markers, which stays the server's bare JSON call)."""
        return isinstance(template, str) and "<longcat_arg_key>" in template


@dataclass(frozen=True)
class AtemParameters(XmlParameters):
    """muse_spark: a call message `NAME<|message|><atem:function_calls>` after the
    header's ` to=`, then the invoke of NAME with one tagged parameter per argument."""

    def opening(self, name: str) -> str:
        return f'{name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n'

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        # An enum string written bare that reads as JSON would come back as that JSON.
        return all(
            plain_parameters(tool, nested=True)
            and not any(_reads_as_json(c) for c in _string_choices(tool))
            for tool in tools
        )

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        return super().grammar(tools, marker) + f"{MUSE_TEXT}: {RAW} & ~{JSON_TEXT}\n"


def _attribute(text: str) -> str:
    """An attribute's value as XTML escapes it (its parser unescapes the two)."""
    return text.replace("&", "&amp;").replace('"', "&quot;")


@dataclass(frozen=True)
class KimiXtml:
    """kimi_k3: `<|open|>tools<|sep|>`, then `<|open|>call tool="NAME" index="1"<|sep|>`,
    one `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>` per
    argument (T the value's JSON type, as the encoder writes it), `<|close|>call<|sep|>`
    and `<|close|>tools<|sep|>`."""

    start: str = "<|open|>tools<|sep|>"
    prefix: str = "<|open|>tools<|sep|>"
    end: str = "<|close|>tools<|sep|>"
    writes_end: bool = True

    def supports(self, tools: list[dict[str, Any]]) -> bool:
        return all(plain_parameters(tool, nested=True) for tool in tools)

    def grammar(self, tools: list[dict[str, Any]], marker: Marker = plain) -> str:
        calls = []
        for i, tool in enumerate(tools):
            schema = parameters(tool, i)
            required = set(schema.get("required") or ())
            name = _attribute(tool["function"]["name"])
            parts = [marker(f'<|open|>call tool="{name}" index="1"<|sep|>')]
            for key, prop in (schema.get("properties") or {}).items():
                kind, value = self.value(prop)
                head = f'<|open|>argument key="{_attribute(key)}" type="{kind}"<|sep|>'
                one = f"{marker(head)} {value} {marker('<|close|>argument<|sep|>')}"
                parts.append(f"({one})" if key in required else f"({one})?")
            calls.append(" ".join([*parts, marker("<|close|>call<|sep|>")]))
        return call_rules(calls, marker(self.end))

    def value(self, prop: dict[str, Any]) -> tuple[str, str]:
        """The `type` written for a value of `prop`, and the value's Lark."""
        choices = [prop["const"]] if "const" in prop else prop.get("enum")
        if choices is not None:  # strings only (`supports`)
            return "string", choice([literal(c) for c in choices])
        kind = prop.get("type")
        if kind == "string":
            return "string", XTML_TEXT
        if kind in ("integer", "number"):
            return "number", SCALARS[kind]
        if kind == "boolean":
            return "boolean", SCALARS[kind]
        return str(kind), json_value(prop)  # an object or a list, as JSON


FUNCTION_GEMMA = FunctionGemmaCall(
    start="<start_function_call>", prefix="<start_function_call>", end="<end_function_call>",
    quote="<escape>", text=FUNCTION_GEMMA_TEXT, nested=False,
)  # fmt: skip
LONGCAT = LongcatParameters(
    start="<longcat_tool_call>", prefix="<longcat_tool_call>", end="</longcat_tool_call>",
    head="", name_end="\n", open_param="<longcat_arg_key>",
    param_sep="</longcat_arg_key>\n<longcat_arg_value>", close_param="</longcat_arg_value>\n",
    close="",
)  # fmt: skip
MINICPM5 = XmlParameters(
    start="<function name=", prefix="<function name=", end="</function>",
    head='"', name_end='">', open_param='<param name="', param_sep='">',
    close_param="</param>", close="", text=MINICPM_TEXT,
)  # fmt: skip
MUSE_SPARK = AtemParameters(
    start=" to=", prefix=" to=", end="</atem:function_calls>",
    head="", name_end="", open_param='<atem:parameter name="', param_sep='">',
    close_param="</atem:parameter>\n", close="</atem:invoke>\n", text=MUSE_TEXT,
)  # fmt: skip

# mlx-lm's parser module -> the format its model writes calls in. A parser not here
# keeps the server's bare JSON call.
FORMATS: dict[str, CallFormat] = {
    "json_tools": JsonBetweenMarkers(),
    "qwen3_coder": QWEN3_CODER,
    "minimax_m2": MINIMAX_M2,
    "glm47": GLM47,
    # Laguna's module re-exports glm47's parser, so it is found as glm47; listed for a
    # release that gives it its own.
    "laguna": GLM47,
    "kimi_k2": KimiSections(),
    "kimi_k3": KimiXtml(),
    "mistral": MistralCalls(),
    "gemma4": GemmaCall(),
    "function_gemma": FUNCTION_GEMMA,
    "longcat": LONGCAT,
    "minicpm5": MINICPM5,
    "muse_spark": MUSE_SPARK,
    "pythonic": PythonCall(),
}


def call_format(tokenizer: Any) -> CallFormat | None:
    """The format of the model's tool calls, by the parser mlx-lm picked for it (None
    where its template writes calls in another form that parser reads: `writes`)."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    form = FORMATS.get(module.rsplit(".", 1)[-1]) if module else None
    writes = getattr(form, "writes", None)
    if writes is not None and not writes(getattr(tokenizer, "chat_template", None)):
        return None
    return form


def tool_parser(tokenizer: Any) -> Callable[[str, Any], Any]:
    """What reads the model's calls: its format's own reader where mlx-lm's misreads the
    markup (`MistralCalls.parse`), else mlx-lm's parser."""
    return getattr(call_format(tokenizer), "parse", None) or tokenizer.tool_parser
