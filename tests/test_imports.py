"""The package's imports go one way, by folder: the maths at the top of accumulation/ imports nothing else of
the package; config/ only the maths; models/ and data/ the two above (and not each other); parallel/ those;
rl/ (the GRPO fork's library) the maths and data/; run/ all of them; checker/ everything. Within a folder there
is no cycle: the shared data types (data/rows.py, data/splits.py) are imported by the sources, and the factory
(data/sources.py) and the sources a path names (data/path_sources.py) import the sources, never the other way."""

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "accumulation"

# Each folder's layer ("" = the package's top level, the maths of one step): a module imports its own folder
# or a lower layer only. The same order as the folders' __init__ docstrings.
LAYERS = {"": 0, "config": 1, "models": 2, "data": 2, "parallel": 3, "rl": 3, "run": 4, "checker": 5}


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
    # The factory imports the shared types, the default corpus and path_sources, which imports the other sources.
    assert {"data.rows", "data.splits", "data.text_corpus", "data.path_sources"} <= graph["data.sources"]
    sources = {"data.locate", "data.jsonl", "data.text_corpus", "data.token_files", "data.masked_lm", "data.tokenizer"}
    assert sources <= graph["data.path_sources"]
    imported_by_sources = set().union(*(graph[source] for source in sources | {"data.rows", "data.splits"}))
    assert not {"data.sources", "data.path_sources"} & imported_by_sources
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"data": {"rows", "jsonl"}, "jsonl": {"data"}, "rows": set()}) == ["data", "jsonl", "data"]
    assert find_cycle({"data": {"rows", "jsonl"}, "jsonl": {"rows"}, "rows": set()}) is None


# What a config must ask for before it is imported (CONTRACT, "The step, for forkers"), each a module of its own
# that only its config key imports: the real options, not their error text, which lives where it is raised.
# (torch.distributed.fsdp is not listed: torch's own _dynamo imports it.)
OPTION_MODULES = {
    "accumulation.data.token_files",  # data.source: a folder of token files
    "accumulation.data.jsonl",  # data.source: a .jsonl file
    "accumulation.data.masked_lm",  # data.task = "masked"
    "accumulation.data.path_sources",  # data.source: a path (text, JSONL, token files)
    "accumulation.data.custom",  # data.source: a registered source
    "accumulation.data.step_tools",  # scripts and tests that build a step's pieces one at a time
    "accumulation.data.packing",  # data.layout = "packed"
    "accumulation.data.uniforms",  # data.task = "masked", the RL rollouts, a fork's augmentation
    "accumulation.models.gru",  # model.name = "gru"
    "accumulation.config.help",  # --help
    "accumulation.models.encoder",  # model.name = "encoder"
    "accumulation.chunked_loss",  # model.loss = "chunked" (or "auto" choosing it, on CUDA)
    "accumulation.models.loss_decision",  # model.loss = "chunked", or "auto" on CUDA
    "accumulation.models.forward_and_loss",  # model.compile (on by default on CUDA only)
    "accumulation.checker",  # scripts/checks/check_equivalence.py
    "accumulation.rl",  # the GRPO fork's library: data.source = "arithmetic-rollouts" (its loss with it)
    "accumulation.parallel.fsdp",  # dist.strategy = "fsdp2"
    "accumulation.run.sharded_checkpoint",  # fsdp2's and pipeline stages' checkpoints, or a resume from one
    "accumulation.parallel.torchrun",  # a launch under torchrun
    "accumulation.parallel.mesh",  # dist.pipeline_stages > 1
    "accumulation.parallel.pipeline",  # dist.pipeline_stages > 1
    "accumulation.models.gpt_stages",  # dist.pipeline_stages > 1 with the GPT
    "accumulation.shrink_on_oom",  # batch.on_oom = "shrink"
    "accumulation.update_on_device",  # a fused optimizer (AdamW on CUDA)
    "accumulation.run.external_sinks",  # log.sinks naming wandb or mlflow
    "accumulation.run.mfu",  # a CUDA run, or log.peak_tflops set
    "torch.distributed.pipelining",
}


def small_corpus(tmp_path: Path) -> list[str]:
    """The settings of a small text corpus written under tmp_path: a config quicker to build than the default's."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(8):
        (corpus / f"doc{index}.txt").write_text(f"document {index}: " + "some words to predict " * 20)
    return [f"data.source={corpus}", "data.seq_len=32"]


def modules_a_run_imports(tmp_path: Path, arguments: list[str]) -> set[str]:
    """The modules in sys.modules after train.main(arguments), in a fresh interpreter."""
    program = (
        "import sys, train\n"
        "assert train.main(sys.argv[1:]) == 0\n"
        "print(' '.join(name for name in sys.modules if name.startswith(('accumulation', 'torch.distributed'))))\n"
    )
    arguments = [f"run.out_dir={tmp_path / 'runs'}", *arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", program, *arguments],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=environment,
    )
    assert completed.returncode == 0, completed.stderr
    return set(completed.stdout.splitlines()[-1].split())


def test_a_default_run_imports_none_of_the_option_modules(tmp_path):
    """Two steps of the default config (its validation and sample included, the embedded corpus): the modules of
    the options it did not ask for stay unimported."""
    imported = modules_a_run_imports(tmp_path, ["run.max_steps=2", "run.eval_every=1", "data.val_rows=8"])
    assert "accumulation.models.gpt" in imported and "accumulation.data.text_corpus" in imported
    packages = ("accumulation.checker.", "accumulation.rl.")  # and every module inside them
    options = {name for name in imported if name in OPTION_MODULES or name.startswith(packages)}
    assert not options, f"the default run imported {sorted(options)}"


def test_a_config_that_asks_for_an_option_imports_it(tmp_path):
    arguments = [*small_corpus(tmp_path), "run.max_steps=0", "model.name=gru", "model.loss=plain"]
    imported = modules_a_run_imports(tmp_path, arguments)
    assert "accumulation.models.gru" in imported and "accumulation.models.gpt" not in imported


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


def test_importing_train_writes_nothing(tmp_path):
    """`import train` (a notebook, a test, a fork's own script) leaves the temporary folder as it was: importing
    torch's pipelining at the top once created an empty torchinductor_<user> there."""
    environment = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    environment["TMPDIR"] = str(tmp_path)
    completed = subprocess.run(
        [sys.executable, "-c", "import train"], capture_output=True, text=True, cwd=REPO, env=environment, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert list(tmp_path.iterdir()) == []
