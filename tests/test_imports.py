"""The package has no import cycle, imports inside functions counted; imports point down the layers of the README
layout; few imports hide inside functions, each saying why: layering is a property the tests keep."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "taps_ray"


# The layers, lowest first (README "Layout"): a module imports its own package and packages of LOWER rows only, so
# models and config import no drafting, study, serve or bench; drafting imports no decoding, eval, study or serve;
# serve and study, and study and bench, do not import each other; nothing but cli imports bench.
LAYERS = (
    ("config", "fsio", "relpaths", "machine", "syncs", "spelling", "compute_thread"),
    ("workdir", "ray_runtime", "ray_requests", "cluster_file", "markdown"),
    ("data", "models"),
    ("drafting", "training"),
    ("decoding",),
    ("eval", "plan", "adapt"),
    ("report", "serve"),
    ("interop",),
    ("study", "bench"),
    ("cli",),
)
RANK = {part: row for row, parts in enumerate(LAYERS) for part in parts}
# The directions the layout promises (issue #27), spelled out so that a reordered LAYERS cannot loosen them
# unnoticed: importer -> the packages it must never import.
FORBIDDEN = {p: {"bench"} for p in RANK if p not in ("bench", "cli")}  # only cli (and benchmarks/) run the bench
FORBIDDEN["models"] |= {"study", "serve"}
FORBIDDEN["config"] |= {"study", "serve"}
FORBIDDEN["drafting"] |= {"decoding", "eval", "study", "serve"}
# Function-level imports of the package's own modules: only where a heavy dependency (torch, transformers, Ray,
# matplotlib) must stay out of a light import path, each with a `# late: <why>` comment on its line.
MAX_LATE_IMPORTS = 25
LATE_REASON = "# late: "


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


def part(module: str) -> str:
    """The row name of a module: its top package under taps_ray (`drafting`) or its own name (`cli`)."""
    return module.split(".")[1]


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module of the same or a higher row in another package."""
    return sorted(f"{name} imports {target}: {part(name)} (row {RANK[part(name)]}) may import rows below it only"
                  for name, targets in graph.items() for target in targets
                  if part(target) != part(name) and RANK[part(target)] >= RANK[part(name)])


def test_every_package_has_a_layer():
    assert {part(name) for name in import_graph() if name != "taps_ray"} == set(RANK)


def test_imports_point_down_the_layers():
    graph = import_graph()
    assert any(RANK[part(t)] < RANK[part(n)] for n, ts in graph.items() for t in ts), "no cross-layer import seen"
    assert wrong_way(graph) == []


def forbidden(graph: dict[str, set[str]]) -> list[str]:
    """Every import that `FORBIDDEN` rules out."""
    return sorted(f"{name} imports {target}" for name, targets in graph.items() for target in targets
                  if part(target) in FORBIDDEN.get(part(name), set()))


def test_the_promised_directions_hold_and_the_layers_imply_them():
    assert forbidden(import_graph()) == []
    loose = sorted(f"{a} -> {b}" for a, targets in FORBIDDEN.items() for b in targets if RANK[b] < RANK[a])
    assert loose == [], f"LAYERS lets these import what FORBIDDEN rules out: {loose}"
    graph = {"taps_ray.models.target": {"taps_ray.serve.app"}, "taps_ray.drafting.tree": {"taps_ray.eval.cell"},
             "taps_ray.report.build": {"taps_ray.bench.run"}, "taps_ray.cli": {"taps_ray.bench.run"}}
    assert forbidden(graph) == ["taps_ray.drafting.tree imports taps_ray.eval.cell",
                                "taps_ray.models.target imports taps_ray.serve.app",
                                "taps_ray.report.build imports taps_ray.bench.run"]


def test_a_wrong_way_import_is_reported():
    graph = {
        "taps_ray.drafting.cost": {"taps_ray.decoding.generate", "taps_ray.drafting.tree"},  # up one row
        "taps_ray.serve.app": {"taps_ray.study.sweep"},  # up one row
        "taps_ray.study.sweep": {"taps_ray.bench.run"},  # the same row, another package
        "taps_ray.cli": {"taps_ray.bench.run", "taps_ray.config"},  # down: fine
    }
    assert [line.split(":")[0] for line in wrong_way(graph)] == [
        "taps_ray.drafting.cost imports taps_ray.decoding.generate",
        "taps_ray.serve.app imports taps_ray.study.sweep",
        "taps_ray.study.sweep imports taps_ray.bench.run",
    ]


def late_imports(source: str) -> list[tuple[int, str]]:
    """(line, text) of every import of a taps_ray module inside a function."""
    lines = source.splitlines()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names = ([alias.name for alias in inner.names] if isinstance(inner, ast.Import) else
                         [inner.module or "."] if isinstance(inner, ast.ImportFrom) and not inner.level else
                         ["."] if isinstance(inner, ast.ImportFrom) else [])
                if any(n == "." or n == "taps_ray" or n.startswith("taps_ray.") for n in names):
                    found.add((inner.lineno, lines[inner.lineno - 1].strip()))
    return sorted(found)


def test_function_level_imports_are_few_and_say_why():
    late = {f"{path.relative_to(PACKAGE.parent)}:{line}": text
            for path in sorted(PACKAGE.rglob("*.py")) for line, text in late_imports(path.read_text())}
    assert late, "no function-level import found: the scan is blind (cli.py keeps its commands' imports late)"
    assert len(late) <= MAX_LATE_IMPORTS, f"{len(late)} function-level imports of taps_ray modules: {sorted(late)}"
    unexplained = sorted(where for where, text in late.items() if LATE_REASON not in text)
    assert unexplained == [], f"say why each import waits for its function ({LATE_REASON}<why>): {unexplained}"


def test_late_import_finder_sees_nested_and_relative_imports():
    source = ("import taps_ray.config\n\ndef f():\n    from taps_ray.a import b  # late: heavy\n"
              "    def g():\n        import taps_ray.c\n        from . import d\n        import os\n")
    assert late_imports(source) == [(4, "from taps_ray.a import b  # late: heavy"), (6, "import taps_ray.c"),
                                    (7, "from . import d")]
