import pickle

import numpy as np
import pytest

from stabstudy.interventions.perturb import KINDS, Perturbation, Schedule, check_kind
from stabstudy.registry import LEARNERS
from stabstudy.spec import RunSpec


def spec(**kw):
    base = dict(domain="rl", learner="ppo", task="HalfCheetah-v5", steps=10_000, seed=0,
                hparams={"lr": 3e-4, "hidden": 64},
                perturbations=(Perturbation("lr_spike", start=2000, duration=100, dose=10.0),))
    base.update(kw)
    return RunSpec(**base)


def test_hash_is_stable_and_content_keyed():
    a, b = spec(), spec()
    assert a.spec_hash == b.spec_hash and len(a.spec_hash) == 16
    # dict order does not matter, values do
    assert spec(hparams={"hidden": 64, "lr": 3e-4}).spec_hash == a.spec_hash
    assert spec(seed=1).spec_hash != a.spec_hash
    assert spec(hparams={"lr": 1e-3, "hidden": 64}).spec_hash != a.spec_hash
    assert spec(perturbations=()).spec_hash != a.spec_hash
    # the hash is of the canonical JSON, so it survives a round trip and pickling (Dask)
    assert RunSpec.from_json(a.to_json()) == a
    assert pickle.loads(pickle.dumps(a)).spec_hash == a.spec_hash


def test_equality_follows_the_hash():
    """1 == 1.0 in Python, but the canonical JSON (and so the store) tells them apart:
    equal specs must be the ones the store treats as one run."""
    ints, floats = (spec(hparams={"lr": v}) for v in (1, 1.0))
    assert ints.spec_hash != floats.spec_hash
    assert ints != floats and len({ints, floats}) == 2
    assert spec() == spec() and len({spec(), spec()}) == 1
    assert spec() != spec().to_dict()


def test_numpy_values():
    assert spec(hparams={"lr": np.float32(0.5), "hidden": np.int64(3)}).hp == {"lr": 0.5, "hidden": 3}
    # sequences (perturbation params) stay lists, whatever their length
    layer = {"layers": np.array([64])}
    assert Perturbation("reinit_layer", 0, params=layer).p == {"layers": [64]}
    assert Perturbation("reinit_layer", 0, params=layer) == Perturbation("reinit_layer", 0, params={"layers": [64]})


def test_hash_is_pinned():
    # A change to the canonical form silently orphans every stored run: make it loud.
    s = RunSpec("toy", "gd", "digits", 100, 0, {"lr": 0.1})
    assert s.spec_hash == "8cffb4a43bec0f25"
    assert s.to_json() == ('{"curvature_every":0,"domain":"toy","eval_every":0,"hparams":{"lr":0.1},'
                           '"learner":"gd","log_every":1,"perturbations":[],"seed":0,"steps":100,"task":"digits"}')


def test_hparams_views_and_replace():
    s = spec()
    assert s.hp == {"lr": 3e-4, "hidden": 64}
    assert s.get("missing", 5) == 5
    r = s.replace(hparams={"lr": 1e-3})
    assert r.hp == {"lr": 1e-3, "hidden": 64}
    assert s.label.startswith("ppo/HalfCheetah-v5 s0 lr_spike x10@2000")


@pytest.mark.parametrize("kw, match", [
    (dict(domain="vision"), "valid domains: toy, rl, lm"),
    (dict(learner="dqn"), "valid learners: ppo, sac, td3, a2c, ddpg"),
    (dict(steps=-5), "steps must be positive"),
    (dict(steps=0), "steps must be positive"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(log_every=0), "log_every"),
    (dict(perturbations=(Perturbation("lr_spike", 9_990, duration=100),)), "outside the run"),
    (dict(perturbations=(Perturbation("outlier_batch", 10),)), "kinds valid for 'rl'"),
    (dict(hparams={"lr": float("nan")}), "finite"),
    (dict(task=""), "task"),
])
def test_invalid_specs_name_the_valid_choices(kw, match):
    with pytest.raises(ValueError, match=match):
        spec(**kw)


def test_invalid_types():
    # ValueError, as for every other bad input (the README promises it)
    with pytest.raises(ValueError, match="steps must be an int, got float 10.5"):
        spec(steps=10.5)
    with pytest.raises(ValueError, match="steps must be an int, got float 10.0"):
        spec(steps=np.float64(10))  # a numpy float is a float, as 10.0 is
    with pytest.raises(ValueError, match="hyperparameter values must be str, int, float, bool, None"):
        spec(hparams={"f": object()})


TOY = dict(domain="toy", learner="gd", task="digits", steps=100, seed=0)


