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
    ("toy", "gd", {"lr": "0.1"}, r"'lr' of toy learner 'gd' must be float > 0, got '0.1'"),
    ("toy", "gd", {"width": 64.0}, r"'width' of toy learner 'gd' must be int >= 1"),
    ("toy", "gd", {"activation": "swish"}, r"must be one of 'tanh', 'relu', 'elu', 'gelu'"),
    ("lm", "gpt", {"qk_layernorm": 1}, r"'qk_layernorm' .* must be bool"),
    ("rl", "sac", {"ent_coef": "fixed"}, r"must be float >= 0 or one of 'auto'"),
    ("rl", "ppo", {"policy_delay": 2}, r"unknown hyperparameter\(s\) \['policy_delay'\] for rl learner 'ppo'"),
])
def test_a_bad_hyperparameter_fails_when_the_spec_is_built(domain, learner, hp, match):
    with pytest.raises(ValueError, match=match):
        RunSpec(domain, learner, "x", 10, 0, hparams=hp)  # the hyperparameters are checked before the task


def test_valid_hyperparameters_pass_and_are_stored_as_given():
    s = RunSpec("rl", "sac", "Pendulum-v1", 10, 0, hparams={"ent_coef": "auto", "lr": 1})
    assert s.hp == {"ent_coef": "auto", "lr": 1}  # ints pass for floats and stay ints: the hash is unchanged
    assert hparams.merged(hparams.SACHParams, s.hp, "sac")["hidden"] == 256


# -- channels: the registry is their one source --------------------------------------------------

TOY = {"width": 16, "depth": 1, "n_train": 128, "n_test": 64}
LM = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, corpus_bytes=200_000, warmup=5, device="cpu")
RL = {"ppo": dict(hidden=16, n_steps=64, batch_size=32, n_epochs=2, eval_episodes=1, eval_max_steps=50),
      "sac": dict(hidden=16, batch_size=32, learning_starts=50, eval_episodes=1, eval_max_steps=50, diag_every=5)}
#: Small runs of every learner, with every optional channel group switched on (curvature, a
#: controller, the precision channels, several LM layers, SAC's three optimizers).
SMOKE = {
    "toy_adam": lambda: RunSpec("toy", "adam", "digits", 12, 0, hparams={**TOY, "controller": "z_skip"},
                                curvature_every=5),
    "toy_gd": lambda: RunSpec("toy", "gd", "synthetic", 6, 0, hparams=TOY),
    "lm": lambda: RunSpec("lm", "gpt", "stdlib", 12, 0, hparams={**LM, "controller": "z_skip", "grad_scaler": True},
                          curvature_every=5),
    "seq": lambda: RunSpec("seq", "lstm", "adding", 8, 0, hparams={"T": 8, "hidden": 8, "batch_size": 16,
                                                                   "eval_size": 32}),
    "rl_ppo": lambda: RunSpec("rl", "ppo", "Pendulum-v1", 160, 0, hparams={**RL["ppo"], "controller": "z_skip"},
                              eval_every=64),
    "rl_sac": lambda: RunSpec("rl", "sac", "Pendulum-v1", 120, 0, hparams={**RL["sac"], "controller": "z_skip"},
                              eval_every=64),
}


def _profiles():
    import xarray as xr

    from stabstudy.learners import depth, seq
    arrays = [depth.depth_profiles([1.0], 3, 4, [0]), depth.gpt_block_grad_norms([1], [0], n_embd=16, n_head=2),
              seq.time_profiles(["lstm"], [1.0], 3, [0], hidden=4, batch=2)]
    return xr.Dataset({a.name: a for a in arrays})


@pytest.mark.parametrize("name", [*SMOKE, "depth"])
def test_every_variable_of_every_learners_dataset_is_registered_and_described_by_it(name):
    ds = _profiles() if name == "depth" else registry.learner_for(SMOKE[name]().domain)(SMOKE[name]())
    unknown = sorted(str(v) for v in ds.data_vars if registry.channel(str(v)) is None)
    assert not unknown, f"{name}: variables the registry does not name: {unknown}"
    if name == "depth":
        return
    for v in ds.data_vars:
        ch, which = registry.channel(str(v))
        assert ds[v].attrs["units"] == ch.unit and ds[v].attrs["long_name"].startswith(ch.meaning), v
        assert ds.sizes["step"] and (which == "" or ds[v].attrs["long_name"].endswith(f"({which})"))
    if name.startswith("rl"):  # the callbacks' always-carried channels, before the store adds the shared ones
        assert set(registry.channel_names(source="rl", always=True)) <= set(ds.data_vars)


