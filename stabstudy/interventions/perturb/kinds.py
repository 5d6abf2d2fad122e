"""The built-in perturbation kinds' effects (their table rows: :data:`stabstudy.registry.KINDS`).

Registered in the order they act within one hook (``weight_noise`` draws before
``reinit_layer`` at a shared step, ``lr_spike`` multiplies before ``lr_ramp``). The RL
env-side kinds (``action_noise``, ``obs_noise``, ``reward_scale``) act inside the env wrapper
of :mod:`stabstudy.learners.rl.envs` and have no effect here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stabstudy.interventions.perturb.effects import Effect, register
from stabstudy.interventions.perturb.tensors import add_grad_noise, add_weight_noise, reinit_layer
from stabstudy.spec import Perturbation

if TYPE_CHECKING:
    from stabstudy.interventions.perturb.perturber import Perturber


@register("lr_spike")
class LRSpike(Effect):
    def lr_factor(self, p: Perturbation, step: int) -> float:
        return p.dose if p.start <= step < p.end else 1.0


@register("lr_ramp")
class LRRamp(Effect):
    """Climbs geometrically from 1 to ``dose`` over the window and keeps ``dose`` after it: a
    disturbance that does not go away (``perturbed`` marks the climb only)."""

    def lr_factor(self, p: Perturbation, step: int) -> float:
        return p.dose ** (min(step - p.start + 1, p.duration) / p.duration) if step >= p.start else 1.0


@register("beta2_shift")
class Beta2Shift(Effect):
    def on_step_start(self, p: Perturbation, optimizer: Any, ctx: Perturber) -> None:
        for g in optimizer.param_groups:
            if "betas" in g:
                g["betas"] = (g["betas"][0], p.dose)


@register("grad_noise")
class GradNoise(Effect):
    def on_grads(self, p: Perturbation, params: list, ctx: Perturber) -> None:
        add_grad_noise(params, p.dose, ctx.generator)


@register("no_warmup")
class NoWarmup(Effect):
    def hparams(self, p: Perturbation, hp: dict[str, Any]) -> dict[str, Any]:
        return {**hp, "warmup": 0}


@register("weight_noise")
class WeightNoise(Effect):
    def on_params(self, p: Perturbation, model: Any, ctx: Perturber) -> None:
        add_weight_noise(model, p.dose, ctx.generator)


@register("reinit_layer")
class ReinitLayer(Effect):
    """``params['layer']`` names the submodule (default: the learner's ``layer``)."""

    def on_params(self, p: Perturbation, model: Any, ctx: Perturber) -> None:
        reinit_layer(model, str(p.p.get("layer", ctx.layer)), p.dose, ctx.generator)


@register("outlier_batch")
class OutlierBatch(Effect):
    """Through the learner's ``outliers(batch, p, generator)``: what an outlier is depends on the data."""

    def on_batch(self, p: Perturbation, batch: tuple, ctx: Perturber) -> tuple:
        if ctx.outliers is None:
            raise ValueError("outlier_batch: this learner gave its Perturber no outliers function")
        return ctx.outliers(batch, p, ctx.generator)


@register("loss_scale")
class LossScale(Effect):
    def on_loss(self, p: Perturbation, loss: Any, ctx: Perturber) -> Any:
        return loss * p.dose


@register("precision_switch")
class PrecisionSwitch(Effect):
    """``params['dtype']`` (default ``bfloat16``) becomes the autocast dtype while active."""

    SETTINGS = ("autocast_dtype",)

    def settings(self, p: Perturbation) -> dict[str, Any]:
        return {"autocast_dtype": str(p.p.get("dtype", "bfloat16"))}
