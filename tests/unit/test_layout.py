"""The house stays small: no import cycles in `mlx_cache_server/`, the cache library
(`mlx_cache_server/prompt_cache/`) imports nothing above it, and no class over 250 lines
or module over 450 (read with `ast`, as the code is, not as it runs)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mlx_cache_server",)
LIBRARY = "mlx_cache_server.prompt_cache"
MAX_CLASS, MAX_MODULE = 250, 450


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


def test_the_cache_library_imports_nothing_above_it():
    known = modules()
    above = {
        name: sorted(m for m in imports(name, path, known) if not m.startswith(LIBRARY))
        for name, path in known.items()
        if name.startswith(LIBRARY)
    }
    assert {name: found for name, found in above.items() if found} == {}


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_class_or_module_past_its_bound():
    over = {}
    for path in modules().values():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE:
            over[where] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= MAX_CLASS:
                over[f"{where}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert over == {}, "split these by reason to change (as `Engine` and `EngineThread`)"
