"""The package's imports go one way, by folder: the maths at the top of accumulation/ imports nothing else of
the package; config/ only the maths; models/ and data/ the two above (and not each other); parallel/ those;
run/ all of them; checker/ everything. Within a folder there is no cycle: the shared data types (data/rows.py)
are imported by the sources, and the factory (data/sources.py) imports the sources, never the other way."""

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "accumulation"

# Each folder's layer ("" = the package's top level, the maths of one step): a module imports its own folder
# or a lower layer only. The same order as the folders' __init__ docstrings.
LAYERS = {"": 0, "config": 1, "models": 2, "data": 2, "parallel": 3, "run": 4, "checker": 5}


def module_name(path: Path) -> str:
    """accumulation/data/rows.py -> "data.rows"; accumulation/step.py -> "step"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules a file imports, at its top or inside a function, as module_name gives them."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accumulation":
            base = node.module.removeprefix("accumulation").removeprefix(".")
            for alias in node.names:  # from accumulation.data import jsonl: the module data.jsonl
                joined = f"{base}.{alias.name}" if base else alias.name
                names.add(joined if joined in modules else base)
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("accumulation.") for a in node.names if a.name.startswith("accumulation.")}
    return names - {""}


def folder(module: str) -> str:
    return module.split(".")[0] if "." in module or module in LAYERS else ""


def package_graph() -> dict[str, set[str]]:
    paths = [path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts]
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) - {module_name(path)} for path in paths}


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


def test_every_folder_imports_only_its_own_and_lower_layers():
    graph = package_graph()
    assert set(map(folder, graph)) == set(LAYERS), "a new folder of accumulation/ needs its layer in LAYERS"
    wrong = [
        f"{module} imports {imported}"
        for module, imports in sorted(graph.items())
        for imported in sorted(imports)
        if folder(imported) != folder(module) and LAYERS[folder(imported)] >= LAYERS[folder(module)]
    ]
    assert not wrong, "imports against the layer order: " + "; ".join(wrong)


def test_the_package_has_no_import_cycle():
    graph = package_graph()
    sources = {"data.rows", "data.jsonl", "data.text_corpus", "data.token_files", "data.masked_lm"}
    assert sources <= graph["data.sources"]  # the factory
    assert "data.sources" not in set().union(*(graph[source] for source in sources))
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"data": {"rows", "jsonl"}, "jsonl": {"data"}, "rows": set()}) == ["data", "jsonl", "data"]
    assert find_cycle({"data": {"rows", "jsonl"}, "jsonl": {"rows"}, "rows": set()}) is None


# The options a default run does not ask for, each a module of its own that only its config key imports.
NOT_IN_THE_DEFAULT_RUN = (
    "accumulation.parallel.fsdp",  # dist.strategy = "fsdp2"
    "accumulation.parallel.pipeline",  # dist.pipeline_stages > 1
    "accumulation.shrink_on_oom",  # batch.on_oom = "shrink"
    "accumulation.update_on_device",  # a fused optimizer (AdamW on CUDA)
    "torch.distributed.pipelining",
)  # (torch.distributed.fsdp is not listed: torch's own _dynamo imports it, whatever the config)


def test_a_default_run_imports_no_option_it_does_not_ask_for(tmp_path):
    """Two steps of the default config (a small model, so the test is quick) in a fresh interpreter, then the
    modules it imported: none of the options above."""
    arguments = [f"run.out_dir={tmp_path}", "run.max_steps=2", "model.n_layer=1", "model.d_model=16", "data.seq_len=16"]
    code = (
        "import sys, train\n"
        f"status = train.main({arguments!r})\n"
        f"print(status, [name for name in {NOT_IN_THE_DEFAULT_RUN!r} if name in sys.modules])\n"
    )
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=environment
    )
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr


def test_one_step_function_builds_every_step_result():
    """StepResult is built in one place, accumulation/step.py's optimizer_step: every layout runs that step, and a
    second step function (the pipeline's once repeated the boundary, the norm and the skip) would build its own."""
    builders = [
        str(path.relative_to(REPO))
        for path in [REPO / "train.py", *PACKAGE.rglob("*.py")]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "StepResult"
    ]
    assert builders == ["accumulation/step.py"]
