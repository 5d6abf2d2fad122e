"""The batch side of the meta-state (:mod:`stabstudy.online.metastate`): the PCA of in-control rows
(:func:`fit_pca`, scikit-learn) and the vectorised :func:`replay` of a whole stored run, which the
tests hold equal to feeding :class:`~stabstudy.online.metastate.MetaState` row by row (1e-9)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stabstudy.online.metastate import MetaConfig, PCAModel, coordination, t2_q
from stabstudy.online.robust import rolling_robust_z


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


def replay(x: np.ndarray, pca: PCAModel | None = None, config: MetaConfig | None = None) -> dict[str, np.ndarray]:
    """The meta-state of a whole run at once (vectorised windows), equal to feeding
    :class:`~stabstudy.online.metastate.MetaState` row by row.

    Args:
        x: features of one run, shape (step, feature).
    Returns:
        ``t2``, ``q``, ``coordination``, ``eff_dim`` (shape (step,)), ``z`` and its EWMA ``zs``
        (shape (step, feature); NaN rows in warm-up), the rows a PCA is fitted on.
    """
    c = config or MetaConfig()
    x = np.asarray(x, dtype=float)
    n = x.shape[0]
    z = rolling_robust_z(x, c.window, c.min_periods, c.clip, c.floor, window_of="steps")
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
