"""The install: a lean core with extras, every import declared, hashed locks, environment.yml current."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib

import pytest
from docblocks import NOT_RUN, chain, documents, extras_of, python_blocks
from leanimport import ROOT, _norm
from packaging.requirements import Requirement

sys.path.insert(0, str(ROOT / "tools"))
import deps  # noqa: E402

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
EXTRAS = PROJECT["optional-dependencies"]


def lean(extras: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "tests" / "leanimport.py"), extras, code], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


MONITOR = """
import torch
from stabstudy.instruments.telemetry import Monitor
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
with Monitor(model, opt) as mon:
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
assert mon.to_dataset().sizes["step"] == 3
"""
CONTROLLER = """
import torch
from stabstudy.interventions.control import Controller, Skip
from stabstudy.online import RobustZ
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
ctrl = Controller(RobustZ(side="up"), Skip(), log=True).attach(opt)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
ctrl.close()
assert len(ctrl.records()["intervened"]) == 3
"""
SB3_CALLBACKS = """
from stabstudy.learners.rl import (ControllerCallback, DiagnosticsCallback, EvaluationCallback,
                                   PerturbationCallback, Recorder, TelemetryCallback)
"""
@pytest.mark.parametrize(("extras", "code"), [("", MONITOR), ("", CONTROLLER), ("rl", SB3_CALLBACKS)],
                         ids=["monitor-core", "controller-core", "sb3-callbacks-rl"])
def test_lean_install_imports_and_runs(extras, code):
    proc = lean(extras, code)
    # the packages of the other extras were hidden (libraries probing for optional ones saw them absent)
    assert proc.returncode == 0, proc.stderr[-3000:]


CLI = """
import sys
from stabstudy.run.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # --help and --version exit through argparse
    code = e.code
sys.exit(code)
"""


def cli(extras: str, *args: str, data=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    if data is not None:
        env["STABSTUDY_DATA"] = str(data)
    code = "import sys; sys.argv[1:] = " + repr(list(args)) + "\n" + CLI
    return subprocess.run([sys.executable, str(ROOT / "tests" / "leanimport.py"), extras, code], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_cli_with_the_core_alone(tmp_path):
    """--help, --version, list and runs need no extra; the commands that do say which one."""
    for args, out in ((["--help"], "{study,runs,report,list,new}"), (["--version"], "stabstudy 0.1.0"),
                      (["list", "channels"], "| `grad_norm` |"), (["list", "--domain", "toy"], "digits"),
                      (["runs"], "no stored runs in")):
        proc = cli("", *args, data=tmp_path)
        assert proc.returncode == 0 and out in proc.stdout, (args, proc.stderr[-2000:])
    (tmp_path / "runs").mkdir(exist_ok=True)
    (tmp_path / "runs" / "0123abcd.nc").write_bytes(b"")
    proc = cli("", "runs", data=tmp_path)
    assert proc.returncode == 2 and "pip install 'stabstudy[study]'" in proc.stderr, proc.stderr[-2000:]
    for args in (["study", "--profile", "smoke"], ["report", "--check"], ["new", "07_probe"]):
        proc = cli("", *args, data=tmp_path)
        assert proc.returncode == 2 and "needs the [study] extra" in proc.stderr, (args, proc.stderr[-2000:])


def test_the_lean_check_hides_what_an_extra_would_bring():
    proc = lean("", SB3_CALLBACKS)  # the callbacks without [rl]
    assert proc.returncode != 0 and "No module named 'stable_baselines3'" in proc.stderr
    proc = lean("", "import importlib.util; assert importlib.util.find_spec('papermill') is None")
    assert proc.returncode == 0, proc.stderr[-2000:]  # a probing library sees it as absent
    with pytest.raises(ValueError, match="valid: rl"):
        __import__("leanimport").distributions(["nosuch"])


# -- every example of the README and docs/, with only the extra it names ------------------------

#: Every ```python block of the README and docs/: (document, index).
EXAMPLES = [(doc, i) for doc in documents() for i in range(len(python_blocks(doc)))]

# One example (after those it continues) in a fresh interpreter with only the packages of the extra
# it names importable (leanimport: hidden modules and distribution metadata); a fresh process per
# example, so that what one example's libraries cached about the installed packages (SB3 looks for
# tensorboard once) does not carry over.
EXAMPLE_RUNNER = """
import sys, types
import leanimport
from docblocks import extras_of, python_blocks
doc, order = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
blocks = python_blocks(doc)
leanimport.hide_all_but([])
main = types.ModuleType("__main__")  # a script's module: a registry entry may name "__main__:run"
sys.modules["__main__"] = main
for i in order:
    leanimport.allow_only(extras_of(blocks[i]))
    exec(compile(blocks[i], f"{doc} (python block {i + 1})", "exec"), main.__dict__)
