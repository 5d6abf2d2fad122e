"""Early warning of training collapse: performance labels (:mod:`.labels`), the batch side of the
meta-state (:mod:`.metastate`: PCA fit and replay) and the fair evaluation of detectors
(:mod:`.evaluation`), outcome classes (:mod:`.outcomes`), collapse specificity (:mod:`.specificity`),
seeds as the units of the claims (:mod:`.units`) and the cross-domain direction (:mod:`.crossdomain`).
The streaming parts (detectors, features and their leakage guard, the
meta-state itself) live in :mod:`stabstudy.online`.

Submodules are imported explicitly (``from stabstudy.analysis.warning import evaluation``): the
evaluation pays for scipy, scikit-learn and pandas.
"""
