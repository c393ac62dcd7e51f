"""The house stays small: no import cycles in `mlx_cache_server/`, the cache library
(`mlx_cache_server/prompt_cache/`) imports nothing above it but the seam to mlx-lm
(`mlx_cache_server/mlx_adapter/`, which imports nothing of ours), no module over 450
lines, in the packages of `COMPOSED` no class reads or calls an attribute it does not
define or receive (composition, not mixins), and (test_layout_seam.py) outside the seam
nothing reaches into a third party's internals (read with `ast`, as the code is, not as
it runs)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mlx_cache_server",)
LIBRARY = "mlx_cache_server.prompt_cache"
ADAPTER = "mlx_cache_server.mlx_adapter"  # the seam to mlx-lm's and MLX's internals
MAX_MODULE = 450
# The packages held to "a class owns what it uses" (no mixins): all of them.
COMPOSED = ("mlx_cache_server",)


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports, type-checking imports included: a cycle
    only a type checker sees is still two modules that each need the other."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            submodules = {f"{base}.{a.name}" for a in node.names} & known.keys()
            found |= submodules
            if len(submodules) < len(node.names):  # names defined in `base` itself
                found.add(base)
    return (found & known.keys()) - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def reaching_out(graph: dict[str, set[str]], package: str, allowed: tuple[str, ...]) -> dict:
    """For each module of `package`, the modules it imports outside `package` and
    `allowed` (packages, by name prefix); only modules that import some."""
    inside = (package, *allowed)
    out = {name: sorted(m for m in found if not m.startswith(inside))
           for name, found in graph.items() if name.startswith(package)}  # fmt: skip
    return {name: found for name, found in out.items() if found}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_cache_library_imports_nothing_above_it_but_the_seam():
    assert reaching_out(import_graph(), LIBRARY, (ADAPTER,)) == {}


def test_the_seam_imports_nothing_else_of_ours():
    assert reaching_out(import_graph(), ADAPTER, ()) == {}


def test_the_import_checks_let_the_library_use_the_seam_and_nothing_else():
    graph = {
        f"{LIBRARY}.a": {f"{ADAPTER}.windows", f"{LIBRARY}.b"},
        f"{LIBRARY}.b": {"mlx_cache_server.engine.x"},
        f"{ADAPTER}.windows": {f"{LIBRARY}.b"},
    }
    assert reaching_out(graph, LIBRARY, (ADAPTER,)) == {
        f"{LIBRARY}.b": ["mlx_cache_server.engine.x"]
    }
    assert reaching_out(graph, ADAPTER, ()) == {f"{ADAPTER}.windows": [f"{LIBRARY}.b"]}


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_past_its_bound():
    over = {}
    for path in modules().values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE:
            over[str(path.relative_to(ROOT))] = lines
    assert over == {}, "split these by reason to change (as `Engine` and `EngineThread`)"


# ---------------------------------------------------------------- composition, not mixins

# Classes whose bare class-level annotations are fields, not a mixin's claim on a sibling's
# state; recognized by decorator or base, and inherited.
DATA_DECORATORS = {"dataclass"}
DATA_BASES = {"NamedTuple", "TypedDict", "Protocol", "BaseModel"}
NEUTRAL_BASES = {"object", "Generic"}  # bases that bring no attributes a class could lean on


def terminal_name(node: ast.AST) -> str | None:
    """`x` of `x`, `a.b.x`, `x[...]` and `x(...)`."""
    while isinstance(node, ast.Subscript | ast.Call):
        node = node.value if isinstance(node, ast.Subscript) else node.func
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


class Classes:
    """Every class of a set of parsed modules, with its bases resolved through the imports:
    to a class of the set, to nothing (`NEUTRAL_BASES`), or to something outside (None)."""

    def __init__(self, parsed: dict[str, ast.Module], packages: frozenset[str] = frozenset()):
        self.parsed = parsed
        self.packages = packages  # modules that are packages: relative imports start in them
        self.names = {module: self._names(module, tree) for module, tree in parsed.items()}
        self.defs = {(m, node.name): node for m, tree in parsed.items()
                     for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}  # fmt: skip

    def _names(self, module: str, tree: ast.Module) -> dict[str, tuple]:
        """What a module's top-level names stand for: ("class", module, name),
        ("module", module) or ("from", module, name), an import yet to follow."""
        package = module if module in self.packages else module.rpartition(".")[0]
        out: dict[str, tuple] = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = ("class", module, node.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for a in node.names:
                    out[a.asname or a.name] = ("from", base, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.split(".")[0]
                    out[local] = ("module", a.name if a.asname else local)
        return out

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple | None:
        """What `name` stands for in `module`, imports followed (re-exports too)."""
        if f"{module}.{name}" in self.parsed:
            return ("module", f"{module}.{name}")
        ref = self.names.get(module, {}).get(name)
        if ref is None or depth > 20:
            return None
        if ref[0] == "from":
            return self.lookup(ref[1], ref[2], depth + 1)
        return ref

    def resolve(self, module: str, node: ast.AST) -> tuple | None:
        """What a base expression names: ("class", module, name), ("module", module),
        ("neutral",), or None for something outside the set."""
        if terminal_name(node) in NEUTRAL_BASES:
            return ("neutral",)
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Name):
            return self.lookup(module, node.id)
        if isinstance(node, ast.Attribute):
            outer = self.resolve(module, node.value)
            if outer is not None and outer[0] == "module":
                return self.lookup(outer[1], node.attr)
        return None

    def of(self, ref: tuple) -> tuple[str, ast.ClassDef]:
        """The module and definition of a ("class", module, name) reference."""
        return ref[1], self.defs[ref[1], ref[2]]

    def bases(self, module: str, cls: ast.ClassDef) -> list[tuple | None]:
        return [self.resolve(module, b) for b in cls.bases]

    def lineage(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]] | None:
        """The class and its bases up the hierarchy, or None when one comes from outside."""
        out, todo = [], [(module, cls)]
        while todo:
            m, c = todo.pop()
            out.append((m, c))
            for ref in self.bases(m, c):
                if ref is None or ref[0] == "module":
                    return None
                if ref[0] == "class":
                    todo.append(self.of(ref))
        return out

    def is_data(self, module: str, cls: ast.ClassDef) -> bool:
        """A dataclass, NamedTuple, TypedDict, Protocol or pydantic model, or made from one."""
        if any(terminal_name(d) in DATA_DECORATORS for d in cls.decorator_list):
            return True
        for base, ref in zip(cls.bases, self.bases(module, cls), strict=True):
            if terminal_name(base) in DATA_BASES:
                return True
            if ref is not None and ref[0] == "class" and self.is_data(*self.of(ref)):
                return True
        return False


def self_name(method: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The name a method calls its instance (or class) by; None for a static method."""
    if any(terminal_name(d) == "staticmethod" for d in method.decorator_list):
        return None
    args = [*method.args.posonlyargs, *method.args.args]
    return args[0].arg if args else None


