"""The Monitor in a user's own loop: the gradient norm before clipping (accumulation, GradScaler),
the learning rate a Controller applied, the Controller's decisions in the Monitor's Dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stabstudy.instruments.telemetry import Monitor


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dtype)


def data(n: int = 32, seed: int = 1, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randn(n, 2, generator=g).to(dtype)


def clipped_loop(steps: int, spike_at: int, *, clip: float = 1.0, micro: int = 1, before_clip: bool = True,
                 dtype: torch.dtype = torch.float32) -> tuple[list[float], object]:
    """AdamW, ``micro`` accumulated micro-batches per update, ``clip_grad_norm_`` at ``clip``, the
    learning rate x30 at update ``spike_at``: the norms clip_grad_norm_ returned, and the Dataset."""
    model = mlp(dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    mon = Monitor(model, opt, before_clip=before_clip)
    x, y = data(dtype=dtype)
    returned = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = 3e-2 * (30.0 if step == spike_at else 1.0)
        opt.zero_grad()
        for xb, yb in zip(x.chunk(micro), y.chunk(micro), strict=True):
            (torch.nn.functional.mse_loss(model(xb), yb) / micro).backward()
        returned.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    ds = mon.to_dataset()
    mon.close()
    return returned, ds


def test_a_clipped_loop_shows_the_spike_in_grad_norm():
    """The norm clip_grad_norm_ returns (what backward() produced) is grad_norm; the clipped one is
    grad_norm_applied, pinned at the clip value where it acted."""
    returned, ds = clipped_loop(12, spike_at=5)
    np.testing.assert_allclose(ds.grad_norm.values, returned, rtol=1e-6)
    applied = ds.grad_norm_applied.values
    np.testing.assert_allclose(applied, np.minimum(returned, 1.0), rtol=1e-5)
    after = ds.grad_norm.values[6:]
    assert after.max() > 3.0 * np.median(ds.grad_norm.values[:5])  # the spike's damage shows...
    assert applied[6:].max() <= 1.0 + 1e-5  # ... where the clipped norm cannot
    _, off = clipped_loop(12, spike_at=5, before_clip=False)
    np.testing.assert_array_equal(off.grad_norm.values, off.grad_norm_applied.values)
    np.testing.assert_allclose(off.grad_norm.values, applied, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_accumulating_four_micro_batches_records_the_whole_gradient(dtype):
    """grad_norm under accumulation (and clipping) equals the unaccumulated run's: the norm of the
    whole accumulated gradient, not of the last micro-batch."""
    one, ds1 = clipped_loop(6, spike_at=3, micro=1, dtype=dtype)
    four, ds4 = clipped_loop(6, spike_at=3, micro=4, dtype=dtype)
    rel = 1e-10 if dtype is torch.float64 else 1e-5
    np.testing.assert_allclose(ds4.grad_norm.values, ds1.grad_norm.values, rtol=rel)
    np.testing.assert_allclose(ds4.grad_norm.values, four, rtol=rel)
    np.testing.assert_allclose(ds4.grad_norm_applied.values, ds1.grad_norm_applied.values, rtol=rel)


def test_unchanged_gradient_records_the_steps_own_norm_bit_for_bit():
    """No clipping: grad_norm is the step's own norm, the same bits with or without the watch."""
    rows = {}
    for before in (True, False):
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = data()
        with Monitor(model, opt, before_clip=before) as mon:
            for _ in range(5):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        rows[before] = mon.to_dataset()
    np.testing.assert_array_equal(rows[True].grad_norm.values, rows[True].grad_norm_applied.values)
    np.testing.assert_array_equal(rows[True].grad_norm.values, rows[False].grad_norm.values)


@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_the_norm_before_clipping_is_unscaled(fused):
    """scaler.scale(loss).backward(), unscale_, clip, scaler.step: grad_norm is the unscaled norm
    backward() produced (the run without a scaler's), grad_norm_applied the clipped one."""
    norms = {}
    for scaled in (False, True):
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=scaled)
        mon = Monitor(model, opt, scaler=scaler)
        x, y = data()
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if not fused:  # fused Adam unscales inside its step: clipping the scaled gradient would be wrong
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        norms[scaled] = mon.to_dataset()
        mon.close()
    np.testing.assert_allclose(norms[True].grad_norm.values, norms[False].grad_norm.values, rtol=1e-5)
    if not fused:
        assert (norms[True].grad_norm.values > 0.05).all()
        np.testing.assert_allclose(norms[True].grad_norm_applied.values, 0.05, rtol=1e-4)
    with pytest.raises(TypeError, match="GradScaler"):
        Monitor(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), scaler=2.0)


