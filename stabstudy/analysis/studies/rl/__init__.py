"""Notebook 01's RL study (PPO vs SAC vs TD3 under perturbation), one module per job.

Imports go down this list, never up (``tests/test_architecture.py`` refuses a cycle):

* :mod:`.curves`: evaluation returns as step functions of env steps (``eval_curves``, ``step_at``,
  ``stop_env_step``), per-run returns and spreads;
* :mod:`.design`: :class:`~.design.ForkDesign` (the notebook's parameters as one dataclass), the fork
  grids, the horizon H, the claim as stated;
* :mod:`.outcomes`: each fork against its paired control (``paired_outcome``), the prefix as the unit,
  each prefix's dose bracket;
* :mod:`.runs`: one row per run (its keys and a summary of its own curve);
* :mod:`.checks`: manipulation checks (did the spike reach updates, did the knob change the noise);
* :mod:`.power` and :mod:`.cost`: what a design can decide and what it costs;
* :mod:`.claims`: the claims table's rows;
* :mod:`.plan`: :class:`~.plan.ForkPlan`, which forks run in which round;
* :mod:`.warning`: notebook 04's early-warning protocol on these forks.
"""
