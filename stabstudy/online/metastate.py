"""The streaming meta-state of the telemetry channels: how they co-vary, step by step.

Per step ``t`` and feature ``f`` (a row of :func:`stabstudy.online.features.matrix`):

1. *robust causal standardisation* (:class:`~stabstudy.online.robust.RobustScaler`):
   ``z[t, f] = (x[t, f] - median) / max(1.4826 MAD, floor)`` over the ``window`` steps before ``t``
   (no look-ahead), clipped to ``+-clip``; NaN until ``min_periods`` past values are finite;
2. optional EWMA of ``z`` (factor ``ewma``; 1 = none), the multivariate EWMA chart's smoothing
   that trades delay for sensitivity to small sustained shifts;
3. *Hotelling's T^2* ``sum_k s_k^2 / lambda_k`` of the smoothed ``z`` in the retained principal
   components of a PCA fitted on in-control rows only (:class:`PCAModel`, fitted by
   :func:`stabstudy.analysis.warning.metastate.fit_pca`), and *Q* (SPE), the squared norm of the
   residual outside them;
4. *coordination*: the share ``lambda_1 / sum(lambda)`` of the top eigenvalue of the correlation
   matrix of the raw ``z`` over the last ``corr_window`` steps (channels moving together), and
   the *effective dimension* ``(sum lambda)^2 / sum lambda^2`` (participation ratio).

Missing values (a channel not measured at a step) enter T^2, Q and the correlations as 0 (in
control). :class:`MetaState` computes one step at a time; the batch replay of a stored run
(:func:`stabstudy.analysis.warning.metastate.replay`) is held equal to it by the tests. numpy only.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stabstudy.online import features as F
from stabstudy.online.base import Detector
from stabstudy.online.robust import RobustScaler, rolling_robust_z


@dataclass(frozen=True)
class MetaConfig:
    """Parameters of the meta-state (module docstring)."""

    window: int = 64
    """past values in the robust standardisation"""
    min_periods: int = 16
    """finite past values needed before a z-score"""
    corr_window: int = 32
    """steps in the rolling correlation matrix"""
    ewma: float = 0.2
    """EWMA factor of z before T^2 and Q (1 = no smoothing)"""
    clip: float = 10.0
    """z-scores are clipped to +-clip (one broken channel cannot dominate)"""
    floor: float = 1e-3
    """smallest robust scale (a channel constant in its window)"""


@dataclass(frozen=True)
class PCAModel:
    """A PCA of in-control standardised rows: ``mean`` (feature,), ``components`` (component,
    feature), ``variances`` (component,), the ``features`` it was fitted on, ``n_fit`` rows and
    the ``total_variance`` of those rows (all components)."""

    features: tuple[str, ...]
    mean: np.ndarray
    components: np.ndarray
    variances: np.ndarray
    n_fit: int
    total_variance: float = float("nan")

    def explained(self) -> np.ndarray:
        """Share of the in-control variance of each retained component: shape (component,)."""
        return self.variances / self.total_variance

    def loadings(self) -> np.ndarray:
        """Loadings ``components * sqrt(variances)``: shape (component, feature)."""
        return self.components * np.sqrt(self.variances)[:, None]


def t2_q(z: np.ndarray, model: PCAModel) -> tuple[np.ndarray, np.ndarray]:
    """Hotelling's T^2 and Q of rows ``z`` (shape (..., feature)); each of shape (...)."""
    c = np.asarray(z, dtype=float) - model.mean
    s = c @ model.components.T
    t2 = np.sum(s * s / model.variances, axis=-1)
    r = c - s @ model.components
    return t2, np.sum(r * r, axis=-1)


