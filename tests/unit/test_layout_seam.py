"""The one seam to mlx-lm (`mlx_cache_server/mlx_adapter/`): outside it, nothing of ours
imports a private name of mlx's or mlx-lm's, reads or sets `x._name` that our code
defines nowhere (a third party's private attribute), assigns `__class__`, or sets or
deletes an attribute of a third party's module (`mod.f = ...`, `setattr(mod, ...)`). Read
with `ast`, as the code is; the import rules of the seam are test_layout.py's."""

from __future__ import annotations

import ast

from tests.unit.test_layout import ADAPTER, PACKAGES, modules, terminal_name

THIRD_PARTY_PRIVATE = ("mlx", "mlx_lm")  # whose private modules and names no import names
# Standard-library names with a leading underscore that are public API.
PUBLIC_UNDERSCORED = {"_exit", "_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_names(trees: list[ast.Module]) -> set[str]:
    """The names our code defines: functions and classes, module-level and class-level
    names, and whatever a method assigns to `self.NAME` or `cls.NAME`."""
    out = set()
    for tree in trees:
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for stmt in body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])  # fmt: skip
                out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    out.add(node.attr)
    return out


def module_names(tree: ast.Module, is_module) -> set[str]:
    """The names a module binds to modules: `import a.b [as c]`, `from a import b` where
    `is_module("a.b")`, and `x = importlib.import_module(...)` or `x = sys.modules...`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names
                    if a.name.split(".")[0] not in PACKAGES}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {a.asname or a.name for a in node.names if is_module(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Assign) and loads_a_module(node.value):
            out |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def loads_a_module(value: ast.AST) -> bool:
    """`importlib.import_module(...)`, `sys.modules[...]` or `sys.modules.get(...)`."""
    if isinstance(value, ast.Call) and terminal_name(value.func) == "import_module":
        return True
    while isinstance(value, ast.Call | ast.Subscript | ast.Attribute) and not (
        isinstance(value, ast.Attribute) and value.attr == "modules"
    ):
        value = value.func if isinstance(value, ast.Call) else value.value
    return isinstance(value, ast.Attribute) and terminal_name(value.value) == "sys"


def reaches_in(tree: ast.Module, own: set[str], is_module) -> list[str]:
    """What a module outside the seam does that only the seam may: import a private name
    of mlx's or mlx-lm's, read or set `x._name` that our code defines nowhere, assign
    `__class__`, or set or delete an attribute of an imported module."""
    modules_here = module_names(tree, is_module)
    out = []
    for node in ast.walk(tree):
        at = f"line {getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top in THIRD_PARTY_PRIVATE:
                parts = [*node.module.split("."), *(a.name for a in node.names)]
                out += [f"{at}: imports {node.module}.{p}" for p in parts if private(p)]
        elif isinstance(node, ast.Attribute):
            if private(node.attr) and node.attr not in own | PUBLIC_UNDERSCORED:
                out.append(f"{at}: reaches into ._{node.attr.lstrip('_')}")
            if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                out.append(f"{at}: assigns __class__")
            elif not isinstance(node.ctx, ast.Load) and a_module(
                node.value, modules_here, is_module
            ):
                out.append(f"{at}: replaces {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and terminal_name(node.func) in ("setattr", "delattr"):
            if node.args and a_module(node.args[0], modules_here, is_module):
                out.append(f"{at}: {terminal_name(node.func)} on {ast.unparse(node.args[0])}")
    return sorted(out, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def a_module(node: ast.AST, modules_here: set[str], is_module) -> bool:
    """Whether an expression names an imported module: a name bound to one, or a dotted
    path from one that is a module itself (`mlx_lm.generate` after `import mlx_lm`)."""
    if isinstance(node, ast.Name):
        return node.id in modules_here
    if loads_a_module(node):
        return True
    root = node
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in modules_here and is_module(ast.unparse(node))


def is_third_party_module(name: str) -> bool:
    """Whether `name` is a module (not a function or class) outside our package."""
    import importlib.util

    if name.split(".")[0] in PACKAGES:
        return False  # ours: setting a flag of our own module is not reaching into theirs
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def test_nothing_outside_the_seam_reaches_into_a_third_partys_internals():
    known = modules()
    outside = {n: p for n, p in known.items() if not n.startswith(ADAPTER)}
    trees = {n: ast.parse(p.read_text()) for n, p in outside.items()}
    own = own_names(list(trees.values()))
    found = {n: reaches_in(t, own, is_third_party_module) for n, t in trees.items()}
    assert {n: f for n, f in found.items() if f} == {}, (
        "move these into mlx_cache_server/mlx_adapter"
    )


PLANTED = """
import importlib
import mlx_lm.generate
import os
import sys
from mlx_lm.utils import _download
from mlx_lm import generate as gen_module

class Ours:
    def __init__(self):
        self._mine = 1
    def f(self, batch, cache):
        batch._next_tokens = None
        cache.__class__ = Ours
        mlx_lm.generate.mx = None
        setattr(gen_module, "x", 1)
        os._exit(0)
        loaded = importlib.import_module("mlx_lm.models.llama")
        loaded.swiglu = None
        setattr(sys.modules.get("mlx_lm.models.base"), "f", None)
        return self._mine + batch.tokens
"""


def test_the_seam_check_finds_a_planted_reach():
    tree = ast.parse(PLANTED)
    found = reaches_in(tree, own_names([tree]), lambda name: name == "mlx_lm.generate")
    assert found == [
        "line 6: imports mlx_lm.utils._download",
        "line 13: reaches into ._next_tokens",
        "line 14: assigns __class__",
        "line 15: replaces mlx_lm.generate.mx",
        "line 16: setattr on gen_module",
        "line 19: replaces loaded.swiglu",
        "line 20: setattr on sys.modules.get('mlx_lm.models.base')",
    ]