"""


@pytest.mark.parametrize(("doc", "i"), EXAMPLES, ids=[f"{d}:{i + 1}" for d, i in EXAMPLES])
def test_every_example_names_its_extra(doc, i):
    code = python_blocks(doc)[i]
    extras = extras_of(code)
    assert extras is not None, (f"{doc} python block {i + 1} names no extra: its first line must be "
                                "\"# pip install stabstudy\" (the core) or \"# pip install 'stabstudy[<extra>]'\"")
    assert set(extras) <= set(EXTRAS), f"{doc} block {i + 1}: unknown extra(s) {set(extras) - set(EXTRAS)}"


RUNNABLE = [(d, i) for d, i in EXAMPLES if not python_blocks(d)[i].startswith(NOT_RUN)]


@pytest.mark.parametrize(("doc", "i"), RUNNABLE, ids=[f"{d}:{i + 1}" for d, i in RUNNABLE])
def test_every_example_runs_with_only_the_extra_it_names(doc, i, tmp_path):
    """As a user who installed only that extra runs it (services offline: W&B offline, MLflow on a
    local file store, the Hugging Face hub offline; files under a temporary folder)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", MPLBACKEND="Agg", WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_DIR=str(tmp_path), MLFLOW_TRACKING_URI=(tmp_path / "mlruns").as_uri(),
               MLFLOW_ALLOW_FILE_STORE="true", STABSTUDY_DATA=str(tmp_path / "data"),
               STABSTUDY_FIGURES=str(tmp_path / "figures"))
    proc = subprocess.run([sys.executable, "-c", EXAMPLE_RUNNER, doc, ",".join(map(str, chain(doc, i)))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{doc} python block {i + 1} fails with only "
                                  f"{extras_of(python_blocks(doc)[i]) or 'the core'}:\n{proc.stderr[-4000:]}")


def _declared() -> set[str]:
    """Distributions pyproject names (the core and every extra), with those its requirements'
    own extras add (dask[distributed] -> distributed)."""
    out = set()
    for spec in PROJECT["dependencies"] + [r for reqs in EXTRAS.values() for r in reqs]:
        req = Requirement(spec)
        out.add(_norm(req.name))
        if req.extras and _norm(req.name) != "stabstudy":
            for sub in md.distribution(req.name).requires or []:
                s = Requirement(sub)
                if s.marker and any(s.marker.evaluate({"extra": e}) for e in req.extras):
                    out.add(_norm(s.name))
    return out


def _imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the stabstudy files that import it (also inside functions)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "stabstudy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for n in names:
                top = n.partition(".")[0]
                if top != "stabstudy" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    owners = md.packages_distributions()
    declared = _declared()
    missing = {mod: sorted(files) for mod, files in _imports().items()
               if not any(_norm(d) in declared for d in owners.get(mod, [mod]))}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


#: package -> the private names stabstudy uses, each to be named in a comment beside the package's
#: upper bound in pyproject.toml.
PRIVATE = {"river": ["_sum_increase", "_min_increase", "_x_mean"], "zclip": ["_compute_clip_val"],
           "torch": ["_get_file_writer", "_execution_engine", "_optimizer_step_pre_hooks", "_get_scale_async"]}


@pytest.mark.parametrize("package", sorted(PRIVATE))
def test_private_apis_in_use_have_an_upper_bound_that_names_them(package):
    code = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "stabstudy").rglob("*.py"))
    assert any(name in code for name in PRIVATE[package]), f"stabstudy no longer uses {package}'s private API: drop it here"
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(rf'((?:\s*#[^\n]*\n)+)\s*"{package}[^"]*"', text)
    assert m, f"no comment above {package}'s requirement"
    spec = next(Requirement(r) for r in PROJECT["dependencies"] + [r for v in EXTRAS.values() for r in v]
                if _norm(Requirement(r).name) == package)
    assert any(s.operator in ("<", "<=", "==", "~=") for s in spec.specifier), f"{spec} has no upper bound"
    for name in PRIVATE[package]:
        if name in code:
            assert name in m.group(1), f"the comment above {spec} must name {name}"


def _locks() -> dict[str, dict[str, str]]:
    return {f.name: deps.lock_entries(f.read_text(encoding="utf-8")) for f in (deps.RUNTIME, deps.DEV)}


def test_locks_are_hashed_without_torch_or_cuda_and_separate():
    locks = _locks()
    runtime, dev = locks["requirements.lock"], locks["requirements-dev.lock"]
    for name, entries in locks.items():
        assert entries, name
        assert all("--hash=sha256:" in e for e in entries.values()), f"{name}: an entry without a hash"
        assert "torch" not in entries, f"{name}: torch is installed by version first (Makefile), not locked"
        cuda = [k for k in entries if k.startswith(("nvidia-", "cuda-", "triton"))]
        assert not cuda, f"{name} pulls CUDA packages: {cuda}"
    assert not set(runtime) & set(dev), "the dev lock repeats runtime packages"
    assert {"pytest", "ruff"} <= set(dev) and not {"pytest", "ruff"} & set(runtime)


def test_locks_pin_every_declared_package_within_its_range():
    pins = {k: v.split("==", 1)[1].split()[0] for entries in _locks().values() for k, v in entries.items()}
    for spec in PROJECT["dependencies"] + [r for reqs in EXTRAS.values() for r in reqs]:
        req = Requirement(spec)
        name = _norm(req.name)
        if name in ("stabstudy", "torch"):
            continue
        assert name in pins, f"{name} is declared but in neither lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock pins {name}=={pins[name]}, outside {req}"


def test_make_install_puts_torch_first_by_its_exact_version_then_the_hashed_locks():
    out = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    pip = [line for line in out if " -m pip install" in line]
    assert f"--no-deps 'torch=={deps.torch_pin()}'" in pip[0]
    assert "--require-hashes -r requirements.lock -r requirements-dev.lock" in pip[1]
    assert "'.[study,dev]'" in pip[2]


def test_environment_yml_is_generated_from_pyproject():
    assert (ROOT / "environment.yml").read_text(encoding="utf-8") == deps.environment_yml(), \
        "environment.yml is stale: run `python tools/deps.py environment`"
    for pkg in ("statsmodels", "river", "ewstools", "zclip", "nbformat"):
        assert f"- {pkg}" in deps.environment_yml()
