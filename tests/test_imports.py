"""The package's modules import one another without a cycle: the shared data types (accumulation/rows.py) are
imported by the sources, and the factory (accumulation/data.py) imports the sources, never the other way. A
fork that adds a source imports rows.py and joins no cycle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "accumulation"


def imported_modules(path: Path) -> set[str]:
    """The accumulation modules a file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "accumulation":  # from accumulation import x
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accumulation."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("accumulation.")}
    return names


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None: depth-first search, a module
    seen again while still on the path closes a cycle."""
    finished, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in finished:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        finished.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


def test_the_package_has_no_import_cycle():
    graph = {path.stem: imported_modules(path) for path in PACKAGE.glob("*.py")}
    assert {"rows", "jsonl", "text_corpus", "token_files", "masked_lm"} <= graph["data"]  # the factory
    assert "data" not in graph["token_files"] | graph["jsonl"] | graph["text_corpus"] | graph["masked_lm"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"data": {"rows", "jsonl"}, "jsonl": {"data"}, "rows": set()}) == ["data", "jsonl", "data"]
    assert find_cycle({"data": {"rows", "jsonl"}, "jsonl": {"rows"}, "rows": set()}) is None
