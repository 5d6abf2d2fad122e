"""Early warning of training collapse: performance labels, leakage-guarded features, the online
meta-state, streaming detectors and their fair evaluation.

Submodules are imported explicitly (``from stabstudy.analysis.warning import detectors``) so that a
controller importing the numpy-only streaming parts (:mod:`.features`, :mod:`.metastate`,
:mod:`.detectors`) does not pay for scipy, scikit-learn or pandas, which :mod:`.evaluation` uses.
"""
