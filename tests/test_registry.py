"""One registry: the CLI, the docs, spec validation and the learners read the same tables."""

import dataclasses
from pathlib import Path

import pytest

from stabstudy import hparams, registry
from stabstudy.run import catalog
from stabstudy.run.cli import main
from stabstudy.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
CLASSES = sorted({c for d in registry.DOMAINS.values() for c in d.learners.values()}, key=lambda c: c.__name__)


def test_docs_are_generated_from_the_registry():
    assert (ROOT / "docs" / "registry.md").read_text() == catalog.markdown() + "\n", \
        "docs/registry.md is stale: run `.venv/bin/stabstudy list > docs/registry.md`"


def test_cli_lists_sections(capsys):
    assert main(["list", "kinds"]) == 0
    out = capsys.readouterr().out
    assert all(f"`{k}`" in out for k in registry.KINDS) and "## Channels" not in out
    assert main(["list", "bogus"]) == 2
    assert "valid: domains, kinds, channels, hparams" in capsys.readouterr().err


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_hyperparameter_has_a_one_line_doc(cls):
    docs = hparams.field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{cls.__name__}: fields without a docstring: {missing}"
    assert all("\n" not in d for d in docs.values())


@pytest.mark.parametrize("domain, learner, hp, match", [
    ("toy", "gd", {"lrr": 0.1}, r"unknown hyperparameter\(s\) \['lrr'\] for toy learner 'gd'; valid: .*\blr\b"),
    ("toy", "gd", {"lr": "0.1"}, r"'lr' of toy learner 'gd' must be float, got '0.1'"),
    ("toy", "gd", {"width": 64.0}, r"'width' of toy learner 'gd' must be int"),
    ("toy", "gd", {"activation": "swish"}, r"must be one of 'tanh', 'relu', 'elu', 'gelu'"),
    ("lm", "gpt", {"qk_layernorm": 1}, r"'qk_layernorm' .* must be bool"),
    ("rl", "sac", {"ent_coef": "fixed"}, r"must be float or one of 'auto'"),
    ("rl", "ppo", {"policy_delay": 2}, r"unknown hyperparameter\(s\) \['policy_delay'\] for rl learner 'ppo'"),
])
def test_a_bad_hyperparameter_fails_when_the_spec_is_built(domain, learner, hp, match):
    with pytest.raises(ValueError, match=match):
        RunSpec(domain, learner, "x", 10, 0, hparams=hp)


def test_valid_hyperparameters_pass_and_are_stored_as_given():
    s = RunSpec("rl", "sac", "Pendulum-v1", 10, 0, hparams={"ent_coef": "auto", "lr": 1})
    assert s.hp == {"ent_coef": "auto", "lr": 1}  # ints pass for floats and stay ints: the hash is unchanged
    assert hparams.merged(hparams.SACHParams, s.hp, "sac")["hidden"] == 256
