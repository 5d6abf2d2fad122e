"""Perturbations: disturbances injected at a known step, for a known duration, with a known dose.

A perturbation changes training without changing the learning algorithm. Its description
(:class:`~stabstudy.spec.Perturbation`, frozen and hashed inside a :class:`~stabstudy.spec.RunSpec`)
and its kind's table entry (:data:`stabstudy.registry.KINDS`: stability dimension, domains,
meaning of the dose) live in the core modules; this package is what acts on training:

* :mod:`.schedule`: :class:`Schedule`, which perturbations are active at a step;
* :mod:`.tensors`: the torch-level disturbances (weight noise, layer re-initialisation, gradient noise).
"""

from stabstudy.interventions.perturb.schedule import Schedule
from stabstudy.interventions.perturb.tensors import add_grad_noise, add_weight_noise, reinit_layer
from stabstudy.registry import KINDS, check_kind
from stabstudy.spec import Perturbation

__all__ = ["KINDS", "Perturbation", "Schedule", "add_grad_noise", "add_weight_noise", "check_kind", "reinit_layer"]
