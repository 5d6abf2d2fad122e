"""Run specifications: frozen, validated dataclasses with a stable content hash.

A :class:`RunSpec` fully determines one training run (together with the code
version): the same spec and seed give the same trajectory on the same machine.
Its :attr:`RunSpec.spec_hash` keys the run store (``data/runs/<hash>.nc``).

Step units (``steps``, ``Perturbation.start``/``duration``, cadences) are the
domain's natural unit:

* ``toy`` and ``lm``: optimizer updates;
* ``rl``: environment steps (stable-baselines3's ``total_timesteps``).

A :class:`Perturbation` is the frozen, validated description of one disturbance that a spec
holds (what it does to training is :mod:`stabstudy.interventions.perturb`'s job); the freezing
helpers below make hyperparameters and perturbation params hashable canonical values.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from stabstudy.hparams import plain, validate
from stabstudy.registry import KINDS, check_kind, check_task, hparams_class


def hash_of_json(text: str) -> str:
    """The :attr:`RunSpec.spec_hash` of a spec's JSON (:meth:`RunSpec.to_json`'s or any JSON of the
    same content): 16 hex chars of the SHA-256 of its canonical form. Needs no valid spec, so a
    stored run's ``spec`` attribute can be checked against its ``spec_hash`` whatever the code now accepts."""
    return _digest(json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")))


def _digest(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def freeze(value: Any, where: str) -> Any:
    """Canonicalise a hyperparameter value: JSON scalars, tuples for sequences; numpy and torch values
    (scalars, arrays, tensors) become the Python scalars and lists they hold, alike."""
    value = plain(value)
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: hyperparameter values must be finite, got {value!r}")
        return value
    if isinstance(value, list | tuple):
        return tuple(freeze(v, where) for v in value)
    raise ValueError(f"{where}: hyperparameter values must be str, int, float, bool, None or sequences of them "
                     f"(numpy values and torch tensors hold them too), got {type(value).__name__}")


def thaw(value: Any) -> Any:
    return [thaw(v) for v in value] if isinstance(value, tuple) else value


def freeze_map(mapping: Mapping[str, Any] | tuple, where: str) -> tuple[tuple[str, Any], ...]:
    items = mapping.items() if isinstance(mapping, Mapping) else tuple(mapping)
    out = []
    for k, v in items:
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"{where}: keys must be identifiers, got {k!r}")
        out.append((k, freeze(v, f"{where}[{k!r}]")))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Perturbation:
    """A disturbance of ``kind`` active on steps ``[start, start + duration)``.

    ``dose`` means what :data:`stabstudy.registry.KINDS` says for the kind (e.g. the
    learning-rate factor of an ``lr_spike``). ``params`` carries kind-specific
    options (e.g. ``{"layer": "blocks.0.attn"}`` for ``reinit_layer``).
    """

    kind: str
    start: int
    duration: int = 1
    dose: float = 1.0
    params: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()

    def __post_init__(self) -> None:
        check_kind(self.kind)
        object.__setattr__(self, "start", plain(self.start))  # numpy / torch integers as Python ints
        object.__setattr__(self, "duration", plain(self.duration))
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise ValueError(f"perturbation {self.kind!r}: start must be an integer >= 0, got {self.start!r}")
        if not isinstance(self.duration, int) or isinstance(self.duration, bool) or self.duration < 1:
            raise ValueError(f"perturbation {self.kind!r}: duration must be an integer >= 1, got {self.duration!r}")
        dose = plain(self.dose)
        if not isinstance(dose, int | float) or isinstance(dose, bool) or not math.isfinite(dose) or dose < 0:
            raise ValueError(f"perturbation {self.kind!r}: dose must be a finite number >= 0, got {self.dose!r}")
        object.__setattr__(self, "dose", float(dose))
        object.__setattr__(self, "params", freeze_map(self.params, f"perturbation {self.kind!r} params"))

    @property
    def dimension(self) -> str:
        """The stability dimension of this kind."""
        return KINDS[self.kind].dimension

    @property
    def end(self) -> int:
        """First step after the window."""
        return self.start + self.duration

    @property
    def p(self) -> dict[str, Any]:
        """``params`` as a plain dict."""
        return {k: thaw(v) for k, v in self.params}

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "start": self.start, "duration": self.duration, "dose": self.dose, "params": self.p}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Perturbation:
        return cls(kind=d["kind"], start=int(d["start"]), duration=int(d.get("duration", 1)),
                   dose=float(d.get("dose", 1.0)), params=d.get("params", {}))