def self_attributes(method: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.Attribute]:
    """`self.NAME` in a method, nested functions and lambdas included (their `self` is the
    method's), nested classes not (theirs is their own)."""
    name = self_name(method)
    stack: list[ast.AST] = list(method.body)
    while stack and name is not None:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == name:
                yield node
        stack.extend(ast.iter_child_nodes(node))


def defined(classes: Classes, module: str, cls: ast.ClassDef) -> set[str]:
    """What a class defines itself: methods and properties, class attributes with a value
    (fields too, in a data class), and whatever a method assigns to `self.NAME`."""
    data = classes.is_data(module, cls)
    out = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            out |= {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.value is not None or data:
                out.add(stmt.target.id)
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            out |= {a.attr for a in self_attributes(stmt) if isinstance(a.ctx, ast.Store)}
    return out


def borrowed(classes: Classes, covered: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """In the classes of the `covered` packages: the bare class-level annotations outside
    data classes (a mixin declaring a sibling's state), and each `self.NAME` read or
    called that neither the class nor a base of the project defines."""
    bare, undefined = [], []
    for (module, _), cls in sorted(classes.defs.items(), key=lambda kv: kv[0]):
        if not any(module == p or module.startswith(p + ".") for p in covered):
            continue
        where = f"{module}:{cls.name}"
        if not classes.is_data(module, cls):
            bare += [f"{where}.{s.target.id}" for s in cls.body if isinstance(s, ast.AnnAssign)
                     and s.value is None and isinstance(s.target, ast.Name)]  # fmt: skip
        lineage = classes.lineage(module, cls)
        if lineage is None:
            continue  # a base from outside (mlx-lm's, uvicorn's) defines what we cannot see
        own = set().union(*(defined(classes, m, c) for m, c in lineage))
        used = {a.attr for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)
                for a in self_attributes(s) if not isinstance(a.ctx, ast.Store)}  # fmt: skip
        undefined += [f"{where}.{name}" for name in sorted(used - own)
                      if not (name.startswith("__") and name.endswith("__"))]  # fmt: skip
    return bare, undefined


def project_classes() -> Classes:
    known = modules()
    packages = frozenset(n for n, p in known.items() if p.name == "__init__.py")
    return Classes({n: ast.parse(p.read_text()) for n, p in known.items()}, packages)


def test_no_class_leans_on_state_it_does_not_own():
    bare, undefined = borrowed(project_classes(), COMPOSED)
    assert bare == [], "a mixin's claim on a sibling's state: hand the state to the class"
    assert undefined == [], "pass these in (constructor or method arguments) or define them"


MIXIN = """
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar
from outside import Base
T = TypeVar("T")

class Part:
    _lock: object
    def f(self):
        with self._lock:
            return self.g() + self.h

class Whole(Part):
    h = 1
    def __init__(self):
        self._lock = None
    def g(self):
        return len(self.__dict__)

@dataclass
class Point:
    x: int
    def norm(self):
        return self.x

class Pair(NamedTuple):
    a: int

class Kept(Generic[T]):
    def __init__(self):
        self.items = []
    def last(self):
        return self.items[-1]

class Foreign(Base):
    def f(self):
        return self.anything
"""


def test_the_ownership_check_finds_a_mixin():
    parsed = {"pkg": ast.parse(""), "pkg.mod": ast.parse(MIXIN)}
    bare, undefined = borrowed(Classes(parsed, frozenset({"pkg"})), ("pkg",))
    assert bare == ["pkg.mod:Part._lock"]
    assert undefined == ["pkg.mod:Part._lock", "pkg.mod:Part.g", "pkg.mod:Part.h"]
