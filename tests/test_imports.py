"""The package's layering, read from its source (ast, nothing imported): commands on top, library below, no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hsx"
TOP = {"hsx.cli", "hsx.commands", "hsx.__main__"}  # the command line: nothing else may import these


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
    mods = _modules()
    graph = {name: _imports(name, path, mods, module_level=True) for name, path in mods.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one