@dataclass(frozen=True, eq=False)
class RunSpec:
    """Everything that determines one run.

    Two specs are equal when their :attr:`spec_hash` is: Python's ``1 == 1.0 == True``
    would otherwise make specs equal that the store keeps (and runs) apart.

    Attributes:
        domain: ``"toy"``, ``"rl"`` or ``"lm"``.
        learner: one of :data:`stabstudy.registry.LEARNERS` for the domain.
        task: what is learned: a built-in task of the domain (toy, seq), a registered gymnasium
            env id (rl), ``"stdlib"`` or a text-file path (lm); :func:`stabstudy.registry.check_task`.
        steps: run length in the domain's step unit (see module docstring).
        seed: explicit seed for every random number generator of the run.
        hparams: learner hyperparameters (learning rate, sizes, ...), literals only.
        perturbations: disturbances to inject; empty for a baseline run.
        log_every: record telemetry every this many steps.
        eval_every: evaluate ``perf`` every this many steps (0: learner default).
        curvature_every: measure ``lambda_max`` every this many steps (0: never).
    """

    domain: str
    learner: str
    task: str
    steps: int
    seed: int
    hparams: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()
    perturbations: tuple[Perturbation, ...] = ()
    log_every: int = 1
    eval_every: int = 0
    curvature_every: int = 0
    _hash: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hp_class = hparams_class(self.domain, self.learner)  # names the valid domains / learners
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"task must be a non-empty string, got {self.task!r}")
        for name in ("steps", "seed", "log_every", "eval_every", "curvature_every"):
            v = plain(getattr(self, name))  # numpy and torch integers as Python ints, like hyperparameters
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, v)
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.eval_every < 0 or self.curvature_every < 0:
            raise ValueError("eval_every and curvature_every must be >= 0 (0 = default / never)")
        perts = self.perturbations
        if isinstance(perts, Perturbation):
            perts = (perts,)
        perts = tuple(Perturbation.from_dict(p) if isinstance(p, Mapping) else p for p in perts)
        for p in perts:
            if not isinstance(p, Perturbation):
                raise ValueError(f"perturbations must be Perturbation objects or dicts, got {type(p).__name__}")
            check_kind(p.kind, self.domain)
            if p.start >= self.steps or p.end > self.steps:
                raise ValueError(
                    f"perturbation {p.kind!r} window [{p.start}, {p.end}) lies outside the run "
                    f"[0, {self.steps}); shorten it or lengthen the run"
                )
        object.__setattr__(self, "perturbations", perts)
        object.__setattr__(self, "hparams", freeze_map(self.hparams, "hparams"))
        # fail here, not minutes later on a worker, for a misspelt or mistyped name
        validate(hp_class, self.hp, f"{self.domain} learner {self.learner!r}")
        check_task(self.domain, self.task)
        object.__setattr__(self, "_hash", _digest(self.to_json()))  # to_json is canonical already

    # -- views -----------------------------------------------------------------
    @property
    def hp(self) -> dict[str, Any]:
        """``hparams`` as a plain dict."""
        return {k: thaw(v) for k, v in self.hparams}

    def get(self, name: str, default: Any = None) -> Any:
        """One hyperparameter, with a default."""
        return self.hp.get(name, default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunSpec) and other._hash == self._hash

    def __hash__(self) -> int:
        return hash(self._hash)

    @property
    def spec_hash(self) -> str:
        """Stable content hash (16 hex chars) of the canonical JSON form."""
        return self._hash

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_hash")
        d["hparams"] = self.hp
        d["perturbations"] = [p.to_dict() for p in self.perturbations]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSpec:
        d = dict(d)
        d["perturbations"] = tuple(Perturbation.from_dict(p) for p in d.get("perturbations", ()))
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> RunSpec:
        return cls.from_dict(json.loads(s))

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with fields changed; ``hparams`` given as a dict are merged."""
        if "hparams" in changes and isinstance(changes["hparams"], Mapping):
            changes["hparams"] = {**self.hp, **changes["hparams"]}
        return replace(self, **changes)

    @property
    def label(self) -> str:
        """Short human-readable label, e.g. ``ppo/HalfCheetah-v5 s0 lr_spike x10@2000``."""
        pert = ",".join(f"{p.kind} x{p.dose:g}@{p.start}" for p in self.perturbations) or "none"
        return f"{self.learner}/{self.task} s{self.seed} {pert}"