def coordination(zwin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-eigenvalue share and participation ratio of the correlation matrix of windows
    ``zwin`` (shape (..., step, feature)); each result of shape (...).

    A feature constant within a window is uncorrelated with the others (its row and column are
    those of the identity), so the matrix stays a correlation matrix with trace = n features.
    """
    w = np.asarray(zwin, dtype=float)
    c = w - w.mean(axis=-2, keepdims=True)
    norm = np.sqrt(np.sum(c * c, axis=-2))  # (..., feature)
    ok = norm > 1e-12
    u = np.where(ok[..., None, :], c / np.where(ok, norm, 1.0)[..., None, :], 0.0)
    corr = np.swapaxes(u, -1, -2) @ u
    n = w.shape[-1]
    eye = np.eye(n, dtype=bool)
    corr = np.where(eye, 1.0, corr)
    lam = np.linalg.eigvalsh(corr)
    share = lam[..., -1] / n
    eff = n * n / np.sum(corr * corr, axis=(-1, -2))
    return share, eff


class MetaRow(NamedTuple):
    """One step of the meta-state: ``t2``, ``q``, ``coordination``, ``eff_dim`` (floats, NaN in
    warm-up) and ``z`` (shape (feature,), the standardised row before smoothing)."""

    t2: float
    q: float
    coordination: float
    eff_dim: float
    z: np.ndarray


class MetaState:
    """The meta-state, one step at a time: ``update(row) -> MetaRow``.

    Args:
        features: feature names (:mod:`stabstudy.online.features`), checked against the
            leakage guard for ``kinds``.
        pca: a :class:`PCAModel` fitted on in-control rows (T^2 and Q are NaN without one).
        config: :class:`MetaConfig`.
        kinds: perturbation kinds in play (for the guard).
    """

    def __init__(self, features: Sequence[str], pca: PCAModel | None = None, config: MetaConfig | None = None,
                 kinds: Sequence[str] = ()):
        F.check(features, kinds)
        if pca is not None and tuple(pca.features) != tuple(features):
            raise ValueError(f"the PCA was fitted on {pca.features}, not {tuple(features)}")
        self.features, self.pca, self.config = tuple(features), pca, config or MetaConfig()
        c = self.config
        self.scaler = RobustScaler(len(features), c.window, c.min_periods, c.clip, c.floor)
        self._zbuf = np.zeros((c.corr_window, len(features)))
        self._n = 0
        self._smooth: np.ndarray | None = None

    def update(self, row: np.ndarray | Mapping[str, float]) -> MetaRow:
        """Feed one step: a feature row (shape (feature,)) or a mapping of that step's channels."""
        x = F.row(row, self.features) if isinstance(row, Mapping) else np.asarray(row, dtype=float)
        return self._step(self.scaler.update(x))

    def replay(self, rows: np.ndarray) -> list[MetaRow]:
        """What :meth:`update` returns fed ``rows`` (shape (step, feature)) one by one, as a list;
        this state is left as it is. From a fresh state the standardisation of every row comes at
        once (:func:`~stabstudy.online.robust.rolling_robust_z`, equal to the scaler bit for bit) and
        the rest runs row by row as in :meth:`update`, so the rows are update's exactly."""
        x = np.asarray(rows, dtype=float)
        d = copy.deepcopy(self)
        if self._n or not all(r.fresh() for r in self.scaler._z):
            return [d.update(r) for r in x]
        if x.ndim != 2 or x.shape[1] != len(self.features):
            raise ValueError(f"rows of {len(self.features)} features were expected, got shape {x.shape}")
        c = self.config
        z = rolling_robust_z(x, c.window, c.min_periods, c.clip, c.floor, window_of="steps") if len(x) else x
        return [d._step(r) for r in z]

    def _step(self, z: np.ndarray) -> MetaRow:
        """The step after the standardisation: smoothing, T^2 and Q, the coordination window."""
        if np.isnan(z).all():
            return MetaRow(np.nan, np.nan, np.nan, np.nan, z)
        z0 = np.where(np.isfinite(z), z, 0.0)
        lam = self.config.ewma
        self._smooth = z0 if self._smooth is None else lam * z0 + (1 - lam) * self._smooth
        self._zbuf[self._n % self.config.corr_window] = z0
        self._n += 1
        t2 = q = share = eff = np.nan
        if self.pca is not None:
            t2, q = (float(v) for v in t2_q(self._smooth, self.pca))
        if self._n >= self.config.corr_window:
            share, eff = (float(v) for v in coordination(self._zbuf))
        return MetaRow(t2, q, share, eff, z)


#: The meta-state statistics a :class:`MetaDetector` can alarm on.
META_STATISTICS: tuple[str, ...] = ("t2", "q")


class MetaDetector(Detector):
    """The meta-state as a streaming detector: ``update(row) -> score``, the ``statistic``
    (Hotelling's ``t2`` or ``q``) of :class:`MetaState` after the step's row of channels.

    A :class:`~stabstudy.interventions.control.Controller` feeds it on its ``meta`` signal with
    the Monitor's last complete row, before each step lands. Build it with
    :func:`stabstudy.analysis.warning.evaluation.calibrate_detector` (PCA and threshold from
    unperturbed runs, as notebook 04 calibrates the meta-state), or from a :class:`PCAModel`.

    Args:
        pca: the in-control PCA; its ``features`` are the detector's.
        statistic: one of :data:`META_STATISTICS`.
        threshold: alarm when the statistic exceeds it.
        config: :class:`MetaConfig` (the one the PCA's rows were standardised with).
        kinds: perturbation kinds in play (the leakage guard).
        burn_in: rows fed before the first score (NaN before: the calibration's burn-in, so that
            the standardisation has its window of past values when the detector may alarm).
    """

    def __init__(self, pca: PCAModel, statistic: str = "t2", threshold: float = float("inf"),
                 config: MetaConfig | None = None, kinds: Sequence[str] = (), burn_in: int = 0,
                 name: str | None = None):
        if statistic not in META_STATISTICS:
            raise ValueError(f"unknown meta-state statistic {statistic!r}; valid: {', '.join(META_STATISTICS)}")
        self.state = MetaState(pca.features, pca, config, kinds)
        self.statistic, self.threshold, self.burn_in = statistic, float(threshold), int(burn_in)
        self.name = name or f"meta_{statistic}"
        self._seen = 0

    @property
    def features(self) -> tuple[str, ...]:
        return self.state.features

    def update(self, row: np.ndarray | Mapping[str, float]) -> float:  # type: ignore[override]
        """Feed one step's row (a feature row, or a mapping of channels where a channel the row
        lacks reads NaN, as an unmeasured channel does); return the statistic (NaN in warm-up)."""
        if isinstance(row, Mapping):
            row = {c: row.get(c, np.nan) for c in F.channels_of(self.features)}
        score = float(getattr(self.state.update(row), self.statistic))
        self._seen += 1
        return score if self._seen > self.burn_in else float("nan")
