"""Language-model learner: a small GPT on a byte-level corpus, with perturbations and telemetry.

``run(spec)`` implements the learner contract for domain ``"lm"``, learner ``"gpt"``
(see :mod:`stabstudy.spec`): one step is one optimizer update; the Dataset has
dimension ``step`` with coordinate ``tokens`` (tokens consumed up to and including the
step), the shared channels (through :class:`stabstudy.instruments.telemetry.Monitor`), and the
LM channels ``val_loss``, ``ce_loss``, ``z_loss``, ``attn_logit_max`` (+ per layer
``attn_logit_max_l<i>``), ``out_logit_max``, ``attn_entropy_min``. With any
precision other than float32 (or a loss scaler, or a ``precision_switch``) the
precision channels ``nonfinite_grads``, ``loss_scale``, ``skipped_step``,
``lost_update_frac``, ``fp16_headroom``, ``adam_state_nonfinite`` are recorded by
the measurement functions of :mod:`stabstudy.instruments.precision`. With a ``controller``
(:mod:`stabstudy.interventions.control`; it acts in the optimizer step's hooks, after clipping and
the scaler's unscale) also ``intervened`` and ``action``; its loss detector reads the loss as a
float, one host sync per step on a GPU (the ``olmo`` comparator decides on the device).

Precision mechanics (measurements in :mod:`stabstudy.instruments.precision`): ``autocast_dtype`` runs the
forward pass under ``torch.autocast`` (float32 master weights); ``param_dtype`` stores the
model *and* AdamW's state in that dtype (pure low-precision training); ``grad_scaler`` uses
``torch.amp.GradScaler`` (works on CPU in torch 2.13: scale 2**16, halves and skips the step on
inf/NaN gradients); a ``precision_switch`` perturbation changes the autocast dtype to
``params['dtype']`` while active. Note: pure float16 with the default ``eps=1e-8`` diverges at
once, since eps rounds to 0 in float16 and coordinates with a zero gradient get 0/0 in Adam.

Optimisation follows Wortsman et al. 2023: AdamW with betas (0.9, 0.95), eps 1e-8,
weight decay on matrices only, linear warmup then cosine decay, optional
gradient clipping. A NaN/inf loss or non-finite parameters stop the run with
``attrs["status"] = "diverged"`` (the data up to that step is kept).

``skip_nonfinite_loss`` (opt-in, needs ``grad_scaler``) continues past a non-finite loss the way a
GradScaler training loop does: its backward gives inf/NaN gradients, the scaler skips the optimizer
step and halves the scale (``skipped_step`` = 1, ``nonfinite_grads`` > 0, ``loss`` non-finite at that
step), and the run goes on; non-finite parameters still end it as diverged. Without a scaler nothing
skips the update, so a non-finite loss sends its gradient into AdamW: that is divergence, as above.

Perturbations: every kind :data:`stabstudy.registry.KINDS` lists for ``lm``, through the hooks of
a :class:`~stabstudy.interventions.perturb.Perturber` (``reinit_layer`` defaults to
``blocks.0.attn``; ``outlier_batch`` fills with ``params['token']``, default the corpus's rarest byte).
The grid builders and analyses used by ``notebooks/02_nanogpt_spike_studies.ipynb`` are in
:mod:`stabstudy.analysis.studies.lm_spikes`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import xarray as xr

from stabstudy import registry
from stabstudy.hparams import GPTHParams, merged
from stabstudy.instruments import curvature, precision
from stabstudy.instruments.telemetry import Monitor
from stabstudy.instruments.telemetry.table import HostCopies, LogStage
from stabstudy.interventions import control
from stabstudy.interventions.perturb import Perturber
from stabstudy.learners.corpus import get_batch, load_corpus, outlier_batch
from stabstudy.learners.gpt import GPT, GPTConfig, resolve_device
from stabstudy.seeding import seed_everything
from stabstudy.spec import RunSpec

#: Bump when a change to this learner alters the results it stores: the runner then
#: recomputes stored runs of other versions instead of reusing them.
#: 2: lambda_max from the on-device Lanczos (another start vector: values move within its tolerance).
RESULTS_VERSION = 2

#: The registry's ``precision`` channels, recorded in precision mode.
PRECISION_CHANNELS = registry.channel_names(source="precision")

#: Steps whose losses and parameter-finiteness checks stay on the device before one copy to
#: the host (and the Monitor's ``sync_every``): the float32 training loop reads no tensor back
#: per step. A divergence is found at the copy; the run is then cut at the diverged step, as
#: if it had stopped there (the recorded values do not depend on this number).
SYNC_EVERY = 64


class _StepLog:
    """Per-step scalars of the training loop (loss, ce_loss, z_loss, and the sum of the
    parameters' norms where their finiteness is checked), staged on the device by the Monitor's
    own staging (:class:`~stabstudy.instruments.telemetry.table.LogStage`: one device copy per
    value into a float64 buffer, no host read) and brought to ``rec`` a block at a time by
    :meth:`flush`, which also finds a divergence in the block."""

    def __init__(self, rec: dict[str, np.ndarray], steps: int, rows: int):
        self.rec = rec
        self.params_norm = np.full(steps, np.nan)
        self.copies = HostCopies()
        self.stage = LogStage(self.copies, self._put, capacity=4 * rows)
        self.rows = rows
        self.base, self.n = 0, 0  # first step since the last flush, steps since then
        self.checked: list[int] = []  # steps whose parameters were checked

    def _put(self, step: int, name: str, value: float) -> None:
        (self.params_norm if name == "params_norm" else self.rec[name])[step] = value

    def put(self, step: int, name: str, value: torch.Tensor) -> None:
        self.stage.add(step, name, value)
        self.n = step - self.base + 1

    def check_params(self, step: int, params: list[torch.Tensor]) -> None:
        """Stage the finiteness check of ``precision.all_finite``: the sum of the parameters'
        norms in float64 is finite exactly when every element is."""
        with torch.no_grad():
            self.put(step, "params_norm", torch.stack(torch._foreach_norm(params, 2, dtype=torch.float64)).sum())
        self.checked.append(step)

    def full(self) -> bool:
        return self.n == self.rows

    def flush(self, loss_diverges: bool = True) -> tuple[int, bool] | None:
        """Bring the staged values to ``rec`` (one wait on a GPU: the copy is the sync) and return
        the first diverged step since the last flush with whether its loss (else its parameters)
        went non-finite. ``loss_diverges=False``: only non-finite parameters count (a loss scaler
        skipped the step)."""
        self.stage.send_all()
        self.copies.drain(wait=True)
        base, n, checked = self.base, self.n, set(self.checked)
        self.base, self.n, self.checked = base + n, 0, []
        loss = self.rec["loss"]
        for j in range(base, base + n):
            if loss_diverges and not math.isfinite(loss[j]):
                return j, True
            if j in checked and not math.isfinite(self.params_norm[j]):
                return j, False
        return None


def hparams(spec: RunSpec) -> dict[str, Any]:
    """The spec's hyperparameters over the :class:`~stabstudy.hparams.GPTHParams` defaults."""
    return merged(GPTHParams, spec.hp, "lm learner 'gpt'")


def model_config(hp: dict[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` described by merged hyperparameters."""
    return GPTConfig.from_hparams(hp, vocab_size=256)


def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_frac: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr_frac * lr`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(steps - warmup - 1, 1)
    progress = min((step - warmup) / span, 1.0)
    return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, hp: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only, as in nanoGPT."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": float(hp["weight_decay"])},
              {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=float(hp["lr"]), betas=(float(hp["beta1"]), float(hp["beta2"])),
                             eps=float(hp["eps"]), foreach=False)


@torch.no_grad()
def evaluate(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
             autocast_name: str) -> float:
    """Mean cross-entropy (nats/token) over fixed validation ``batches``, in eval mode."""
    was = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with precision.autocast(device.type, autocast_name):
            total += float(model(x.to(device), y.to(device)).ce)
    model.train(was)
    return total / len(batches)


def stale(spec: RunSpec, attrs: dict) -> str | None:
    """Why a stored run of ``spec`` no longer describes it, or None (called by
    :func:`stabstudy.run.runner.pending`): a corpus file is named by its path in the spec, so a
    file edited since the run is caught by its content hash. A file that is gone keeps the run.
    Curvature channels measured at another probe tolerance make the run stale too."""
    probe = curvature.probe_stale(spec.curvature_every, attrs, curvature.TOL)
    if probe or spec.task == "stdlib" or "corpus_sha256" not in attrs:
        return probe
    hp = hparams(spec)
    try:
        now = load_corpus(spec.task, int(hp["corpus_bytes"]), float(hp["val_frac"])).sha256
    except ValueError:
        return None
    if now != attrs["corpus_sha256"]:
        return f"was trained on another version of the corpus file {spec.task!r} (sha256 {attrs['corpus_sha256'][:12]}, now {now[:12]})"
    return None


def run(spec: RunSpec) -> xr.Dataset:
    """Train a GPT as ``spec`` says; return the per-step Dataset (see module docstring)."""
    hp = hparams(spec)
    steps, seed = spec.steps, spec.seed
    pert = Perturber(spec.perturbations, torch.Generator().manual_seed(seed + 1_000_003), layer="blocks.0.attn",
                     outliers=lambda b, p, gen: outlier_batch(*b, p.dose, int(p.p.get("token", corpus.rare_token))))
    hp = pert.hparams(hp)
    seed_everything(seed)
    device = resolve_device(str(hp["device"]))

    corpus = load_corpus(spec.task, int(hp["corpus_bytes"]), float(hp["val_frac"]))
    model = GPT(model_config(hp))
    param_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(hp["param_dtype"])
    if param_dtype is None:
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {hp['param_dtype']!r}")
    if hp["autocast_dtype"] not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"autocast_dtype must be float32, bfloat16 or float16, got {hp['autocast_dtype']!r}")
    if bool(hp["grad_scaler"]) and param_dtype == torch.float16:
        raise ValueError("grad_scaler needs float32 or bfloat16 parameters: torch.amp.GradScaler refuses to "
                         "unscale float16 gradients (use param_dtype='float32' with autocast_dtype='float16')")
    skip_loss = bool(hp["skip_nonfinite_loss"])
    if skip_loss and not bool(hp["grad_scaler"]):
        raise ValueError("skip_nonfinite_loss needs grad_scaler=True: without a scaler nothing skips the update, "
                         "so a non-finite loss reaches AdamW and the run diverges")
    model.to(device=device, dtype=param_dtype)
    params = [p for p in model.parameters()]
    opt = make_optimizer(model, hp)
    B, T = int(hp["batch_size"]), int(hp["block_size"])
    data_gen = torch.Generator().manual_seed(seed)
    val_gen = torch.Generator().manual_seed(seed + 2_000_003)
    val_batches = [get_batch(corpus.val, B, T, val_gen) for _ in range(int(hp["eval_batches"]))]
    warmup = int(hp["warmup"])
    eval_every = spec.eval_every or max(steps // 10, 1)
    diag_every = int(hp["diag_every"]) or spec.log_every
    precision_mode = (hp["autocast_dtype"] != "float32" or param_dtype != torch.float32
                      or bool(hp["grad_scaler"]) or pert.overrides("autocast_dtype"))
    scaler = precision.make_grad_scaler(device.type, enabled=bool(hp["grad_scaler"]),
                                        growth_interval=int(hp["scaler_growth_interval"]))
    mon = Monitor(model, opt, every=spec.log_every, sync_every=SYNC_EVERY, scaler=scaler)
    ctrl = control.from_hparams(hp)  # None unless hparams name one: then the loop runs as before
    if ctrl is not None:
        ctrl.attach(opt, mon)
    probe = None
    if spec.curvature_every:  # sharpness on a fixed probe batch, eval mode (no dropout), explicit attention
        px, py = (t.to(device) for t in get_batch(corpus.train, B, T, torch.Generator().manual_seed(seed + 3_000_017)))

        def probe_loss() -> torch.Tensor:
            return model(px, py, diagnostics=True).loss

        probe = curvature.CurvatureProbe(mon, probe_loss, params, every=spec.curvature_every, optimizer=opt,
                                         iters=int(hp["curvature_iters"]), seed=seed)

    n_layer = int(hp["n_layer"])
    # recorded before a step's loss is known to be finite: a step whose loss is not keeps only these
    before_check = ["loss", "ce_loss", "z_loss", "lr", "attn_logit_max", "out_logit_max", "attn_entropy_min",
                    *(f"attn_logit_max_l{i}" for i in range(n_layer))]
    names = [*before_check[:4], "val_loss", "perf", *before_check[4:7], "lambda_max", *before_check[7:]]
    if precision_mode:
        names += list(PRECISION_CHANNELS)
    if probe is not None:
        names += [c for c in curvature.CURVATURE_CHANNELS if c not in names]
    rec = {k: np.full(steps, np.nan) for k in names}
    mon_row_step: dict[int, int] = {}  # Monitor row -> step (a loss-scaler skip makes no row)
    status, done = "ok", 0
    dlog = _StepLog(rec, steps, SYNC_EVERY)
    try:
        for step in range(steps):
            # -- schedule: learning rate, beta2, precision --------------------------------
            lr = pert.on_step_start(step, opt, lr_at(step, steps, float(hp["lr"]), warmup, float(hp["min_lr_frac"])))
            ac_name = pert.setting(step, "autocast_dtype", str(hp["autocast_dtype"]))
            # -- data (the stream is drawn the same way with and without perturbations) ----
            x, y = get_batch(corpus.train, B, T, data_gen)
            x, y = pert.on_batch(step, (x, y))
            # pageable source: the driver stages it, no stream synchronisation
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # -- instantaneous parametric perturbations ------------------------------------
            pert.on_params(step, model)
            # -- forward / backward ----------------------------------------------------------
            diag_now = step % diag_every == 0
            with precision.autocast(device.type, ac_name):
                out = model(x, y, diagnostics=diag_now)
            loss = out.loss
            dlog.put(step, "loss", loss)
            dlog.put(step, "ce_loss", out.ce)
            dlog.put(step, "z_loss", out.zloss)
            rec["lr"][step] = lr
            for k, v in out.diag.items():
                if k in rec:
                    rec[k][step] = v
            done = step + 1
            objective = pert.on_loss(step, loss)
            opt.zero_grad(set_to_none=True)
            scaler.scale(objective).backward()
            if scaler.is_enabled():
                scaler.unscale_(opt)
            pert.on_grads(step, params)
            if float(hp["grad_clip"]) > 0:
                torch.nn.utils.clip_grad_norm_(params, float(hp["grad_clip"]))
            if ctrl is not None:  # acts in the step's hooks, after the clip and the scaler's unscale
                ctrl.observe(loss, step=step)
            if precision_mode:
                grads = [p.grad for p in params]
                rec["nonfinite_grads"][step] = precision.count_nonfinite(grads)
                before = precision.snapshot(params)
                skipped, scale_used = precision.scaler_step(scaler, opt)
                storage = param_dtype if param_dtype != torch.float32 else precision.resolve_dtype(ac_name)
                if not skipped:  # a skipped step applies no update: nothing for rounding to erase (NaN)
                    rec["lost_update_frac"][step] = precision.lost_update_frac(before, params, grads, storage)
                rec["loss_scale"][step], rec["skipped_step"][step] = scale_used, float(skipped)
                rec["adam_state_nonfinite"][step] = precision.adam_state_nonfinite(opt)
                if diag_now:
                    rec["fp16_headroom"][step] = precision.logit_fp16_headroom(
                        out.diag["attn_logit_max"], out.diag["out_logit_max"],
                        int(hp["n_embd"]) // int(hp["n_head"]))
            else:
                opt.step()
            if mon.step >= 0:
                mon_row_step.setdefault(mon.step, step)
            if precision_mode or step % spec.log_every == 0:
                dlog.check_params(step, params)
            # -- divergence: a non-finite loss or parameters, found a block at a time ----------
            eval_now = (step + 1) % eval_every == 0 or step == steps - 1
            probe_now = probe is not None and step % spec.curvature_every == 0
            if dlog.full() or eval_now or probe_now:  # before evaluating: never a diverged model
                diverged = dlog.flush(loss_diverges=not skip_loss)
                if diverged is not None:
                    s, at_loss = diverged
                    status, done = "diverged", s + 1
                    if at_loss:  # the run stops before this step's update
                        for k in rec.keys() - set(before_check):
                            rec[k][s] = np.nan
                    mon_row_step = {r: t for r, t in mon_row_step.items() if t < s or (t == s and not at_loss)}
                    break
            # -- evaluation and curvature --------------------------------------------------
            if eval_now:
                vl = evaluate(model, val_batches, device, ac_name)
                rec["val_loss"][step], rec["perf"][step] = vl, -vl
            if probe_now:
                update = mon.last_update(params) if mon_row_step.get(mon.step) == step else None
                was = model.training
                model.eval()
                with precision.autocast(device.type, ac_name):
                    vals = probe.measure(update)
                model.train(was)
                for k, v in vals.items():
                    rec[k][step] = v
    finally:
        mon_ds = mon.to_dataset(stored=True)
        mon.close()
        if ctrl is not None:
            ctrl.close()

    ds = xr.Dataset({k: ("step", v[:done]) for k, v in rec.items()},
                    coords={"step": np.arange(done), "tokens": ("step", (np.arange(done) + 1) * B * T)})
    if "step" in mon_ds.dims and mon_ds.sizes["step"]:
        rows = [r for r in mon_ds.step.values.tolist() if r in mon_row_step]
        mon_ds = mon_ds.sel(step=rows).assign_coords(step=[mon_row_step[r] for r in rows])
        mon_ds = mon_ds.reindex(step=ds.step)
        for k in mon_ds.data_vars:
            if k not in ds:
                ds[k] = ("step", mon_ds[k].values)
    ds["perturbed"] = ("step", pert.mask(ds.step.values))
    if ctrl is not None:
        ds = ds.assign({k: ("step", v) for k, v in ctrl.records(done).items()})
        ds.attrs.update(ctrl.attrs())
    if probe is not None:
        ds.attrs["curvature_tol"] = float(probe.tol)
    ds.attrs.update(status=status, corpus_sha256=corpus.sha256, corpus_name=corpus.name,
                    corpus_bytes=corpus.n_bytes, rare_token=corpus.rare_token, n_params=model.num_params(),
                    device=str(device), tokens_per_step=B * T)
    return registry.annotate(ds)

