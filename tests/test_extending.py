"""Extending the study as a user does: ``stabstudy new`` scaffolds an experiment that runs as generated,
and docs/extending.md, followed block by block in a temporary copy of the repository, ends in its row
of ``results/smoke/CLAIMS.md``.

The copies run the real commands (``stabstudy new``, ``study``, ``report``) in subprocesses with the
copy first on ``PYTHONPATH``; ``STABSTUDY_SCHEDULER=serial`` runs each grid in the notebook's kernel
(a LocalCluster's start-up would double the time; the cluster path is tests/test_notebooks.py's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from stabstudy.analysis.claims import VERDICTS
from stabstudy.run import scaffold, study
from stabstudy.run.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
BIN = Path(sys.executable).parent
#: A fenced block: ```lang key=value ...
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)


# -- a temporary copy of the repository --------------------------------------------------


def copy_repo(dst: Path) -> Path:
    """What ``stabstudy new``, ``study`` and ``report`` need of the checkout (no data, builds or results)."""
    skip = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints", "*.egg-info")
    for name in ("stabstudy", "notebooks", "tests", "docs"):
        shutil.copytree(ROOT / name, dst / name, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def repo_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("STABSTUDY_") and k not in ("PYTHONPATH", "MPLBACKEND")}
    env.update(PYTHONPATH=str(root), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               STABSTUDY_SCHEDULER="serial", PYTHONDONTWRITEBYTECODE="1")
    return env


def sh(cmd: str, root: Path, timeout: float = 600) -> str:
    """Run ``cmd`` in ``root`` with bash; fail with its output when it fails."""
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=root, env=repo_env(root), text=True,
                         capture_output=True, timeout=timeout)
    assert out.returncode == 0, f"`{cmd}` exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def claim_rows(root: Path, notebook: str, profile: str = "smoke") -> list[list[str]]:
    text = (root / "results" / profile / "CLAIMS.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(f"| {notebook} |")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


# -- the scaffold alone ----------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path):
    return copy_repo(tmp_path / "repo")


def test_new_refuses_a_taken_number_or_a_malformed_name_and_writes_nothing(capsys):
    before = tree(ROOT / "notebooks"), tree(ROOT / "stabstudy/run/profiles")
    for stem, why in [("00_probe", "clashes with 00_instrument_calibration"), ("7_probe", "must look like NN_name")]:
        assert main(["new", stem]) == 2, stem
        assert why in capsys.readouterr().err, stem
    assert (tree(ROOT / "notebooks"), tree(ROOT / "stabstudy/run/profiles")) == before


def test_new_refuses_a_checkout_whose_package_it_does_not_import(repo, monkeypatch):
    monkeypatch.setenv("STABSTUDY_ROOT", str(repo))  # this process imports the package of another checkout
    with pytest.raises(ValueError, match="not from the checkout"):
        scaffold.plan("07_probe")


def test_new_writes_the_six_pieces_and_refuses_a_taken_number_or_name(repo):
    written = scaffold.create("07_probe", root=repo)
    rel = sorted(p.relative_to(repo).as_posix() for p in written)
    assert rel == ["notebooks/07_probe.ipynb", "stabstudy/analysis/studies/probe.py",
                   "stabstudy/run/profiles/paper.yaml", "stabstudy/run/profiles/quick.yaml",
                   "stabstudy/run/profiles/smoke.yaml", "stabstudy/run/profiles/standard.yaml", "tests/test_study_probe.py"]
    for profile in study.PROFILES:
        assert "07_probe" in yaml_keys(repo, profile)
    snapshot = tree(repo)
    for stem, why in [("07_other", "clashes with 07_probe"), ("08_probe", "clashes with 07_probe"),
                      ("08_instrument_calibration", "clashes with 00_instrument_calibration"),
                      ("7_probe", "must look like NN_name"), ("08_Probe", "must look like NN_name"),
                      ("08_class", "must look like NN_name"), ("08_a__b", "must look like NN_name"),
                      ("08-probe", "must look like NN_name")]:
        with pytest.raises(ValueError, match=why):
            scaffold.create(stem, root=repo)
    (repo / "stabstudy/analysis/studies/calib.py").write_text('"""A module of that name."""\n')
    with pytest.raises(ValueError, match=r"studies/calib.py exists already"):
        scaffold.create("08_calib", root=repo)
    with open(repo / "stabstudy/run/profiles/quick.yaml", "a") as f:
        f.write("\n09_orphan:\n  seeds: [0]\n")
    with pytest.raises(ValueError, match=r"quick.yaml has an entry for '09_orphan'"):
        scaffold.create("09_orphan", root=repo)
    (repo / "stabstudy/analysis/studies/calib.py").unlink()
    snapshot["stabstudy/run/profiles/quick.yaml"] = (repo / "stabstudy/run/profiles/quick.yaml").read_bytes()
    assert tree(repo) == snapshot, "a refused `stabstudy new` wrote something"


def test_a_failed_write_leaves_nothing_half_written(repo, monkeypatch):
    before = tree(repo)
    real, calls = scaffold._write_atomic, []

    def flaky(path, text):
        calls.append(path)
        if len(calls) == 4:  # after the notebook, the module, the test: the first profile
            raise OSError("disk full")
        real(path, text)

    monkeypatch.setattr(scaffold, "_write_atomic", flaky)
    with pytest.raises(OSError, match="disk full"):
        scaffold.create("07_probe", root=repo)
    assert tree(repo) == before


def test_the_generated_notebook_follows_the_notebook_rules(repo):
    scaffold.create("07_probe", root=repo)
    nb = json.loads((repo / "notebooks/07_probe.ipynb").read_text())
    tags = [t for c in nb["cells"] for t in c["metadata"].get("tags", [])]
    assert tags == ["question", "parameters", "setup", "grid", "figure", "claims"]
    assert not [c for c in nb["cells"] if c.get("outputs") or c.get("execution_count")]
    from test_notebooks import notebook_parameters

    params = notebook_parameters(repo / "notebooks/07_probe.ipynb")
    assert {"seeds", *study.INJECTED} <= set(params)  # papermill warns of an undeclared parameter on every run
    for profile in study.PROFILES:
        assert set(yaml_keys(repo, profile)["07_probe"]) <= set(params), profile
    src = "".join("".join(c["source"]) for c in nb["cells"])
    assert "run_grid(" in src and "claims.save(" in src and "plots.savefig(" in src and "$" not in src
    assert scaffold.notebook_json(scaffold._template("notebook.py.tmpl").substitute(
        notebook="07_probe", number="07", name="probe", module="probe", title="Probe")) == \
        (repo / "notebooks/07_probe.ipynb").read_text(), "the same name must scaffold the same bytes"


def yaml_keys(root: Path, profile: str) -> dict:
    import yaml

    return yaml.safe_load((root / "stabstudy/run/profiles" / f"{profile}.yaml").read_text())


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.notebook
def test_a_scaffolded_experiment_runs_as_generated_and_reaches_claims_md(repo):
    """`stabstudy new`, then the new test stub and the repository's checks, the smoke study and the report."""
    sh("stabstudy new 07_spike_check", repo)
    sh("ruff check stabstudy tests && python -m pytest -q -p no:cacheprovider -m 'not notebook' "
       "tests/test_study_spike_check.py tests/test_architecture.py tests/test_notebooks.py "
       "tests/test_notebook_text.py", repo)
    sh("stabstudy study --profile smoke --only 07 && stabstudy report --profile smoke", repo)
    rows = claim_rows(repo, "07_spike_check")
    assert len(rows) == 1 and rows[0][2] == "an lr spike of x300 lowers the final test accuracy", rows
    assert rows[0][10].strip("*") in VERDICTS
    assert list((repo / "results/smoke/figures/07_spike_check").glob("*.png"))


