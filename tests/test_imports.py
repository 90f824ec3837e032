"""The package has no import cycle, imports inside functions counted: layering is a property the tests keep."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "taps_ray"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def imported_modules(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Every taps_ray module that module `name` imports anywhere in `source` (module, function or class level)."""
    found = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {
        name: imported_modules(path.read_text(), name, path.name == "__init__.py", known) - {"taps_ray"}
        for name, path in files.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and any(graph.values()), "the scan found no modules or no imports: the test is blind"
    assert cycles(graph) == []


def test_cycle_finder_sees_a_late_import_cycle():
    known = {"taps_ray.a", "taps_ray.b", "taps_ray.c"}
    late = "import os\n\ndef f():\n    from taps_ray.b import thing\n"
    relative = "from .a import x\n"
    graph = {
        "taps_ray.a": imported_modules(late, "taps_ray.a", False, known),
        "taps_ray.b": imported_modules(relative, "taps_ray.b", False, known),
        "taps_ray.c": imported_modules("import taps_ray.a\n", "taps_ray.c", False, known),
    }
    assert graph == {"taps_ray.a": {"taps_ray.b"}, "taps_ray.b": {"taps_ray.a"}, "taps_ray.c": {"taps_ray.a"}}
    assert cycles(graph) == [["taps_ray.a", "taps_ray.b"]]
