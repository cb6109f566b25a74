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
       "ccexp.report", "ccexp.tracking", "ccexp.launch", "ccexp.compare")


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


LEAVES = ("ccexp.errors",)  # imports nothing of ccexp: any floor may use it
# names are made from data (any floor) and from a config (asking the schemas): the schemas, nothing above them
NEAR_LEAVES = {"ccexp.names": {"ccexp.errors", "ccexp.config"}}


def test_the_ground_floor_never_imports_upward(graph):
    for leaf in LEAVES:
        assert not {d for d in graph[leaf] if d != "ccexp"}, f"{leaf} must stay a leaf"
    for name, allowed in NEAR_LEAVES.items():
        assert not {d for d in graph[name] if d != "ccexp"} - allowed, f"{name} imports beyond {sorted(allowed)}"
    for name, deps in graph.items():
        if name.startswith(GROUND):
            upward = {d for d in deps if not d.startswith(GROUND) and d not in ("ccexp", *LEAVES, *NEAR_LEAVES)}
            assert not upward, f"{name} imports {sorted(upward)}"


def test_the_pipeline_reads_on_one_screen():
    assert len((PACKAGE / "pipeline.py").read_text().splitlines()) <= 80


def test_functions_are_short_and_top_floor_ones_take_few_positional_parameters():
    """Every function of every package is at most 60 lines; the top floor's take at most 8 positional
    parameters (the ground floor's compiled kernels take their arrays positionally)."""
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                assert length <= 60, f"{name}.{node.name} is {length} lines"
                if name.startswith(TOP):
                    assert len(positional) <= 8, f"{name}.{node.name} takes {len(positional)} positional parameters"


# (importer prefix, imported prefix, why): the layering rules of issue 22
FORBIDDEN = [
    ("ccexp.stages", "ccexp.training", "the stages preprocess; a training step (DoReMi's reference run) is the "
                                       "recipe's call (ccexp.training.reference)"),
    ("ccexp.names", "ccexp.preflight", "run naming asks the components' schemas, not the validator"),
    ("ccexp.tracking.mlflow_run", "ccexp.preflight", "the run record asks the components' schemas, not the validator"),
    ("ccexp.preflight", "ccexp.training", "model-source helpers live below training/ (ccexp.model_source)"),
    ("ccexp.training", "ccexp.tracking", "training names its metrics with ccexp.names, not the tracking module"),
    ("ccexp.training", "ccexp.launch", "training knows nothing of how it was launched"),
    ("ccexp.training", "ccexp.compare", "training knows nothing of how runs are compared"),
    *[(part, room, "the statistics, the verdict and the budget study are functions over plain values and run "
                   "records; reading runs from a store and launching jobs are the report's and launch/'s")
      for part in ("ccexp.compare.stats", "ccexp.compare.verdict", "ccexp.compare.budget")
      for room in ("ccexp.tracking", "ccexp.launch")],
    ("ccexp.tracking", "ccexp.compare", "the trackers record; compare decides"),
    ("ccexp.stages", "ccexp.preflight", "a predicate two modules share is declared on a schema, not in the validator"),
]


@pytest.mark.parametrize("importer,imported,why", FORBIDDEN, ids=[f"{a}-x-{b}" for a, b, _ in FORBIDDEN])
def test_the_layering_rules_hold(graph, importer, imported, why):
    bad = {(name, dep) for name, deps in graph.items() if name == importer or name.startswith(importer + ".")
           for dep in deps if dep == imported or dep.startswith(imported + ".")}
    assert not bad, f"{sorted(bad)}: {why}"


def test_only_entry_points_call_the_validator(graph):
    """The pre-flight is called by the recipe and the command-line entry points; no component or stage
    imports it for a shared predicate."""
    entry = {"ccexp.pipeline", "ccexp.plan", "ccexp.__main__", "ccexp.help", "ccexp.launch.sweep"}
    users = {name for name, deps in graph.items() if "ccexp.preflight" in deps}
    assert users <= entry, f"{sorted(users - entry)} import ccexp.preflight"


GROUP_NAMES = {"data", "embedder", "clusterer", "sampler", "model", "trainer", "logger", "eval", "callbacks", "debug"}


def _config_node(expr: ast.AST) -> bool:
    """``cfg``, ``self.cfg``, ``cfg.<group>`` (any root spelled cfg), or a bare group name such as ``sampler``."""
    text = ast.unparse(expr)
    parts = text.split(".")
    if parts[0] == "self":
        parts = parts[1:]
    return bool(parts) and (parts[0] == "cfg" and all(p in GROUP_NAMES for p in parts[1:])
                            or len(parts) == 1 and parts[0] in GROUP_NAMES)


def _sniffing(path: Path) -> list[str]:
    """Places in ``path`` that work out what a component is by looking at it: ``"key" in cfg.<group>``,
    ``<config>.name ==`` (or ``!=`` / ``in``), ``inspect.signature`` and ``hasattr`` on a component."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            left, right = node.left, node.comparators[0]
            if isinstance(node.ops[0], (ast.In, ast.NotIn)) and isinstance(left, ast.Constant) and \
                    isinstance(left.value, str) and _config_node(right):
                found.append(f"{path.name}:{node.lineno} key sniffing: {ast.unparse(node)}")
            for side in (left, right):
                if isinstance(side, ast.Attribute) and side.attr == "name" and _config_node(side.value):
                    found.append(f"{path.name}:{node.lineno} branching on a display name: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("inspect.signature", "signature") and path.name != "build.py":
                found.append(f"{path.name}:{node.lineno} signature sniffing: {ast.unparse(node)}")
            if name == "hasattr" and node.args and ast.unparse(node.args[0]).split(".")[-1] in (
                    "sampler", "clusterer", "embedder", "model", "strategy"):
                found.append(f"{path.name}:{node.lineno} hasattr on a component: {ast.unparse(node)}")
    return found


def test_no_component_is_identified_by_sniffing_keys_signatures_or_names():
    """Components declare what they are (their schemas in ccexp.config: cluster counts, needs, weights
    source); nothing outside the schemas infers it from which keys a config has, a constructor's
    signature, a display name, or an attribute's presence. build.py's check of a config's keys against
    its target's parameters is the one signature read (a validation, not an inference)."""
    found = [line for name, path in modules().items() if name != "ccexp.config" for line in _sniffing(path)]
    assert not found, "\n".join(found)


def test_the_sniffing_check_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('if "levels" in cfg.clusterer: pass\nif cfg.sampler.name == "dynamic": pass\n'
                      'if "similarity" in inspect.signature(f).parameters: pass\nif hasattr(sampler, "x"): pass\n'
                      'if "pretrained" not in model: pass\nif d.name == "hydra": pass\n')
    found = sorted((int(line.split(":")[1].split()[0]), line.split(" ", 1)[1].split(":")[0]) for line in _sniffing(sample))
    assert found == [(1, "key sniffing"), (2, "branching on a display name"), (3, "signature sniffing"),
                     (4, "hasattr on a component"), (5, "key sniffing")]  # a Path's .name (line 6) is not a config