def test_per_optimizer_norms_before_clipping_and_a_backward_without_step():
    """Two optimizers, one clipped: each has its own grad_norm_<name> and grad_norm_applied_<name>;
    a backward pass whose gradient is dropped before any step leaves no trace."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opts = {"a": torch.optim.SGD(a.parameters(), lr=0.1), "b": torch.optim.SGD(b.parameters(), lr=0.1)}
    mon = Monitor(None, opts)
    x = torch.randn(8, 4)
    returned = []
    for _ in range(3):
        for o in opts.values():
            o.zero_grad()
        b(a(x)).pow(2).mean().backward()  # read, then dropped: the next step reads its own pass
        for o in opts.values():
            o.zero_grad()
        (10 * b(a(x)).pow(2).mean()).backward()
        returned.append(float(torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)))
        opts["a"].step()
        opts["b"].step()
    ds = mon.to_dataset()
    np.testing.assert_allclose(ds.grad_norm_a.values, returned, rtol=1e-6)
    np.testing.assert_allclose(ds.grad_norm_applied_a.values, 0.1, rtol=1e-5)
    np.testing.assert_array_equal(ds.grad_norm_b.values, ds.grad_norm_applied_b.values)
    np.testing.assert_allclose(ds.grad_norm.values, np.hypot(ds.grad_norm_a.values, ds.grad_norm_b.values), rtol=1e-6)
    assert mon.grad_norm() == pytest.approx(float(ds.grad_norm.values[-1]), rel=1e-6)
    assert mon.grad_norm(applied=True) == pytest.approx(float(ds.grad_norm_applied.values[-1]), rel=1e-6)
    mon.close()


class Writer:
    def __init__(self):
        self.scalars: dict[str, dict[int, float]] = {}

    def add_scalar(self, tag, value, global_step):
        self.scalars.setdefault(tag, {})[global_step] = value


def backoff_loop(how: str, steps: int = 8, spike_at: int = 5):
    """SGD at lr 0.1; the loss x100 at update ``spike_at``, where a Controller (a level of the gradient
    norm) backs the rate off tenfold for that step only. ``how`` the Controller is attached."""
    from stabstudy.interventions.control import Controller, LrBackoff
    from stabstudy.online import Level

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctrl = Controller(Level(threshold=5.0), LrBackoff(0.1, recovery=0))
    if how == "before the Monitor":
        ctrl.attach(opt)
    writer = Writer()
    mon = Monitor(model, opt, writer=writer)
    if how == "through the Monitor":
        ctrl.attach(opt, mon)
    elif how == "after the Monitor":
        ctrl.attach(opt)
    x, y = data()
    for step in range(steps):
        opt.zero_grad()
        ((100.0 if step == spike_at else 1.0) * torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
    mon.close()
    ctrl.close()
    return mon.to_dataset(), ctrl, writer


@pytest.mark.parametrize("how", ["through the Monitor", "after the Monitor", "before the Monitor"])
def test_lr_is_the_rate_the_step_applied_when_a_controller_backs_off(how):
    """The Controller cuts the rate in its pre-hook and restores it in its post-hook: the Monitor's lr
    is the cut rate at that step however the two were attached, and SGD's update is lr x gradient."""
    ds, ctrl, _ = backoff_loop(how)
    assert ctrl.records()["action"].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # it acted at the spike only
    np.testing.assert_allclose(ds.lr.values, [0.1] * 5 + [0.01] + [0.1] * 2, rtol=1e-12)
    np.testing.assert_allclose(ds.update_norm.values / ds.grad_norm_applied.values, ds.lr.values, rtol=1e-5)


def test_the_controllers_decisions_join_the_monitors_dataset_and_its_writer():
    """Attached through the Monitor, the Controller's score, alarm and action (by name) are channels of
    the Monitor's rows; the writer gets them as numbers, the action as one 0/1 series per name."""
    ds, ctrl, writer = backoff_loop("through the Monitor")
    assert ds.controller_action.values.tolist() == ["none"] * 5 + ["lr_backoff"] + ["none"] * 2
    np.testing.assert_array_equal(ds.controller_alarm.values, [0, 0, 0, 0, 0, 1, 0, 0])
    np.testing.assert_allclose(ds.controller_score.values, ds.grad_norm.values, rtol=1e-6)  # Level: the norm
    assert ds.controller_action.attrs["long_name"].startswith("name of the controller's action")
    assert writer.scalars["stability/controller_action/lr_backoff"] == {s: float(s == 5) for s in range(8)}
    assert writer.scalars["stability/controller_alarm"][5] == 1.0 and "stability/controller_action" not in writer.scalars
    assert set(writer.scalars["stability/grad_norm_applied"]) == set(range(8))
    frame_channels = set(__import__("stabstudy.instruments.telemetry", fromlist=["to_frame"]).to_frame(ds).channel)
    assert "controller_score" in frame_channels and "controller_action" not in frame_channels  # numbers only
    assert backoff_loop("through the Monitor")[0].identical(ds)  # same loop, same Dataset