# -- docs/extending.md, block by block -----------------------------------------------------


@dataclass(frozen=True)
class Block:
    lang: str
    attrs: dict[str, str]
    body: str
    line: int


def blocks(path: Path = DOC) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang, *rest = m["info"].split() or [""]
        attrs = dict(kv.split("=", 1) for kv in rest)
        out.append(Block(lang, attrs, m["body"], text.count("\n", 0, m.start()) + 1))
    return out


def set_cell(root: Path, notebook: str, tag: str, source: str) -> None:
    f = root / "notebooks" / f"{notebook}.ipynb"
    nb = json.loads(f.read_text())
    cells = [c for c in nb["cells"] if tag in c["metadata"].get("tags", [])]
    assert len(cells) == 1, f"{notebook} has {len(cells)} cells tagged {tag!r}"
    cells[0]["source"] = source.rstrip("\n")
    f.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def set_profile_entry(root: Path, profile: str, notebook: str, entry: str) -> None:
    f = root / "stabstudy/run/profiles" / f"{profile}.yaml"
    text, new = f.read_text(), entry.rstrip("\n") + "\n"
    block = re.compile(rf"^{re.escape(notebook)}:.*\n(?:[ #].*\n|\n)*", re.M)
    assert block.search(text), f"{profile}.yaml has no entry {notebook}"
    f.write_text(block.sub(lambda _: new, text if text.endswith("\n") else text + "\n", count=1))


