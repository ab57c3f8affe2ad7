"""The import graph of backfill/ follows its floors (docs/architecture.md).

Every import in the package (module level and inside functions; those under `if TYPE_CHECKING:` are
type-only and never run) is an edge between two modules. Each package sits on a floor; an import from
a lower floor up to a higher one is a layering exception and must be listed below with its reason.
The harness (backfill/bench/) stands apart: it may import any product module, and only the CLI and
the harness itself may import it. No import cycle runs at run time.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "backfill"

# Lowest first. A module on floor n may import floors <= n; same-floor packages may import each other.
FLOORS: dict[str, int] = {
    "types": 0, "sampling_params": 0, "errors": 0, "options": 0, "validation": 0, "progress": 0, "paths": 0,
    "engine": 1, "memory": 1,
    "policy": 2,
    "serving": 3,
    "finetune": 4, "offload": 4, "realtime": 4,
    "server": 5,
    "node": 6,
    "cluster": 7,
    "cli": 8, "__main__": 8,
}
# Run-time cycles tolerated for now, with the reason; a cycle not listed fails.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}
HARNESS = "bench"
MAY_IMPORT_HARNESS = {"bench", "cli"}

# (importer, imported) -> why the arrow points up. At most five.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("backfill.memory.pager", "backfill.offload.client"):
        "make_pager connects swap space to memory lent through the AQUA coordinator; imported only when a "
        "coordinator URL is given",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "backfill"


def type_only_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def import_graph() -> tuple[set[str], dict[tuple[str, str], bool]]:
    """The modules, and each edge (importer, imported) -> True where every import of it is type-only."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], bool] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        type_only = type_only_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the importer's package
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if not (target == "backfill" or target.startswith("backfill.")):
                    continue
                imported = resolve(target)
                if imported is None or imported == module:
                    continue
                is_type_only = id(node) in type_only
                key = (module, imported)
                edges[key] = edges.get(key, True) and is_type_only
    return modules, edges


MODULES, EDGES = import_graph()
RUNTIME_EDGES = {edge for edge, type_only in EDGES.items() if not type_only}


def floor_of(package: str) -> int | None:
    return FLOORS.get(package)


def upward_imports() -> dict[tuple[str, str], list[tuple[str, str]]]:
    found: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for importer, imported in EDGES:
        low, high = floor_of(package_of(importer)), floor_of(package_of(imported))
        if low is not None and high is not None and high > low:
            found[(package_of(importer), package_of(imported))].append((importer, imported))
    return found


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
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

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_floor():
    packages = {package_of(m) for m in MODULES} - {"backfill", HARNESS}
    assert packages <= set(FLOORS), f"packages without a floor: {packages - set(FLOORS)}"


def test_upward_imports_are_the_listed_exceptions():
    found = upward_imports()
    edges = {edge for pairs in found.values() for edge in pairs}
    assert len(ALLOWED_UPWARD) <= 5
    assert edges == set(ALLOWED_UPWARD), (
        f"unlisted: {sorted(edges - set(ALLOWED_UPWARD))}; listed but gone: {sorted(set(ALLOWED_UPWARD) - edges)}")


def test_only_the_cli_and_the_harness_import_the_harness():
    importers = {package_of(a) for a, b in EDGES if package_of(b) == HARNESS and package_of(a) != HARNESS}
    assert importers <= MAY_IMPORT_HARNESS, f"product packages importing bench/: {importers - MAY_IMPORT_HARNESS}"


def test_no_import_cycle_at_run_time():
    found = [tuple(c) for c in cycles(RUNTIME_EDGES)]
    assert set(found) <= set(ALLOWED_CYCLES), f"unlisted cycles: {sorted(set(found) - set(ALLOWED_CYCLES))}"


@pytest.mark.parametrize("edge", sorted(ALLOWED_UPWARD))
def test_each_listed_exception_still_exists(edge):
    assert edge in EDGES


if __name__ == "__main__":  # the graph's numbers, for docs/architecture.md
    found = upward_imports()
    print(f"{len(MODULES)} modules, {len(EDGES)} edges ({len(RUNTIME_EDGES)} run-time)")
    print(f"upward imports: {sum(len(v) for v in found.values())}")
    for (a, b), pairs in sorted(found.items()):
        for pair in pairs:
            print(f"  {a} -> {b}: {pair[0]} -> {pair[1]}")
    print(f"run-time cycles: {cycles(RUNTIME_EDGES)}")
    with_type_only = cycles(set(EDGES))
    print(f"cycles with type-only imports: {len(with_type_only)}")
    for cycle in with_type_only:
        print("  " + ", ".join(cycle))
