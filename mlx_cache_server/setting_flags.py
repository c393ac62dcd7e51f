"""What `Settings` declares, as `serve`'s flags: generated from the settings' forms,
`Flag`s, defaults and descriptions, so that a setting is declared once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, get_args, get_origin

from pydantic.fields import FieldInfo

from .setting_types import Flag, Form
from .settings import Settings


@dataclass(frozen=True)
class Option:
    """A `Flag` resolved: its spelling, argparse's action (None: it takes a value, read
    with `argtype`, None: as text) and its --help text."""

    name: str
    action: str | None
    argtype: Any
    help: str


def options(name: str, info: FieldInfo) -> list[Option]:
    """The flags of setting `name`, in the order --help lists them."""
    form = _form(info)
    out = []
    for flag in (m for m in info.metadata if isinstance(m, Flag)):
        action = flag.action or _action(info)
        spelled = name.replace("_", "-")
        default_name = f"--no-{spelled}" if action == "store_false" else f"--{spelled}"
        help_text = flag.help or info.description or ""
        if action is None and info.default is not None:
            help_text += f" (default: {form.show(info.default)})"
        out.append(Option(flag.name or default_name, action, form.argtype, help_text))
    return out


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """Every setting's flags. Each leaves None where it is not given, so that the sources
    under the command line (`load_settings`) show through."""
    for name, info in Settings.model_fields.items():
        for option in options(name, info):
            kwargs: dict[str, Any] = {"dest": name, "default": None}
            if option.action is not None:
                kwargs["action"] = option.action
            elif option.argtype is not None:
                kwargs["type"] = option.argtype
            parser.add_argument(option.name, help=option.help.replace("%", "%%"), **kwargs)


def _form(info: FieldInfo) -> Form:
    """The setting's form, annotated on it or, for an optional one, on its type."""
    found = [m for m in info.metadata if isinstance(m, Form)]
    for arg in get_args(info.annotation):  # X | None: the metadata of X
        found += [m for m in getattr(arg, "__metadata__", ()) if isinstance(m, Form)]
    return found[0]


def _action(info: FieldInfo) -> str | None:
    if info.annotation is bool:  # a switch's flag sets the value it does not have
        return "store_false" if info.default else "store_true"
    if get_origin(info.annotation) is list:
        return "append"
    return None
