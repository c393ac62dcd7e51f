"""Which call format a model writes: `call_format` picks it by the module of the tool
parser mlx-lm picked for the model (`FORMATS`), from the markers its chat template holds.

Invariants:
- Each format's grammar admits only a call its model's parser (`tool_parser`) reads back
  as generated: the tool's name and its arguments, each of its schema's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .call_markup import (
    GLM47,
    MINIMAX_M2,
    QWEN3_CODER,
    CallFormat,
    GemmaCall,
    JsonBetweenMarkers,
    KimiSections,
    MistralCalls,
    PythonCall,
)

# mlx-lm's parser module -> the format its model writes calls in. A parser not here
# (function_gemma, ...) keeps the server's bare JSON call.
FORMATS: dict[str, CallFormat] = {
    "json_tools": JsonBetweenMarkers(),
    "qwen3_coder": QWEN3_CODER,
    "minimax_m2": MINIMAX_M2,
    "glm47": GLM47,
    "kimi_k2": KimiSections(),
    "mistral": MistralCalls(),
    "gemma4": GemmaCall(),
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
