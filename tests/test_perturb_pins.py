"""Pins: short toy, LM and sequence runs with every perturbation kind of their domain, bit for bit.

A refactoring of how the learners apply perturbations must leave every stored run as it was
(the runner reuses stored runs by spec hash). These runs put each kind of the domain in one
schedule (two kinds at one step too, so that the order of their random draws counts) and
compare the sha256 of every recorded array, and the spec hash, with the values recorded
before the refactoring. One torch thread: the thread count changes float rounding in torch's
CPU kernels (measured: the toy Adam and LM digests differ between one and two threads).

The processor changes the last bits too (measured 2026-12-06: all six digests recorded on an AMD
EPYC differ on an Intel Xeon with AVX-512, same wheels, and no ``ATEN_CPU_CAPABILITY``,
``MKL_CBWR`` or ``ONEDNN_MAX_CPU_ISA`` setting brings them back), so the digests are kept per
processor (vendor and torch's CPU capability). Within one capability the CPU model can matter
too (measured 2026-12-07: on an Intel Xeon of model 106, without ``avx512_bf16``, the ``lm`` run,
whose perturbations include a switch to bfloat16, differs from the 2026-12-06 Xeon's digest; the
other five are equal), so a ``vendor/capability/model`` entry, where recorded, wins over the
``vendor/capability`` one. The spec hashes hold on every machine. On a processor with no digests
the digest check is skipped, naming the ones recorded; record them with ``python
tests/test_perturb_pins.py`` at a commit where the pins pass elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import platform

import numpy as np
import pytest
import torch

from stabstudy.registry import learner_for
from stabstudy.run.costs import cpuinfo
from stabstudy.spec import Perturbation as P
from stabstudy.spec import RunSpec

TOY = {"width": 16, "depth": 1, "n_train": 128, "n_test": 64}
LM = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, corpus_bytes=200_000, warmup=5, device="cpu")
SEQ = {"T": 10, "hidden": 8, "batch_size": 16, "eval_size": 32}

SPECS = {
    "toy_adam": RunSpec("toy", "adam", "digits", 24, 0, hparams={**TOY, "lr": 0.01}, perturbations=(
        P("lr_spike", 2, 2, 3.0), P("beta2_shift", 3, 3, 0.9), P("grad_noise", 5, 2, 0.5),
        P("weight_noise", 8, 1, 0.1), P("reinit_layer", 8, 1, 0.5), P("outlier_batch", 8, 2, 0.25),
        P("loss_scale", 11, 2, 4.0), P("lr_ramp", 14, 4, 5.0), P("reinit_layer", 20, 1, 1.0, {"layer": "layers.1"}))),
    "toy_sgd": RunSpec("toy", "sgd", "synthetic", 20, 1, hparams={**TOY, "lr": 0.05, "batch_size": 32}, perturbations=(
        P("outlier_batch", 3, 3, 0.5), P("weight_noise", 4, 1, 0.2), P("grad_noise", 4, 2, 1.0),
        P("lr_spike", 6, 1, 10.0), P("beta2_shift", 9, 2, 0.5))),
    "lm": RunSpec("lm", "gpt", "stdlib", 20, 0, hparams=LM, eval_every=10, perturbations=(
        P("no_warmup", 0, 1), P("lr_spike", 2, 2, 3.0), P("beta2_shift", 3, 3, 0.99), P("grad_noise", 5, 2, 0.5),
        P("weight_noise", 8, 1, 0.1), P("reinit_layer", 8, 1, 0.5), P("outlier_batch", 8, 2, 0.25),
        P("loss_scale", 11, 2, 4.0), P("lr_ramp", 13, 3, 2.0),
        P("precision_switch", 16, 2, 1.0, {"dtype": "bfloat16"}))),
    "lm_clip": RunSpec("lm", "gpt", "stdlib", 12, 1, hparams={**LM, "grad_clip": 1.0}, eval_every=6, perturbations=(
        P("outlier_batch", 2, 2, 1.0, {"token": 7}), P("reinit_layer", 4, 1, 1.0, {"layer": "blocks.0.mlp"}),
        P("lr_spike", 6, 3, 10.0))),
    "seq_lstm": RunSpec("seq", "lstm", "adding", 20, 0, hparams={**SEQ, "optimizer": "adam"}, perturbations=(
        P("lr_spike", 3, 2, 5.0), P("weight_noise", 6, 1, 0.3), P("reinit_layer", 9, 1, 0.5),
        P("reinit_layer", 12, 1, 1.0, {"layer": "head"}))),
    "seq_rnn": RunSpec("seq", "rnn_tanh", "adding", 12, 2, hparams={**SEQ, "T": 8, "grad_clip": 0.5},
                       perturbations=(P("lr_spike", 2, 3, 4.0), P("weight_noise", 5, 1, 0.5))),
}

#: name -> spec hash, the same on every machine.
SPEC_HASHES = {
    "toy_adam": "47d65d7ad31006f9",
    "toy_sgd": "9c247ba7c2fd9c14",
    "lm": "46e5527b87ab6eb2",
    "lm_clip": "6d14b4152b5a483f",
    "seq_lstm": "35dd484c09aba209",
    "seq_rnn": "b2a84ac9518718e2",
}

#: processor (:func:`processor`) -> name -> digest of every array. The AMD EPYC's were recorded before
#: the perturbation skeleton was shared (2026-12-01, its capability not recorded then); on 2026-12-07 at
#: 885ba8c an EPYC of model 2 with AVX-512 gave all eight of them again, so they are keyed to it (they
#: were keyed to a guessed AVX2, and that machine skipped). The Intel Xeon's on 2026-12-06 at edb4e1e,
#: whose learners are those with which the EPYC's pins last passed in CI. An EPYC of model 17 gave all
#: eight again on 2026-12-07 (after issues 43-47 merged), so they are keyed to AMD with AVX-512, any model.
PINS = {
    "AuthenticAMD/AVX512": {
        "toy_adam": "f14346dbe2017ebb",
        "toy_sgd": "c9bebe465a1b5f43",
        "lm": "d9840cdadd476736",
        "lm_clip": "b6e206722cd824eb",
        "seq_lstm": "5cfe7724f7156472",
        "seq_rnn": "ad5ef82c2f0296c6",
    },
    "GenuineIntel/AVX512/106": {"lm": "bf976e9e267433c0"},  # recorded 2026-12-07, learners as at 91f4a6d
    "GenuineIntel/AVX512": {
        "toy_adam": "9362252126d0e113",
        "toy_sgd": "6f5229ca8535eac8",
        "lm": "41ad1bd52d0c1e84",
        "lm_clip": "ce97303f692c56ea",
        "seq_lstm": "9c83d40eb28b37c6",
        "seq_rnn": "4d425423bc3e09eb",
    },
}

#: Arrays added after the pins above were recorded: name -> their names, and per processor their digest.
#: The pins stay those of the arrays recorded before, so that an added channel cannot hide a change to an old one.
ADDED = {"toy_adam": ("out_logit_max", "last_weight_norm"), "toy_sgd": ("out_logit_max", "last_weight_norm")}
ADDED_PINS = {
    "AuthenticAMD/AVX512": {"toy_adam": "238278b46abc39a0", "toy_sgd": "0fbfde5ab5651cde"},
    "GenuineIntel/AVX512": {"toy_adam": "1710741963df9c81", "toy_sgd": "37c4c7b39ee635ca"},
}


#: Added with the Monitor's norm before clipping (issue 46): every run but seq's (which recorded its own).
#: Its digests are pinned where recorded (an EPYC of model 17, 2026-12-07; elsewhere record them with
#: ``python tests/test_perturb_pins.py``); everywhere it must equal grad_norm where nothing changed the
#: gradient between backward() and the step.
RAW = "grad_norm_raw"
RAW_ADDED = ("toy_adam", "toy_sgd", "lm", "lm_clip")
RAW_PINS: dict[str, dict[str, str]] = {
    "AuthenticAMD/AVX512": {"toy_adam": "a08545fd630fdcaa", "toy_sgd": "5bbb50376d4e3536", "lm": "9292d83cd2e85e49",
                            "lm_clip": "7d0ffed3013bdb34"},
}


def processor() -> str:
    """``vendor/capability/model``: the CPU vendor, the kernels torch dispatches to and the CPU model."""
    vendor = cpuinfo("vendor_id") or platform.processor() or platform.machine()
    return f"{vendor}/{torch.backends.cpu.get_cpu_capability()}/{cpuinfo('model') or 'unknown'}"


def pin(table: dict[str, dict[str, str]], name: str) -> str | None:
    """This processor's digest of ``name`` in ``table``: its model's entry first, else its capability's."""
    here = processor()
    for key in (here, here.rsplit("/", 1)[0]):
        if name in table.get(key, {}):
            return table[key][name]
    return None