@pytest.mark.parametrize("kw, match", [
    (dict(hparams={"lr": -1.0}), r"'lr' of toy learner 'gd' must be float > 0, got -1.0"),
    (dict(hparams={"lr": 0}), r"'lr' of toy learner 'gd' must be float > 0, got 0"),
    (dict(hparams={"beta2": 1.0}), r"'beta2' .* must be float in \[0, 1\), got 1.0"),
    (dict(hparams={"width": 0}), r"'width' .* must be int >= 1, got 0"),
    (dict(hparams={"batch_size": -1}), r"'batch_size' .* must be int >= 0, got -1"),
    (dict(hparams={"curv_tol": -1e-3}), r"'curv_tol' .* must be float >= 0"),
    (dict(domain="lm", learner="gpt", task="stdlib", hparams={"dropout": 1.0}), r"'dropout' .* in \[0, 1\)"),
    (dict(domain="rl", learner="sac", task="Pendulum-v1", hparams={"ent_coef": -0.1}),
     r"'ent_coef' of rl learner 'sac' must be float >= 0 or one of 'auto'"),
    (dict(domain="rl", learner="ppo", task="Pendulum-v1", hparams={"gamma": 1.5}), r"'gamma' .* in \[0, 1\]"),
    (dict(domain="seq", learner="lstm", task="adding", hparams={"T": 0}), r"'T' of seq learner 'lstm' must be int >= 1"),
    (dict(task="mnist"), r"unknown toy task 'mnist'; valid tasks: digits, synthetic"),
    (dict(domain="seq", learner="lstm", task="adding_problem"), r"unknown seq task .*valid tasks: adding; did you mean 'adding'\?"),
    (dict(domain="rl", learner="ppo", task="Pendulm-v1"),
     r"unknown gymnasium environment 'Pendulm-v1' .*did you mean 'Pendulum-v1'"),
    (dict(domain="lm", learner="gpt", task="stdlb"), r"unknown lm task 'stdlb': use 'stdlib' or the path of a text file; "
                                                     r"did you mean 'stdlib'\?"),
])
def test_impossible_values_and_unknown_tasks_fail_when_the_spec_is_built(kw, match):
    with pytest.raises(ValueError, match=match):
        RunSpec(**{**TOY, **kw})


def test_a_text_file_path_is_an_lm_task(tmp_path):
    f = tmp_path / "corpus"
    f.write_text("hello")
    assert RunSpec("lm", "gpt", str(f), 10, 0).task == str(f)  # a file here, whatever its name
    assert RunSpec("lm", "gpt", "elsewhere/corpus.txt", 10, 0).task  # reads as a path: checked where it runs


def test_numpy_scalars_and_tensors_are_treated_alike():
    torch = pytest.importorskip("torch")
    ref = RunSpec(**TOY, hparams={"lr": 0.5, "width": 8})
    for steps, lr, width in [(np.int64(100), np.float64(0.5), np.int64(8)),
                             (torch.tensor(100), torch.tensor(0.5, dtype=torch.float64), torch.tensor(8)),
                             (np.int32(100), torch.tensor(0.5, requires_grad=True), np.array(8))]:
        s = RunSpec(**{**TOY, "steps": steps}, hparams={"lr": lr, "width": width})
        assert s.spec_hash == ref.spec_hash and s == ref
        assert type(s.steps) is int and s.hp == {"lr": 0.5, "width": 8}
    # an impossible value is a ValueError naming the field and the range, whatever holds it
    for bad in (-1.0, np.float64(-1.0), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match=r"'lr' of toy learner 'gd' must be float > 0"):
            RunSpec(**TOY, hparams={"lr": bad})
    with pytest.raises(ValueError, match="steps must be positive"):
        RunSpec(**{**TOY, "steps": torch.tensor(0)})
    with pytest.raises(ValueError, match=r"'width' .* must be int"):
        RunSpec(**TOY, hparams={"width": torch.tensor(8.0)})  # a float tensor is a float, as 8.0 is
    p = Perturbation("lr_spike", np.int64(3), torch.tensor(2), dose=torch.tensor(10.0))
    assert p == Perturbation("lr_spike", 3, 2, dose=10.0) and type(p.start) is int and type(p.dose) is float


def test_perturbation_validation():
    with pytest.raises(ValueError, match="valid kinds: .*lr_spike"):
        Perturbation("lr_spik", 1)
    with pytest.raises(ValueError, match="start"):
        Perturbation("lr_spike", -1)
    with pytest.raises(ValueError, match="duration"):
        Perturbation("lr_spike", 1, duration=0)
    with pytest.raises(ValueError, match="dose"):
        Perturbation("lr_spike", 1, dose=-2)
    p = Perturbation.from_dict({"kind": "reinit_layer", "start": 3, "params": {"layer": "0"}})
    assert p.p == {"layer": "0"} and p.dimension == "parametric" and p.end == 4


def test_every_kind_has_a_dimension_and_domain():
    for name, k in KINDS.items():
        assert k.dimension in ("optimization", "environment-data", "parametric", "learning-signal"), name
        assert set(k.domains) <= set(LEARNERS)
    with pytest.raises(ValueError, match="does not apply to domain 'lm'"):
        check_kind("reward_scale", "lm")


def test_schedule_windows():
    sched = Schedule([Perturbation("lr_spike", 5, duration=3, dose=10.0),
                      Perturbation("lr_spike", 6, duration=1, dose=2.0),
                      Perturbation("weight_noise", 8, dose=0.1)])
    assert [sched.lr_factor(s) for s in range(4, 10)] == [1.0, 10.0, 20.0, 10.0, 1.0, 1.0]
    assert sched.mask(range(4, 10)).tolist() == [0, 1, 1, 1, 1, 0]
    assert [p.kind for p in sched.starts_at(8)] == ["weight_noise"]
    assert sched.of_kind("weight_noise", 9) is None
