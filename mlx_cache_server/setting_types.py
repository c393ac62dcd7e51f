"""The forms a setting's value takes, and the flags that set it from the command line.

A setting in `Settings` is annotated with one of the forms below (`Count`, `Real`, `Size`,
`Switch`, `AutoSwitch`, `Text`, `Names`, `Table`, `Tables`) and with its `Flag`s, if the
command line sets it. Each form reads a value from any source (the TOML file's typed values,
an environment variable's text, a flag's text or parsed number) as the server has always
read it: a form's validator runs before pydantic's own check, which then only confirms the
type. A validator raises ValueError alone: pydantic passes other exceptions through unnamed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '2GB', '1.5g' or a plain number."""
    if isinstance(text, bool):  # an int to Python: TOML's `true` would pass as 1 byte
        raise ValueError(f"not a size: {str(text).lower()} (try 512MiB or 2GB)")
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_text(n: int) -> str:
    """A byte count as parse_size reads it back: the largest binary unit that divides it."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass(frozen=True)
class Form:
    """How a value of this form is read from a flag and shown in the reference.

    `argtype`: argparse's `type` for the flag (None: its text as given, read by the form's
    validator with the other sources' values); `show`: a value as its --help text says it."""

    argtype: Callable[[str], Any] | None = None
    show: Callable[[Any], str] = str


@dataclass(frozen=True)
class Flag:
    """A command-line flag of the setting it annotates.

    Left unnamed, it is the setting's name in kebab case (`--cache-dir`), `--no-` and that
    for a switch that is on by default (`--no-ui`); a switch's flag sets the other value,
    a list's flag is repeatable, and any other flag takes a value. `action` (argparse's:
    "append", "store_true", "store_false") and `help` (default: the setting's
    description) say otherwise, for a flag spelled otherwise than its setting."""

    name: str | None = None
    action: str | None = None
    help: str | None = None


def _named_errors(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`read`, its TypeErrors (float([1])) raised as ValueErrors, which pydantic names."""

    @wraps(read)
    def reading(value: Any) -> Any:
        try:
            return read(value)
        except TypeError as e:
            raise ValueError(str(e)) from None

    return reading


def _number(kind: type) -> Callable[[Any], Any]:
    @_named_errors
    def read(value: Any) -> Any:
        if isinstance(value, bool):  # float(True) is 1.0: a typo would pass as 1
            raise ValueError(f"expected a number, not {str(value).lower()}")
        return kind(value)

    return read


@_named_errors
def _switch(value: Any) -> bool:
    # An environment variable's text: on for 1, true or yes, whatever the case; else off.
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@_named_errors
@_named_errors
def _auto_switch(value: Any) -> str:
    # Any case, as a switch's text is read; the type then checks it is one of the three.
    return str(value).strip().lower()


@_named_errors
def _names(value: Any) -> list[str]:
    # A list, or text separated by commas (an environment variable's); blanks dropped.
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(v).strip() for v in items if str(v).strip()]


def _table(value: Any) -> dict[str, Any]:
    try:  # an environment variable's text: a JSON object
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError("expected a table (a JSON object)")
    return value


def _tables(value: Any) -> list[Any]:
    # Each table is checked by models/specs.py, which names it by its place in the file.
    if not isinstance(value, list):
        raise ValueError("expected [[models]] tables in the settings file")
    return value


def _switch_text(value: bool) -> str:
    return str(value).lower()


Count = Annotated[int, BeforeValidator(_number(int)), Form(int)]
Real = Annotated[float, BeforeValidator(_number(float)), Form(float, show="{:g}".format)]
Size = Annotated[int, BeforeValidator(parse_size), Form(show=size_text)]  # bytes
Switch = Annotated[bool, BeforeValidator(_switch), Form(show=_switch_text)]
# A switch whose default the server decides from what it serves ("auto").
AutoSwitch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_auto_switch), Form()]
Text = Annotated[str, BeforeValidator(str), Form()]
Names = Annotated[list[str], BeforeValidator(_names), Form()]
Table = Annotated[dict[str, Any], BeforeValidator(_table), Form()]
Tables = Annotated[list[Any], BeforeValidator(_tables), Form()]
