"""What each perturbation kind does to training, registered once per kind.

An :class:`Effect` says what one kind does through the hooks a learner's
:class:`~stabstudy.interventions.perturb.perturber.Perturber` calls; :func:`register` files it
under its kind. Adding a kind touches one place: a :func:`register` call with the kind's
:class:`~stabstudy.registry.Kind` (its dimension, domains and dose, which spec validation, the
CLI and the docs then read) on its effect::

    @register(Kind("weight_scale", "parametric", ("toy",), "factor multiplying every parameter",
                   instantaneous=True))
    class WeightScale(Effect):
        def on_params(self, p, model, ctx):
            for w in model.parameters():
                w.data.mul_(p.dose)

The built-in kinds' table rows stay in :data:`stabstudy.registry.KINDS` (a spec is validated
without importing this package); their effects are in :mod:`.kinds`. A kind registered at run
time exists in the process that registered it: a grid on Dask workers needs the registering
module imported there too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from stabstudy import registry
from stabstudy.registry import Kind
from stabstudy.spec import Perturbation

if TYPE_CHECKING:
    from stabstudy.interventions.perturb.perturber import Perturber


class Effect:
    """What a perturbation kind does; every hook does nothing unless the kind overrides it.

    ``p`` is the perturbation acting, ``ctx`` the learner's :class:`Perturber` (its
    ``generator`` for random draws, its ``layer`` and ``outliers`` for the domain's defaults).
    The ``on_*`` hooks run on every step of ``p``'s window, or at its start only for an
    instantaneous kind; while windows of one kind overlap, the first listed acts.
    """

    #: Names of the learner settings :meth:`settings` may override (e.g. ``autocast_dtype``).
    SETTINGS: tuple[str, ...] = ()

    def hparams(self, p: Perturbation, hp: dict[str, Any]) -> dict[str, Any]:
        """The run's hyperparameters as the learner should use them (once, before training)."""
        return hp

    def lr_factor(self, p: Perturbation, step: int) -> float:
        """Factor on the learning rate at ``step``, asked at every step (inside the window or not)."""
        return 1.0

    def on_step_start(self, p: Perturbation, optimizer: Any, ctx: Perturber) -> None:
        """Change the optimizer's hyperparameters for this step (the Perturber restores them after)."""

    def settings(self, p: Perturbation) -> dict[str, Any]:
        """Values of named learner settings (of :attr:`SETTINGS`) for this step."""
        return {}

    def on_params(self, p: Perturbation, model: Any, ctx: Perturber) -> None:
        """Change the model's parameters in place."""

    def on_batch(self, p: Perturbation, batch: tuple, ctx: Perturber) -> tuple:
        """The batch the step trains on."""
        return batch

    def on_loss(self, p: Perturbation, loss: Any, ctx: Perturber) -> Any:
        """The objective the step differentiates (the learner records the loss before it)."""
        return loss

    def on_grads(self, p: Perturbation, params: list, ctx: Perturber) -> None:
        """Change the parameters' ``.grad`` in place, before clipping and the optimizer step."""


#: kind name -> its effect, in registration order (the order effects act in within one hook).
EFFECTS: dict[str, Effect] = {}

_E = TypeVar("_E", bound=type[Effect])


def register(kind: str | Kind) -> Callable[[_E], _E]:
    """Class decorator filing an :class:`Effect` under ``kind``.

    ``kind``: the name of a kind of :data:`stabstudy.registry.KINDS`, or a new :class:`Kind`,
    which is added there (validated, see :func:`stabstudy.registry.add_kind`).
    """
    def deco(cls: _E) -> _E:
        if not (isinstance(cls, type) and issubclass(cls, Effect)):
            raise TypeError(f"register: {cls!r} is not an Effect subclass")
        name = kind.name if isinstance(kind, Kind) else kind
        if name in EFFECTS:
            raise ValueError(f"perturbation kind {name!r} already has an effect ({type(EFFECTS[name]).__name__})")
        if isinstance(kind, Kind):
            registry.add_kind(kind)
        else:
            registry.check_kind(name)
        EFFECTS[name] = cls()
        return cls
    return deco


def unregister(name: str) -> None:
    """Remove a kind :func:`register` added, with its effect (the built-in kinds stay: ``ValueError``)."""
    if name in EFFECTS and not registry.remove_kind(name):
        raise ValueError(f"perturbation kind {name!r} is built in; only kinds register added can be removed")
    EFFECTS.pop(name, None)


def effect(kind: str) -> Effect:
    """The effect of ``kind``; ``ValueError`` naming the kinds that have one otherwise."""
    if kind not in EFFECTS:
        raise ValueError(f"perturbation kind {kind!r} has no effect a learner's Perturber applies (the RL "
                         f"env-side kinds act in stabstudy.learners.rl.envs); kinds with effects: {', '.join(EFFECTS)}")
    return EFFECTS[kind]
