"""The layers of recforge point down (docs/architecture.md), checked over every import, including those
written inside functions.

composition (pipelines, worker, ui, cli, demo) > seed systems (rap, elastic, recom) > core (train,
preprocess, data, tracking) > base (config, settings, exports, recforge_kernels).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (ROOT / "platform", ROOT / "kernels")

LAYERS: dict[str, int] = {
    "pipelines": 3, "worker": 3, "ui": 3, "cli": 3, "demo": 3,
    "rap": 2, "elastic": 2, "recom": 2,
    "train": 1, "preprocess": 1, "data": 1, "tracking": 1,
    "config": 0, "settings": 0, "exports": 0, "recforge_kernels": 0,
}
LAYER_NAMES = {3: "composition", 2: "seed system", 1: "core", 0: "base"}
LAZY_MARK = "# lazy:"


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for src in SOURCE_ROOTS:
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _top(module: str) -> str | None:
    """The top-level package a recforge module belongs to (recforge.rap.x -> rap), None for third party."""
    parts = module.split(".")
    if parts[0] == "recforge_kernels":
        return "recforge_kernels"
    if parts[0] != "recforge" or len(parts) < 2:
        return None
    return parts[1]


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert node.level == 0, "relative imports are not used in recforge"
    assert node.module is not None
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names]


class _Imports(ast.NodeVisitor):
    """Every import of a module, with whether it sits inside a function."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
        self._depth = 0

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._depth > 0))


def _lazy_export_targets(tree: ast.Module) -> list[tuple[str, int]]:
    """Modules a package names in its `lazy_exports(__name__, {module: names})` table: imports made on first use."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" and len(node.args) > 1:
            table = node.args[1]
            if isinstance(table, ast.Dict):
                found += [(k.value, k.lineno) for k in table.keys if isinstance(k, ast.Constant)]
    return found


def _all_imports():
    for module, path in sorted(MODULES.items()):
        source = path.read_text()
        tree = ast.parse(source)
        visitor = _Imports()
        visitor.visit(tree)
        lines = source.splitlines()
        for node, in_function in visitor.found:
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            for target in _imported(node):
                yield module, target, node.lineno, in_function, text
        for target, line in _lazy_export_targets(tree):
            yield module, target, line, False, lines[line - 1]


IMPORTS = list(_all_imports())


def _package_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, target, line, _, _ in IMPORTS:
        a, b = _top(module), _top(target)
        if a and b and a != b:
            edges[(a, b)].append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}")
    return edges


EDGES = _package_edges()


def test_every_package_has_a_layer() -> None:
    tops = {_top(m) for m in MODULES} - {None}
    assert tops <= set(LAYERS), f"packages without a layer: {sorted(tops - set(LAYERS))}"


def test_no_cycle_between_top_level_packages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in EDGES:
        graph[a].add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return False

    cycles = sorted(f"{a} <-> {b}: {EDGES[(a, b)][0]}" for a, b in EDGES if reaches(b, a))
    assert not cycles, "package cycles:\n" + "\n".join(cycles)


def test_imports_point_down() -> None:
    upward = []
    for (a, b), where in sorted(EDGES.items()):
        if LAYERS[b] > LAYERS[a]:
            upward.append(f"{LAYER_NAMES[LAYERS[a]]} {a} -> {LAYER_NAMES[LAYERS[b]]} {b}: {where[0]}")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_core_never_imports_a_seed_system() -> None:
    bad = [w for (a, b), where in EDGES.items() if LAYERS[a] == 1 and LAYERS[b] == 2 for w in where]
    assert not bad, "\n".join(bad)


def test_seed_systems_do_not_import_each_other() -> None:
    """rap, elastic and recom share only core (and base): what two of them need in common lives there, and the
    composition layer wires them together."""
    bad = [w for (a, b), where in EDGES.items() if LAYERS[a] == 2 and LAYERS[b] == 2 for w in where]
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_say_why() -> None:
    """An import inside a function keeps a heavy dependency off the DAG-parse path (or breaks a load-order
    knot); the line says which with a `# lazy:` comment."""
    silent = sorted({f"{MODULES[m].relative_to(ROOT)}:{line}" for m, _, line, inside, text in IMPORTS
                     if inside and LAZY_MARK not in text})
    assert not silent, f"{len(silent)} imports inside functions without '{LAZY_MARK} <reason>':\n" + "\n".join(silent)


@pytest.mark.parametrize("layer", sorted(set(LAYERS.values())))
def test_the_checker_sees_each_layer(layer: int) -> None:
    """The rules above are only as good as the module list: every layer has modules in it."""
    assert any(LAYERS.get(_top(m) or "", -1) == layer for m in MODULES)


def test_the_checker_sees_imports_inside_functions() -> None:
    """Known edges, one written at module level and one inside a function, are both seen."""
    assert ("pipelines", "train") in EDGES
    assert any(inside for _, _, _, inside, _ in IMPORTS)


def test_the_checker_sees_lazy_export_tables() -> None:
    """A package's lazy export table is an import made on first use: worker exports names of train's modules."""
    assert any(m == "recforge.worker" and t.startswith("recforge.train.") for m, t, *_ in IMPORTS)


@pytest.mark.parametrize("path", sorted((ROOT / "dags").glob("*.py")) + sorted((ROOT / "plugins").glob("*.py")),
                         ids=lambda p: p.name)
def test_dag_and_plugin_files_only_wire(path: Path) -> None:
    """DAG files compose tasks from recforge.pipelines, the plugin mounts recforge.ui: nothing else of recforge."""
    allowed = "recforge.pipelines" if path.parent.name == "dags" else "recforge.ui"
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text()))
    reached = {target for node, _ in visitor.found for target in _imported(node) if _top(target)}
    assert reached, f"{path.name} imports nothing of recforge: is the checker looking at the right files?"
    assert all(t.startswith(allowed + ".") for t in reached), f"{path.name} reaches past {allowed}: {sorted(reached)}"
    assert not [n for n, inside in visitor.found if inside], f"{path.name} imports inside functions"