def digest(ds) -> str:
    """sha256 over every data variable and coordinate's float64 bytes (wall times left out), with the names."""
    parts = {k: hashlib.sha256(np.ascontiguousarray(ds[k].values.astype(np.float64)).tobytes()).hexdigest()
             for k in sorted({*ds.data_vars, *ds.coords}) if not k.endswith("_cost_s")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_spec_hashes_are_pinned():
    assert {name: spec.spec_hash for name, spec in SPECS.items()} == SPEC_HASHES


@pytest.mark.parametrize("name", list(SPECS))
def test_runs_with_every_kind_are_bit_identical_to_their_pins(name, one_thread):
    if pin(PINS, name) is None:
        pytest.skip(f"no digest of {name} recorded on this processor ({processor()}); processors with digests: "
                    f"{', '.join(PINS)}")
    spec = SPECS[name]
    ds = learner_for(spec.domain)(spec)
    assert ds.attrs["status"] == "ok" and ds.sizes["step"] == spec.steps
    added = list(ADDED.get(name, ()))
    raw = [RAW] if name in RAW_ADDED else []
    assert digest(ds.drop_vars(added + raw)) == pin(PINS, name)
    if added:
        assert digest(ds[added]) == pin(ADDED_PINS, name)
    if raw and pin(RAW_PINS, name) is not None:
        assert digest(ds[raw]) == pin(RAW_PINS, name)


@pytest.mark.parametrize("name", RAW_ADDED)
def test_the_added_norm_before_clipping_is_the_stored_norm_where_nothing_changed_the_gradient(name, one_thread):
    """grad_norm (stored: the norm the optimizer received) is untouched by the watch; grad_norm_raw
    equals it where no perturbation or clip changed the gradient after backward(), and is at least
    the clipped norm where the clip acted."""
    spec = SPECS[name]
    ds = learner_for(spec.domain)(spec)
    raw, stored = ds[RAW].values, ds.grad_norm.values
    changed = np.zeros(spec.steps, bool)
    for p in spec.perturbations:
        if p.kind == "grad_noise":
            changed[p.start:p.end] = True
    clip = float(spec.hp.get("grad_clip", 0.0))
    if clip:
        changed |= True  # clip_grad_norm_ rescales in place on every step (by 1 below the clip)
        np.testing.assert_allclose(stored, np.minimum(raw, clip), rtol=1e-5)
    np.testing.assert_array_equal(raw[~changed], stored[~changed])
    assert np.isfinite(raw).all()


def test_the_digest_sees_one_flipped_bit(one_thread):
    spec = SPECS["seq_rnn"]
    ds = learner_for(spec.domain)(spec)
    v = ds["loss"].values.copy()
    v[-1] = np.nextafter(v[-1], np.inf)
    assert digest(ds.assign(loss=("step", v))) != digest(ds)


if __name__ == "__main__":  # print this processor's digests, to add them to PINS and ADDED_PINS
    torch.set_num_threads(1)
    print(processor())
    for name, spec in SPECS.items():
        ds = learner_for(spec.domain)(spec)
        added, raw = list(ADDED.get(name, ())), [RAW] if name in RAW_ADDED else []
        print(name, digest(ds.drop_vars(added + raw)), digest(ds[added]) if added else "",
              f"{RAW}: {digest(ds[raw])}" if raw else "")
