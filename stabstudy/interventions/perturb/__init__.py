"""Perturbations: disturbances injected at a known step, for a known duration, with a known dose.

A perturbation changes training without changing the learning algorithm. Its description
(:class:`~stabstudy.spec.Perturbation`, frozen and hashed inside a :class:`~stabstudy.spec.RunSpec`)
and its kind's table entry (:data:`stabstudy.registry.KINDS`: stability dimension, domains,
meaning of the dose) live in the core modules; this package is what acts on training:

* :mod:`.effects`: :class:`Effect`, what a kind does, and :func:`register`, the one place a kind is added;
* :mod:`.kinds`: the built-in kinds' effects;
* :mod:`.perturber`: :class:`Perturber`, the hooks every learner calls;
* :mod:`.schedule`: :class:`Schedule`, which perturbations are active at a step;
* :mod:`.tensors`: the torch-level disturbances (weight noise, layer re-initialisation, gradient noise).
"""

from stabstudy.interventions.perturb import kinds  # noqa: F401  (files the built-in effects)
from stabstudy.interventions.perturb.effects import EFFECTS, Effect, register, unregister
from stabstudy.interventions.perturb.perturber import Perturber
from stabstudy.interventions.perturb.schedule import Schedule
from stabstudy.interventions.perturb.tensors import add_grad_noise, add_weight_noise, reinit_layer
from stabstudy.registry import KINDS, check_kind
from stabstudy.spec import Perturbation

__all__ = ["EFFECTS", "KINDS", "Effect", "Perturbation", "Perturber", "Schedule", "add_grad_noise", "add_weight_noise",
           "check_kind", "register", "reinit_layer", "unregister"]
