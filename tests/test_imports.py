"""The package's layering, read from its source (ast, nothing imported): commands on top, library below, no cycle,
nothing imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hsx"
TOP = {"hsx.cli", "hsx.commands", "hsx.launch", "hsx.__main__"}  # the command line: nothing else may import these

# The data flow, lowest first: a module imports only from its own layer or the ones before it (imports inside
# functions count: a late import is still a dependency). A new module goes into the layer of what it does.
LAYERS: list[set[str]] = [
    # errors and the output format every layer names; the demo's seeded tokenizer, model and chats; the file
    # primitives (no link followed, bounded reads) and CRC-32s every writer and reader of an output dir uses; the
    # table of trainer exports (hsx.exports: the CLI, its commands and hsx's attributes read it)
    {"hsx.errors", "hsx.schema", "hsx.version", "hsx.demo", "hsx.demo.train", "hsx.files", "hsx.checksums",
     "hsx.exports"},
    {"hsx.config", "hsx.drafts"},  # the job's settings (drafts: --layers-from, a draft config's layers)
    # what a config is turned into: the fingerprint, the bounded template renderer and the loss masks read off its
    # renders, length buckets; the target's wing (hsx.target, its map in its docstring): the model folder checked
    # (checkpoint), the model loaded (model) and prepared to run, its kernels (experts: moe, moe_kernels, their
    # sharding over ranks expert_parallel; FP8 checkpoints: the format fp8, the linear layer and its GEMMs fp8_gemm,
    # hsx's FP8 layers in a model fp8_model)
    {"hsx.fingerprint", "hsx.render", "hsx.masks", "hsx.buckets", "hsx.target", "hsx.target.checkpoint",
     "hsx.target.model", "hsx.target.prepare", "hsx.target.attention", "hsx.target.gdn", "hsx.target.moe",
     "hsx.target.moe_kernels", "hsx.target.expert_parallel", "hsx.target.fp8", "hsx.target.fp8_gemm",
     "hsx.target.fp8_model", "hsx.target.kernels"},
    # rows in, states out, and the output dir they are written to (hsx.json: info; its record files: ledgers;
    # the storage's own rates: storage); answers in, for hsx regenerate (generators)
    {"hsx.inputs", "hsx.data", "hsx.generators", "hsx.target.capture", "hsx.target.drift", "hsx.engine",
     "hsx.policy", "hsx.writer", "hsx.storage", "hsx.info", "hsx.ledgers", "hsx.sink", "hsx.card", "hsx.vocab"},
    # pricing a job, making its model ready (hsx.target.ready), reading, merging, exporting, checking, publishing and
    # following an output dir (hsx.flight: follow's network source; hsx.serve: the server answering it;
    # hsx.torch_data: the torch datasets follow and load hand out, imported when they build one)
    {"hsx.cost", "hsx.target.ready", "hsx.load", "hsx.claims", "hsx.merge", "hsx.export", "hsx.verify", "hsx.hub",
     "hsx.follow", "hsx.flight", "hsx.serve", "hsx.torch_data", "hsx.export_journal"},
    {"hsx.job", "hsx.handout"},  # one job's steps; which of its units this process writes
    {"hsx.run", "hsx.regeneration"},  # running them as one rank of a launch; regenerate's job (its ranks too)
    {"hsx", "hsx.api", "hsx.bench", "hsx.bench_models"},  # the Python API; the benchmark and its random FP8 models
    {"hsx.commands", "hsx.cli", "hsx.launch", "hsx.__main__", "hsx.demo.__main__"},  # the command lines
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path], module_level: bool) -> set[str]:
    """The hsx modules `name` imports: at import time only (module_level), or anywhere (in functions too)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "hsx"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "hsx":
            for a in node.names:  # `from hsx import model` imports hsx.model; `from hsx import __version__`, hsx
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{name}: relative import (the package uses absolute ones)")
    return found - {name}


def _graph(module_level: bool) -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods, module_level) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep in graph and not state.get(dep) and (found := visit(dep, stack)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if not state.get(m) and (found := visit(m, [])):
            return found
    return None


def _upward(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as "importer (layer) -> imported (layer)"."""
    layer_of = {m: i for i, layer in enumerate(layers) for m in layer}
    return [f"{m} ({layer_of[m]}) -> {dep} ({layer_of[dep]})" for m in sorted(graph) for dep in sorted(graph[m])
            if layer_of[dep] > layer_of[m]]


def test_the_walk_sees_the_package():
    mods = _modules()
    assert {"hsx", "hsx.cli", "hsx.commands", "hsx.config", "hsx.errors", "hsx.run", "hsx.sink"} <= set(mods)
    assert "hsx.commands" in _imports("hsx.cli", mods["hsx.cli"], mods, module_level=False)
    assert "hsx.errors" in _imports("hsx.cli", mods["hsx.cli"], mods, module_level=True)


def test_no_module_below_the_command_line_imports_it():
    mods = _modules()
    offenders = {name: sorted(deps & TOP) for name, path in mods.items() if name not in TOP
                 and (deps := _imports(name, path, mods, module_level=False)) & TOP}
    assert not offenders, f"library modules importing the command line: {offenders}"
    users = {name for name, path in mods.items() if "hsx.commands" in _imports(name, path, mods, False)}
    assert users == {"hsx.cli"}


def test_no_import_cycle_at_import_time():
    graph = _graph(module_level=True)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one


def test_no_import_cycle_counting_imports_in_functions(tmp_path):
    graph = _graph(module_level=False)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    # The check itself finds a cycle made by an import inside a function, which the import-time walk misses.
    (tmp_path / "low.py").write_text("def f():\n    from hsx import high\n")
    (tmp_path / "high.py").write_text("from hsx import low\n")
    mods = {"hsx.low": tmp_path / "low.py", "hsx.high": tmp_path / "high.py"}
    assert _cycle({n: _imports(n, p, mods, module_level=True) for n, p in mods.items()}) is None
    assert _cycle({n: _imports(n, p, mods, module_level=False) for n, p in mods.items()}) == [
        "hsx.high", "hsx.low", "hsx.high"]


def test_every_module_has_a_layer_and_none_imports_upward():
    graph = _graph(module_level=False)
    placed = [m for layer in LAYERS for m in layer]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    assert set(placed) == set(graph), (f"modules without a layer: {sorted(set(graph) - set(placed))}; "
                                       f"layers naming no module: {sorted(set(placed) - set(graph))}")
    assert not _upward(graph, LAYERS), "imports from a higher layer:\n" + "\n".join(_upward(graph, LAYERS))
    # The check itself finds one: the output dir reaching up for the job.
    injected = {**graph, "hsx.sink": graph["hsx.sink"] | {"hsx.job"}}
    assert _upward(injected, LAYERS) == ["hsx.sink (3) -> hsx.job (5)"]
