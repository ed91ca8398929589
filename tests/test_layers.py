"""The package's layers (docs/architecture.md#layers), checked on its imports: no module
imports one in a layer above its own, and no import cycle, counting imports made inside
functions and under TYPE_CHECKING too (an import moved into a function to dodge a cycle
is still the cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "scheduler_daemon"

# Bottom to top, as docs/architecture.md lists them: a module's layer is the one whose
# longest prefix names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("scheduler_daemon", "redact", "errors", "aio", "output")),
    ("config", ("config", "logs", "metrics", "sdnotify")),
    ("db", ("db", "schema_gate")),
    ("leadership", ("leadership",)),
    ("work", ("plugins", "publishers", "loops", "status", "client")),
    ("serving", ("http", "dashboard", "signals", "daemon")),
    ("cli", ("cli", "__main__")),
]


def module_names() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.with_suffix("").relative_to(PACKAGE.parent).parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The package's modules that ``name`` imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            candidates = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        yield from (c for c in candidates if c in known and c != name)


def layer_of(name: str) -> int:
    short = name.removeprefix("scheduler_daemon.") if name != "scheduler_daemon" else name
    best, found = -1, None
    for number, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (short == prefix or short.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), number
    if found is None:
        pytest.fail(f"{name} is in no layer: add it to LAYERS and docs/architecture.md")
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: set(imports(name, path, set(modules))) for name, path in modules.items()}


def test_no_module_imports_one_in_a_layer_above(graph: dict[str, set[str]]) -> None:
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    # Depth-first search with colours: a grey module met again is a cycle.
    colour: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        colour[name] = "grey"
        for target in sorted(graph[name]):
            if colour.get(target) == "grey":
                cycles.append([*path[path.index(target) :], target])
            elif target not in colour:
                visit(target, [*path, target])
        colour[name] = "black"

    for name in sorted(graph):
        if name not in colour:
            visit(name, [name])
    assert cycles == []


def test_the_checker_sees_an_upward_import_and_a_cycle() -> None:
    """The two checks can fail: on a made-up graph, they find what is wrong."""
    assert layer_of("scheduler_daemon.db.postgres") < layer_of("scheduler_daemon.loops.plugin")
    assert layer_of("scheduler_daemon.config.url") < layer_of("scheduler_daemon.db.base")
    made_up = {"scheduler_daemon.db.base": {"scheduler_daemon.loops.plugin"}}
    with pytest.raises(AssertionError):
        test_no_module_imports_one_in_a_layer_above(
            {**made_up, "scheduler_daemon.loops.plugin": set()}
        )
    with pytest.raises(AssertionError):
        test_no_import_cycles({"a": {"b"}, "b": {"a"}})


def test_no_product_module_is_over_500_lines() -> None:
    """Small modules, one job each (docs/architecture.md): past ~500 lines a module is
    usually doing two things."""
    long = {
        name: lines
        for name, path in module_names().items()
        if (lines := len(path.read_text("utf-8").splitlines())) > 520
    }
    assert long == {}


# The complexity budget: a function a reader can hold in mind. Cyclomatic complexity at
# most 15, as mccabe counts it: ruff's C901 (pyproject.toml), run over the package here
# too, so that the whole budget is one file to read; and at most 60 lines of body,
# without the docstring.
MAX_COMPLEXITY = 15
MAX_FUNCTION_LINES = 60


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = function.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if docstring and len(body) > 1:
        first = body[1]
    return (function.end_lineno or first.lineno) - first.lineno + 1


def test_every_function_is_at_most_60_lines() -> None:
    long = {
        f"{name}:{node.name}": lines
        for name, path in module_names().items()
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (lines := body_lines(node)) > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_every_function_is_at_most_complexity_15() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    checked = subprocess.run(
        [str(ruff), "check", "--select", "C901", "--output-format", "concise",
         "--config", f"lint.mccabe.max-complexity = {MAX_COMPLEXITY}", str(PACKAGE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_budget_counts_lines_without_the_docstring() -> None:
    source = 'def f(x):\n    """doc\n    more"""\n    if x:\n        return 1\n    return 2\n'
    [function] = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    assert body_lines(function) == 3
