"""The online meta-state of the telemetry channels: how they co-vary, step by step.

Per step ``t`` and feature ``f`` (a row of :func:`stabstudy.analysis.warning.features.matrix`):

1. *robust causal standardisation*: ``z[t, f] = (x[t, f] - median) / max(1.4826 MAD, floor)``
   over the ``window`` values before ``t`` (no look-ahead), clipped to ``+-clip``; NaN until
   ``min_periods`` past values are finite;
2. optional EWMA of ``z`` (factor ``ewma``; 1 = none), the multivariate EWMA chart's smoothing
   that trades delay for sensitivity to small sustained shifts;
3. *Hotelling's T^2* ``sum_k s_k^2 / lambda_k`` of the smoothed ``z`` in the retained principal
   components of a PCA fitted on in-control rows only (:func:`fit_pca`), and *Q* (SPE), the
   squared norm of the residual outside them;
4. *coordination*: the share ``lambda_1 / sum(lambda)`` of the top eigenvalue of the correlation
   matrix of the raw ``z`` over the last ``corr_window`` steps (channels moving together), and
   the *effective dimension* ``(sum lambda)^2 / sum lambda^2`` (participation ratio).

Missing values (a channel not measured at a step) enter T^2, Q and the correlations as 0 (in
control). :class:`MetaState` computes one step at a time; :func:`replay` computes a whole
stored run with vectorised windows, and the tests hold the two equal to 1e-9. numpy only, plus
scikit-learn inside :func:`fit_pca`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stabstudy.analysis.warning import features as F


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


def fit_pca(z: np.ndarray, features: Sequence[str], n_components: int | float = 0.9, seed: int = 0) -> PCAModel:
    """Fit the meta-state PCA (scikit-learn) on in-control rows ``z`` (shape (row, feature)).

    Rows with a NaN are dropped. ``n_components``: an int, or the share of variance to keep.
    """
    from sklearn.decomposition import PCA

    z = np.asarray(z, dtype=float)
    z = z[np.isfinite(z).all(axis=1)]
    if z.shape[0] <= z.shape[1]:
        raise ValueError(f"fit_pca needs more in-control rows than features: {z.shape[0]} rows, {z.shape[1]} features")
    pca = PCA(n_components=n_components, svd_solver="full", random_state=seed).fit(z)
    return PCAModel(tuple(features), pca.mean_.copy(), pca.components_.copy(),
                    np.maximum(pca.explained_variance_, 1e-12), int(z.shape[0]),
                    float(np.var(z, axis=0, ddof=1).sum()))


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


class RobustScaler:
    """Streaming causal robust standardisation of rows of ``n_features`` (module docstring, step 1)."""

    def __init__(self, n_features: int, window: int = 64, min_periods: int = 16, clip: float = 10.0,
                 floor: float = 1e-3):
        self.window, self.min_periods, self.clip, self.floor = window, min_periods, clip, floor
        self._buf = np.full((window, n_features), np.nan)
        self._i = 0

    def update(self, x: np.ndarray) -> np.ndarray:
        """The z-score of row ``x`` (shape (feature,)) against the past window; then ``x`` joins it."""
        x = np.asarray(x, dtype=float)
        z = _standardise(x, self._buf, self.min_periods, self.clip, self.floor, axis=0)
        self._buf[self._i % self.window] = np.where(np.isfinite(x), x, np.nan)
        self._i += 1
        return z


def _nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """Median of the finite values along ``axis`` (NaN where none): ``np.nanmedian``'s result, by one
    sort (NaNs sort last), several times faster on the small windows of a stream."""
    srt = np.sort(a, axis=axis)
    n = np.isfinite(srt).sum(axis=axis, keepdims=True)
    lo = np.take_along_axis(srt, np.maximum((n - 1) // 2, 0), axis=axis)
    hi = np.take_along_axis(srt, np.maximum(n // 2, 0) - (n == 0), axis=axis)
    return np.where(n > 0, (lo + hi) / 2, np.nan).squeeze(axis)


def _standardise(x: np.ndarray, past: np.ndarray, min_periods: int, clip: float, floor: float,
                 axis: int) -> np.ndarray:
    enough = np.isfinite(past).sum(axis=axis) >= min_periods
    med = _nanmedian(past, axis)
    mad = _nanmedian(np.abs(past - np.expand_dims(med, axis)), axis)
    with np.errstate(all="ignore"):
        z = (x - med) / np.maximum(1.4826 * mad, floor)
    return np.where(enough & np.isfinite(x), np.clip(z, -clip, clip), np.nan)


class MetaState:
    """The meta-state, one step at a time: ``update(row) -> MetaRow``.

    Args:
        features: feature names (:mod:`stabstudy.analysis.warning.features`), checked against the
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
        z = self.scaler.update(x)
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


def replay(x: np.ndarray, pca: PCAModel | None = None, config: MetaConfig | None = None) -> dict[str, np.ndarray]:
    """The meta-state of a whole run at once (vectorised windows), equal to feeding :class:`MetaState`
    row by row.

    Args:
        x: features of one run, shape (step, feature).
    Returns:
        ``t2``, ``q``, ``coordination``, ``eff_dim`` (shape (step,)), ``z`` and its EWMA ``zs``
        (shape (step, feature); NaN rows in warm-up), the rows a PCA is fitted on.
    """
    c = config or MetaConfig()
    x = np.asarray(x, dtype=float)
    n, nf = x.shape
    padded = np.concatenate([np.full((c.window, nf), np.nan), np.where(np.isfinite(x), x, np.nan)])
    past = np.lib.stride_tricks.sliding_window_view(padded[:-1], c.window, axis=0)[:n]  # (step, feature, window)
    z = _standardise(x, past, c.min_periods, c.clip, c.floor, axis=-1)
    live = ~np.isnan(z).all(axis=1)
    z0 = np.where(np.isfinite(z), z, 0.0)[live]
    out = {k: np.full(n, np.nan) for k in ("t2", "q", "coordination", "eff_dim")}
    out["z"] = z
    out["zs"] = np.full_like(z, np.nan)
    if not live.any():
        return out
    smooth = np.empty_like(z0)
    smooth[0] = z0[0]
    for i in range(1, len(z0)):  # a recursion: the one sequential part
        smooth[i] = c.ewma * z0[i] + (1 - c.ewma) * smooth[i - 1]
    idx = np.flatnonzero(live)
    out["zs"][idx] = smooth
    if pca is not None:
        out["t2"][idx], out["q"][idx] = t2_q(smooth, pca)
    if len(z0) >= c.corr_window:
        win = np.lib.stride_tricks.sliding_window_view(z0, c.corr_window, axis=0)  # (k, feature, window)
        share, eff = coordination(np.swapaxes(win, -1, -2))
        out["coordination"][idx[c.corr_window - 1:]] = share
        out["eff_dim"][idx[c.corr_window - 1:]] = eff
    return out