def follow(block: Block, root: Path) -> str:
    """Do what ``block`` asks of a reader, in ``root``; return what a command printed."""
    a = block.attrs
    if block.lang == "bash" and not a:
        return sh(block.body, root)
    if block.lang == "python" and set(a) == {"file"}:
        (root / a["file"]).write_text(block.body)
        return ""
    if block.lang in ("python", "markdown") and set(a) == {"notebook", "cell"}:
        set_cell(root, a["notebook"], a["cell"], block.body)
        return ""
    if block.lang == "yaml" and set(a) == {"profile", "notebook"}:
        set_profile_entry(root, a["profile"], a["notebook"], block.body)
        return ""
    if block.lang == "python" and not a:
        script = root / "build" / f"doc_block_{block.line}.py"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(block.body)
        return sh(f"python {script}", root)
    raise AssertionError(f"docs/extending.md line {block.line}: no rule runs a ```{block.lang} "
                         f"{' '.join(f'{k}={v}' for k, v in a.items())} block")


def test_every_block_of_the_guide_has_a_rule():
    found = blocks()
    assert len(found) >= 10
    kinds = {(b.lang, tuple(sorted(b.attrs))) for b in found}
    known = {("bash", ()), ("python", ("file",)), ("python", ("cell", "notebook")), ("markdown", ("cell", "notebook")),
             ("yaml", ("notebook", "profile")), ("python", ())}
    assert kinds <= known, kinds - known


def runs_of_scripts(found: list[Block]) -> list[Block]:
    """``found`` with each run of consecutive plain ```python blocks joined into one script, as a reader
    pasting them into one session would run them (one interpreter start instead of several)."""
    out: list[Block] = []
    for b in found:
        if out and b.lang == "python" and not b.attrs and out[-1].lang == "python" and not out[-1].attrs:
            out[-1] = Block("python", {}, out[-1].body + "\n\n" + b.body, out[-1].line)
        else:
            out.append(b)
    return out


@pytest.mark.notebook
def test_the_guide_followed_block_by_block_ends_in_its_claims_row(repo):
    printed = [follow(b, repo) for b in runs_of_scripts(blocks())]
    rows = claim_rows(repo, "07_warmup_dose")
    assert len(rows) == 1, rows
    assert rows[0][2].startswith("a longer lr warmup lowers the critical lr-spike dose"), rows
    assert rows[0][10].strip("*") in VERDICTS and int(rows[0][6]) <= 3, rows  # at most the three seeds paired
    assert any("07_warmup_dose" in p for p in printed)  # the guide's last command shows the row


def test_list_for_one_domain_shows_only_what_its_experiments_can_use(capsys):
    assert main(["list", "--domain", "toy"]) == 0
    out = capsys.readouterr().out
    assert "`adam`" in out and "digits" in out and "`ppo`" not in out  # learners and tasks
    assert "`lr_spike`" in out and "`outlier_batch`" in out and "`reward_scale`" not in out  # kinds
    assert "`test_loss`" in out and "`lambda_max`" in out and "`entropy`" not in out  # channels
    assert "`warmup`" in out and "GPTHParams" not in out  # hyperparameters
    assert main(["list", "--domain", "seq", "channels"]) == 0
    out = capsys.readouterr().out
    assert "`clipped`" in out and "`precond_sharpness`" not in out  # no curvature probe in seq runs
    assert main(["list", "--domain", "tyo"]) == 2
    assert "valid domains: toy, rl, lm, seq" in capsys.readouterr().err
