"""The small GPT: shapes, causal masking, qk-layernorm, z-loss, diagnostics, weight tying."""

from __future__ import annotations

import math

import pytest
import torch

from stabstudy.learners.gpt import GPT, GPTConfig, resolve_device


def make(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(**{"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, **kw})
    return GPT(cfg).eval()


def tokens(B: int = 3, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_loss():
    m = make()
    x = tokens()
    out = m(x, x)
    assert out.logits.shape == (3, 16, 256)
    assert out.loss.shape == () and math.isfinite(float(out.loss.detach()))
    # untrained byte model: cross-entropy near log(256)
    assert abs(float(out.ce.detach()) - math.log(256)) < 0.5
    assert m(x).loss is None
    with pytest.raises(AssertionError, match="block_size"):
        m(tokens(T=17))


@pytest.mark.parametrize("diagnostics", [False, True])
@pytest.mark.parametrize("qk", [False, True])
def test_causal_masking(diagnostics, qk):
    m = make(qk_layernorm=qk)
    x = tokens()
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 7) % 256  # change a future token
    a = m(x, diagnostics=diagnostics).logits
    b = m(x2, diagnostics=diagnostics).logits
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:], atol=1e-4)


def test_diagnostics_path_matches_fused_path():
    m = make()
    x = tokens()
    fast, slow = m(x, x), m(x, x, diagnostics=True)
    assert torch.allclose(fast.logits, slow.logits, atol=1e-5)
    d = slow.diag
    assert set(d) >= {"attn_logit_max", "attn_logit_max_l0", "attn_logit_max_l1", "out_logit_max", "attn_entropy_min"}
    assert d["attn_logit_max"] == max(d["attn_logit_max_l0"], d["attn_logit_max_l1"])
    assert math.isclose(d["out_logit_max"], float(slow.logits.detach().abs().max()), rel_tol=1e-6)
    # entropy of a causal attention row is at most log(number of visible keys) <= log(T)
    assert 0 < d["attn_entropy_min"] <= math.log(16)
    assert fast.diag == {}


def test_qk_layernorm_bounds_attention_logits():
    """With qk-LN (unit gains) |q.k|/sqrt(d) <= |q||k|/sqrt(d) = sqrt(d); without it logits grow with the weights."""
    x = tokens()
    hd = 32 // 2
    big = make(init_scale=30.0).eval()
    big_ln = make(init_scale=30.0, qk_layernorm=True).eval()
    assert big(x, diagnostics=True).diag["attn_logit_max"] > 10 * math.sqrt(hd)
    assert big_ln(x, diagnostics=True).diag["attn_logit_max"] <= math.sqrt(hd) * 1.001
    names = {n for n, _ in big_ln.named_parameters()}
    assert "blocks.0.attn.q_ln.weight" in names and "blocks.0.attn.q_ln.weight" not in {n for n, _ in big.named_parameters()}


def test_z_loss_adds_log_z_squared_and_pulls_log_z_to_zero():
    x = tokens()
    plain, zl = make(), make(z_loss=1e-2)
    a, b = plain(x, x), zl(x, x)
    assert float(a.loss.detach()) == float(a.ce.detach())
    lse = torch.logsumexp(b.logits.float(), dim=-1)
    assert math.isclose(float(b.zloss.detach()), 1e-2 * float(lse.detach().pow(2).mean()), rel_tol=1e-5)
    assert math.isclose(float(b.loss.detach()), float(b.ce.detach()) + float(b.zloss.detach()), rel_tol=1e-6)
    # a few SGD steps on the z-loss alone shrink log^2 Z
    m = make(z_loss=1.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    first = None
    for _ in range(20):
        z = m(x, x).zloss
        first = float(z.detach()) if first is None else first
        opt.zero_grad()
        z.backward()
        opt.step()
    assert float(m(x, x).zloss.detach()) < 0.5 * first


def test_weight_tying_and_init_scale():
    tied, untied = make(), make(tie_weights=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_params() == tied.num_params() + 256 * 32
    s1 = make(init_scale=1.0).wte.weight.std()
    s3 = make(init_scale=3.0).wte.weight.std()
    assert abs(float((s3 / s1).detach()) - 3.0) < 0.05


def test_same_seed_same_model_and_device_auto():
    x = tokens()
    assert torch.equal(make(seed=5)(x).logits, make(seed=5)(x).logits)
    assert not torch.equal(make(seed=5)(x).logits, make(seed=6)(x).logits)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu").type == "cpu"


def test_the_config_is_built_from_the_architecture_fields_the_hyperparameters_share():
    import dataclasses

    from stabstudy.hparams import GPTArch, GPTHParams, merged
    from stabstudy.learners.lm import model_config

    arch = [f.name for f in dataclasses.fields(GPTArch)]
    assert issubclass(GPTHParams, GPTArch) and issubclass(GPTConfig, GPTArch)
    assert [f.name for f in dataclasses.fields(GPTConfig)] == [*arch, "vocab_size", "bias"]
    changed = {"n_layer": 3, "n_head": 4, "n_embd": 48, "block_size": 24, "dropout": 0.1, "qk_layernorm": True,
               "z_loss": 1, "init_scale": 2, "tie_weights": False, "post_ln": True}
    assert sorted(changed) == sorted(arch)  # every shared field reaches the model
    cfg = model_config(merged(GPTHParams, changed, "t"))
    assert {k: getattr(cfg, k) for k in arch} == changed and type(cfg.z_loss) is float and cfg.vocab_size == 256