def test_olmo_skip_logs_its_device_decisions_to_the_monitor():
    from stabstudy.interventions.control import OlmoSkip

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt)
    ctrl = OlmoSkip(window=8, min_periods=4, sigma=3.0).attach(opt, mon)
    x, y = data()
    for step in range(10):
        opt.zero_grad()
        ((1e4 if step == 8 else 1.0) * torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
    ds = mon.to_dataset()
    ctrl.close()
    mon.close()
    assert ds.controller_action.values.tolist() == ["none"] * 8 + ["skip", "none"]
    np.testing.assert_array_equal(ds.controller_alarm.values, [0.0] * 8 + [1.0, 0.0])


def test_summary_medians_maxima_last_values_non_finite_steps_and_the_controllers_steps():
    ds, ctrl, _ = backoff_loop("through the Monitor")
    from stabstudy.instruments.telemetry.summary import summarize

    s = summarize(ds)
    gn = ds.grad_norm.values
    row = s.channels.loc["grad_norm"]
    assert (row["median"], row["max"], row["last"], row["non_finite"]) == (np.median(gn), gn.max(), gn[-1], 0)
    assert s.alarms.tolist() == [5] and s.actions == {5: "lr_backoff"} and s.steps == 8
    assert "controller_action" not in s.channels.index  # names, not numbers
    text = str(s)
    assert "alarms at steps: 5" in text and "actions at steps: 5 (lr_backoff)" in text and "non-finite values: none" in text
    # a value that blew up, a loss logged as NaN from step 6 on; xgrad's first step and an every=N
    # channel's gaps are not failures
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    with Monitor(model, opt, every=3) as mon:
        for step in range(10):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == 7:
                next(model.parameters()).grad[0, 0] = float("inf")
            opt.step()
            mon.log(loss=float("nan") if step >= 6 else loss.item())
    s = mon.summary()
    assert s.channels.loc["loss", "non_finite"] == 4 and s.channels.loc["loss", "first_non_finite"] == 6
    # set after backward(): the gradient the optimizer got is infinite at step 7, backward()'s is not
    assert s.channels.loc["grad_norm_applied", "first_non_finite"] == 7
    assert s.channels.loc["grad_norm", "non_finite"] == 0
    assert s.channels.loc["xgrad", "non_finite"] == 0 and s.channels.loc["update_ratio", "non_finite"] <= 1
    assert "loss at 4 steps from 6" in str(s) and "<pre>" in s._repr_html_()


def test_repr_says_what_is_watched_without_reading_the_device():
    model = mlp()
    opts = {"actor": torch.optim.Adam(model[0].parameters()), "critic": torch.optim.SGD(model[2].parameters(), lr=0.1)}
    mon = Monitor(model, opts, every=5, per_layer=True)
    assert repr(mon) == ("Monitor(actor: Adam, critic: SGD; every=5, per_layer=True, before_clip=True; "
                         "0 updates, 30 channels; attached)")
    mon.close()
    assert repr(mon).endswith("closed)")


def test_plots_telemetry_draws_the_main_channels_with_perturbation_and_controller_marks():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stabstudy import plots

    ds, _, _ = backoff_loop("through the Monitor")
    ds = ds.assign(perturbed=("step", np.isin(ds.step.values, [4, 5]).astype(float)),
                   loss=("step", np.linspace(1.0, 0.5, ds.sizes["step"])))
    fig = plots.telemetry(ds)
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["loss", "grad_norm", "update_ratio", "update_grad_cos", "lr", "controller_score"]
    top = fig.axes[0]
    assert [p.get_x() for p in top.patches] == [4.0]  # the perturbation window [4, 6)
    assert [ln.get_xdata()[0] for ln in top.lines[1:]] == [5.0]  # the controller acted at step 5
    assert {t.get_text() for t in top.get_legend().get_texts()} == {"perturbation", "controller: lr_backoff"}
    assert plots.overlaps(fig) == []
    plt.close(fig)
    with pytest.raises(ValueError, match="valid: .*grad_norm"):
        plots.telemetry(ds, ["nope"])
    with pytest.raises(ValueError, match="select one run"):
        plots.telemetry(ds.expand_dims(run=["a"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_backward_read_and_a_clip_make_no_host_sync_on_cuda():
    """The norm before clipping is read at the end of each backward pass and put in the row on the
    device (a loss scale divided out there): under sync debug mode "error" none of it syncs, and the
    channels equal the CPU run's."""
    results = {}
    for device in (torch.device("cuda"), torch.device("cpu")):
        model = mlp().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=device.type == "cuda")
        scaler = torch.amp.GradScaler(device.type, init_scale=256.0)
        mon = Monitor(model, opt, sync_every=4, scaler=scaler)
        x, y = (t.to(device) for t in data())
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()  # warm-up outside the check
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(9):
                opt.zero_grad()
                for xb, yb in zip(x.chunk(2), y.chunk(2), strict=True):  # two accumulated micro-batches
                    scaler.scale(torch.nn.functional.mse_loss(model(xb), yb) / 2).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # rescales by 1: the versions move
                scaler.step(opt)
                scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        results[device.type] = mon.to_dataset()
        mon.close()
    got, ref = results["cuda"], results["cpu"]
    for ch in ("grad_norm", "grad_norm_applied", "update_norm", "adam_v_mean"):
        np.testing.assert_allclose(got[ch].values, ref[ch].values, rtol=1e-3, equal_nan=True, err_msg=ch)
