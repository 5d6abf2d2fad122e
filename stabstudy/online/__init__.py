"""Streaming statistics for training loops and analysis alike: numpy only at import.

Every detector has one interface, ``update(value) -> score`` with an alarm at ``score >
threshold`` (:class:`Detector`); a :class:`~stabstudy.interventions.control.Controller` runs one on
each optimizer step, and the early-warning analysis replays the same classes over stored runs.

* :mod:`.robust`: :class:`RobustZ`, the one trailing median/MAD z-score, its row-wise
  :class:`RobustScaler` and the batch :func:`rolling_robust_z` / :func:`rolling_median_mad`;
* :mod:`.detectors`: :class:`WindowZ` (OLMo-core), :class:`ZClipZ` (ZClip), :class:`Level`,
  :class:`NonFinite`, :class:`KendallEWS` (critical slowing down);
* :mod:`.drift`: :class:`ADWINGrid`, :class:`PageHinkley` (river, imported when built);
* :mod:`.features`: the detector inputs and their leakage guard;
* :mod:`.metastate`: :class:`MetaState`, the joint state of many channels (T^2, Q, coordination),
  and :class:`MetaDetector`, its T^2 or Q as a detector of a Controller's ``meta`` signal.

It imports nothing else of the package but its core modules. See docs/online.md.
"""

from stabstudy.online import features
from stabstudy.online.base import Detector
from stabstudy.online.detectors import (
           KendallEWS,
           Level,
           NonFinite,
           WindowZ,
           ZClipZ,
           ews_indicator,
           kendall_tau,
)
from stabstudy.online.drift import ADWINGrid, PageHinkley
from stabstudy.online.metastate import (
           META_STATISTICS,
           MetaConfig,
           MetaDetector,
           MetaRow,
           MetaState,
           PCAModel,
           coordination,
           t2_q,
)
from stabstudy.online.robust import (
           MAD_SCALE,
           RobustScaler,
           RobustZ,
           rolling_median_mad,
           rolling_robust_z,
)

__all__ = ["MAD_SCALE", "META_STATISTICS", "ADWINGrid", "Detector", "KendallEWS", "Level", "MetaConfig", "MetaDetector",
           "MetaRow", "MetaState",
           "NonFinite", "PCAModel", "PageHinkley", "RobustScaler", "RobustZ", "WindowZ", "ZClipZ", "coordination",
           "ews_indicator", "features", "kendall_tau", "rolling_median_mad", "rolling_robust_z", "t2_q"]
