"""What `Settings` declares, as `serve`'s flags and as the reference in docs/configuration.md.

Both are generated from the settings' forms, `Flag`s, defaults and descriptions, so that a
setting is declared once. Rewrite the reference after changing a setting with
`python -m mlx_cache_server.setting_flags` (tests/unit/test_settings_reference.py fails
until then).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic.fields import FieldInfo

from .setting_types import Flag, Form
from .settings import ENV_PREFIX, Settings

BEGIN = (
    "<!-- The settings reference, generated from mlx_cache_server/settings.py: change it "
    "there and run `python -m mlx_cache_server.setting_flags`. -->"
)
END = "<!-- End of the settings reference. -->"
DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


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


def reference() -> str:
    """The settings reference: every setting, its flags, default and description."""
    intro = (
        "Every setting is a key of the `--config` file and an environment variable, "
        f"`{ENV_PREFIX}` and its name in capitals (`{ENV_PREFIX}PORT=9000`); those with a "
        "flag are set on the command line too. A size is a number of bytes or text such as "
        "`512MiB`, `2GB` or `1.5g`. In the environment a list is separated by commas, a "
        "switch is on for `1`, `true` or `yes` (off for anything else), and a table is a "
        "JSON object."
    )
    lines = [
        textwrap.fill(intro, width=100),
        "",
        "| Setting | Flag | Default | Description |",
        "|---|---|---|---|",
    ]
    for name, info in Settings.model_fields.items():
        flags = ", ".join(
            f"`{o.name}`" + (" (repeatable)" if o.action == "append" else "")
            for o in options(name, info)
        )
        cells = [f"`{name}`", flags or "", _default(info), info.description or ""]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def with_reference(doc: str) -> str:
    """`doc` with the text between its reference markers generated anew."""
    head, begin, rest = doc.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the reference's markers are missing: {BEGIN} ... {END}")
    return f"{head}{BEGIN}\n\n{reference()}\n\n{END}{tail}"


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


def _default(info: FieldInfo) -> str:
    if info.default is None:
        return "unset"
    if info.default in ([], {}):
        return "none"
    return f"`{_form(info).show(info.default)}`"


def main(argv: list[str]) -> int:
    """Rewrite the reference in the file named (default: docs/configuration.md)."""
    path = Path(argv[0]) if argv else DOC
    path.write_text(with_reference(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
