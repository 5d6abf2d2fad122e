"""The folders are the architecture: imports go one way, no two modules of a layer import each other
(directly or around a circle), and no module grows past a screenful of screens."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "stabstudy"
MAX_LINES = 700

#: Top-level modules every layer may import: the shared contract and small utilities.
CORE = {"spec", "registry", "hparams", "paths", "seeding", "plots", "__init__"}

#: Layer -> layers it may import (its own included). ``run`` orchestrates and may import anything.
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "online": {"core", "online"},
    "instruments": {"core", "instruments"},
    "interventions": {"core", "online", "instruments", "interventions"},
    "learners": {"core", "online", "instruments", "interventions", "learners"},
    "analysis": {"core", "online", "analysis", "instruments"},
    "run": {"core", "online", "instruments", "interventions", "learners", "analysis", "run"},
    "__main__": {"run"},
}


def layer_of(module: str) -> str:
    """``stabstudy.learners.rl.learner`` -> ``learners``; ``stabstudy.online`` (a package) -> ``online``;
    top-level modules -> ``core``."""
    parts = module.split(".")[1:]
    if len(parts) == 1 and not (PKG / parts[0]).is_dir():
        return "__main__" if parts[0] == "__main__" else "core"
    return parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """Every ``stabstudy`` module imported by the file (also inside functions), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stabstudy"):
            for alias in node.names:  # `from stabstudy.learners import toy` imports stabstudy.learners.toy
                sub = f"{node.module}.{alias.name}"
                out.append((node.lineno, sub if _is_module(sub) else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("stabstudy")]
    return out


def runtime_imports(path: Path) -> set[str]:
    """The ``stabstudy`` modules the file imports when it runs (also inside functions): those of
    :func:`imports` less the ones under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stabstudy"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if _is_module(sub) else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("stabstudy")}
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (module -> the modules it imports), as ``[a, b, ..., a]``; None when there is none."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        return list(e.args[1])
    return None


def _is_module(name: str) -> bool:
    p = PKG.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def permitted(src: str, dst: str) -> bool:
    if dst == "stabstudy":
        return True  # the package itself (its __version__)
    allowed = ALLOWED[layer_of(src)]
    dst_layer = layer_of(dst)
    if dst_layer == "core":
        return dst.split(".")[1] in CORE
    rest = dst.split(".", 1)[1]
    return dst_layer in allowed or any(rest == a or rest.startswith(a + ".") for a in allowed)


FILES = sorted(PKG.rglob("*.py"))


def test_every_module_belongs_to_a_known_layer():
    for f in FILES:
        assert layer_of(module_name(f)) in ALLOWED, f"{f.relative_to(PKG.parent)} is in no known layer"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_follow_the_arrows(path):
    src = module_name(path)
    wrong = [f"line {line}: {dst}" for line, dst in imports(path) if not permitted(src, dst)]
    assert not wrong, f"{src} ({layer_of(src)}) may import only {sorted(ALLOWED[layer_of(src)])}: {wrong}"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_no_import_cycle_inside_a_layer(layer):
    mods = {module_name(f): f for f in FILES if layer_of(module_name(f)) == layer}
    graph = {m: {d for d in runtime_imports(f) if d in mods and d != m} for m, f in mods.items()}
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle inside {layer}: {' -> '.join(cycle)} (move what both need to a module of its own)"


def test_the_cycle_check_can_fail():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) in (["a", "c", "b", "a"], ["a", "b", "c", "a"],
                                                                ["b", "a", "c", "b"], ["c", "b", "a", "c"],
                                                                ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert import_cycle({"a": {"b"}, "b": set()}) is None
    # an import under `if TYPE_CHECKING:` is never executed: no cycle (stabstudy.interventions.perturb.effects)
    effects = PKG / "interventions" / "perturb" / "effects.py"
    assert "stabstudy.interventions.perturb.perturber" in {d for _, d in imports(effects)}
    assert "stabstudy.interventions.perturb.perturber" not in runtime_imports(effects)


RL = PKG / "analysis" / "studies" / "rl"


@pytest.mark.parametrize("path", sorted(RL.glob("*.py")), ids=lambda p: p.name)
def test_the_rl_study_imports_at_module_level(path):
    inner = [f"line {n.lineno}" for f in ast.walk(ast.parse(path.read_text()))
             if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
             for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not inner, f"{path.name} imports inside functions ({', '.join(inner)}): import at module level"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_modules_stay_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {n} lines (> {MAX_LINES}): split it by job"


def test_the_arrow_check_can_fail():
    assert not permitted("stabstudy.analysis.events", "stabstudy.learners.toy")
    assert not permitted("stabstudy.instruments.curvature", "stabstudy.interventions.perturb")
    assert not permitted("stabstudy.learners.toy", "stabstudy.run.store")
    assert not permitted("stabstudy.spec", "stabstudy.learners.lm")
    assert permitted("stabstudy.learners.toy", "stabstudy.instruments.curvature")
    assert not permitted("stabstudy.interventions.control", "stabstudy.analysis.warning.evaluation")
    assert not permitted("stabstudy.online.robust", "stabstudy.interventions.control")
    assert not permitted("stabstudy.online.metastate", "stabstudy.analysis.warning.metastate")
    assert permitted("stabstudy.interventions.control", "stabstudy.online.robust")
    assert permitted("stabstudy.analysis.warning.evaluation", "stabstudy.online")
    assert not permitted("stabstudy.interventions.control", "stabstudy.analysis.studies.rl.runs")