def test_channel_lookup_knows_the_families_and_nothing_else():
    assert registry.channel("grad_norm_raw")[0].name == "grad_norm_raw"  # its own channel, not grad_norm's family
    assert registry.channel("grad_norm_critic") == (registry.CHANNELS["grad_norm"], "critic")
    assert registry.channel("attn_logit_max_l3") == (registry.CHANNELS["attn_logit_max"], "layer 3")
    assert registry.long_name("lr_actor") == registry.CHANNELS["lr"].meaning + " (actor)"
    for name in ("loss_actor", "attn_logit_max_lx", "grad_norm_mine", "bogus"):
        assert registry.channel(name) is None and registry.long_name(name) == name
    assert registry.channel("grad_norm_mine", optimizers=("mine",))[1] == "mine"
    with pytest.raises(ValueError, match="unknown channel source 'sensors'; valid: learner, optimizer"):
        registry.channel_names(source="sensors")
    assert all(c.source in registry.SOURCES and set(c.domains) <= {*registry.DOMAINS, *registry.PROFILES}
               for c in registry.CHANNELS.values())


def test_the_instruments_lists_are_the_registrys():
    from stabstudy.instruments.curvature import CURVATURE_CHANNELS
    from stabstudy.instruments.telemetry import LONG_NAMES, OPT_CHANNELS
    from stabstudy.learners import lm
    from stabstudy.learners.rl.recorder import RL_CHANNELS

    assert OPT_CHANNELS == ("grad_norm", "grad_norm_applied", "xgrad", "update_norm", "update_ratio", "update_grad_cos", "adam_m_norm",
                            "adam_v_mean", "adam_eps_frac", "lr")
    assert CURVATURE_CHANNELS[0] == "lambda_max" and "precond_sharpness" in CURVATURE_CHANNELS
    assert lm.PRECISION_CHANNELS == ("nonfinite_grads", "loss_scale", "skipped_step", "lost_update_frac",
                                     "fp16_headroom", "adam_state_nonfinite")
    assert RL_CHANNELS == ("perf", "episode_return", "entropy", "approx_kl", "clip_fraction", "value_loss", "q_mean",
                           "action_saturation", "loss")
    assert LONG_NAMES is registry.LONG_NAMES and registry.SHARED_CHANNELS[:2] == ("loss", "perf")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_default_lies_in_its_declared_range(cls):
    hparams.validate(cls, hparams.defaults(cls), cls.__name__)


def test_ranges_are_declared_once_in_the_annotations():
    """Validation and the docs read the range from the field's annotation, nowhere else."""
    ann = hparams.annotations(hparams.ToyHParams)
    assert hparams.describe(ann["lr"]) == "float > 0" and hparams.describe(ann["beta2"]) == "float in [0, 1)"
    assert hparams.describe(hparams.annotations(hparams.SACHParams)["ent_coef"]) == "float >= 0 or one of 'auto'"
    assert "| `lr` | `0.05` | float > 0 | learning rate |" in catalog.markdown(("hparams",))
    r = hparams.Range(0, 1, lo_open=True)
    assert 1 in r and 0.5 in r and 0 not in r and 1.5 not in r and str(r) == "in (0, 1]"


def test_a_monitors_own_dataset_takes_long_names_and_units_from_the_registry():
    import torch

    from stabstudy.instruments.telemetry import Monitor

    net = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    mon = Monitor(net, opt)
    for _ in range(3):
        opt.zero_grad()
        loss = net(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        opt.step()
        mon.log(loss=float(loss.detach()), my_metric=1.0)
    ds = mon.to_dataset()
    mon.close()
    for ch in ("grad_norm", "adam_v_mean", "loss", "lr"):
        assert ds[ch].attrs == {"long_name": registry.CHANNELS[ch].meaning, "units": registry.CHANNELS[ch].unit}
    assert ds["my_metric"].attrs == {"long_name": "my_metric"}  # a user's channel: named, no unit invented
