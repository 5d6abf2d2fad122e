"""Run the study: execute the notebooks in order with papermill under a profile.

Profiles live in ``stabstudy/profiles/<name>.yaml``: notebook stem -> parameter
overrides. ``smoke`` shrinks sizes for CI (minutes), ``quick`` is ``make study``
on a 2-core machine (under 30 minutes), ``paper`` is hours on a Dask cluster. A
profile only changes sizes, never the code path. Executed copies go to
``build/<profile>/``; figures to ``figures/<notebook>/``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from stabstudy import paths

PROFILES = ("smoke", "quick", "paper")


def load_profile(name: str) -> dict[str, dict[str, Any]]:
    """Notebook stem -> parameter overrides for profile ``name``."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; valid profiles: {', '.join(PROFILES)}")
    with open(paths.profiles_dir() / f"{name}.yaml") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict) or not all(isinstance(v, dict | None) for v in data.values()):
        raise ValueError(f"profile {name}.yaml must map notebook names to parameter mappings")
    return {k: dict(v or {}) for k, v in data.items()}


def notebooks() -> list[Path]:
    """The study notebooks, in execution order (``NN_name.ipynb``)."""
    return sorted(p for p in paths.notebooks_dir().glob("[0-9][0-9]_*.ipynb"))


def select(only: Sequence[str] | None) -> list[Path]:
    """Notebooks matching ``only`` (numbers like ``01`` or full stems); all when empty.

    Raises ``ValueError`` naming the valid choices for an unknown selector.
    """
    nbs = notebooks()
    if not only:
        return nbs
    chosen = []
    for sel in only:
        match = [p for p in nbs if p.stem == sel or p.stem.split("_", 1)[0] == sel]
        if not match:
            valid = ", ".join(f"{p.stem.split('_', 1)[0]} ({p.stem})" for p in nbs)
            raise ValueError(f"unknown notebook {sel!r}; valid notebooks: {valid}")
        chosen += [p for p in match if p not in chosen]
    return sorted(chosen)


def parameters_for(nb: Path, profile: str, scheduler: str | None) -> dict[str, Any]:
    """The parameters papermill injects into ``nb`` for ``profile``."""
    params = dict(load_profile(profile).get(nb.stem, {}))
    params.update(profile=profile, scheduler=scheduler or "")
    return params


def run_study(profile: str = "quick", only: Sequence[str] | None = None, scheduler: str | None = None,
              out_dir: Path | None = None) -> list[tuple[str, float]]:
    """Execute the selected notebooks in order; return ``(stem, seconds)`` per notebook.

    Validation happens before anything is executed or written. Stops at the
    first failing notebook (papermill keeps the executed copy with the error).
    """
    import papermill as pm

    load_profile(profile)  # validate first: nothing is written for a bad profile
    selected = select(only)
    out_dir = out_dir or paths.build_dir() / profile
    out_dir.mkdir(parents=True, exist_ok=True)
    timings = []
    env_backup = os.environ.get("MPLBACKEND")
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        for nb in selected:
            t0 = time.perf_counter()
            print(f"== {nb.stem} ({profile})", flush=True)
            pm.execute_notebook(str(nb), str(out_dir / nb.name), parameters=parameters_for(nb, profile, scheduler),
                                cwd=str(paths.root()), kernel_name="python3", progress_bar=True)
            timings.append((nb.stem, time.perf_counter() - t0))
            print(f"   {nb.stem}: {timings[-1][1]:.0f} s", flush=True)
    finally:
        if env_backup is None:
            os.environ.pop("MPLBACKEND", None)
    return timings
