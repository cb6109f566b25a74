"""The house's layout holds: no import cycles between ccexp's modules, the ground floor never imports
upward, and the top floor stays readable (a one-screen pipeline, short functions, few positional
parameters). Read from the source with ``ast``, so a lazy import inside a function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ccexp"
GROUND = ("ccexp.sampling", "ccexp.clustering", "ccexp.embedding", "ccexp.data")
TOP = ("ccexp.pipeline", "ccexp.stages", "ccexp.preflight", "ccexp.build", "ccexp.config", "ccexp.__main__",
       "ccexp.report", "ccexp.tracking")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The ccexp modules ``path`` imports (``from ccexp.x import y`` counts ``ccexp.x.y`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ccexp")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ccexp"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return {m for m in found if m in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_no_import_cycles_between_modules(graph):
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if nxt == "ccexp" or nxt.startswith("ccexp.") and nxt.count(".") == 1 and nxt + ".__init__" in graph:
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if state.get(nxt) is None:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


LEAVES = ("ccexp.errors", "ccexp.names")  # import nothing of ccexp: any floor may use them


def test_the_ground_floor_never_imports_upward(graph):
    for leaf in LEAVES:
        assert not {d for d in graph[leaf] if d != "ccexp"}, f"{leaf} must stay a leaf"
    for name, deps in graph.items():
        if name.startswith(GROUND):
            upward = {d for d in deps if not d.startswith(GROUND) and d not in ("ccexp", *LEAVES)}
            assert not upward, f"{name} imports {sorted(upward)}"


def test_the_pipeline_reads_on_one_screen():
    assert len((PACKAGE / "pipeline.py").read_text().splitlines()) <= 80


def test_top_floor_functions_are_short_with_few_positional_parameters():
    for name, path in modules().items():
        if not name.startswith(TOP):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                assert length <= 60, f"{name}.{node.name} is {length} lines"
                assert len(positional) <= 8, f"{name}.{node.name} takes {len(positional)} positional parameters"
