"""The one place that defines where things live (repo-rooted, never ``../data``).

``STABSTUDY_ROOT`` overrides the project root; ``STABSTUDY_DATA`` overrides the
data folder (tests point it at a temporary directory).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def root() -> Path:
    """Project root: ``$STABSTUDY_ROOT``, else the checkout holding this package, else the cwd."""
    env = os.environ.get("STABSTUDY_ROOT")
    if env:
        return Path(env).resolve()
    if (_PKG.parent / "pyproject.toml").exists():
        return _PKG.parent
    return Path.cwd()


def data_dir() -> Path:
    env = os.environ.get("STABSTUDY_DATA")
    return Path(env).resolve() if env else root() / "data"


def runs_dir() -> Path:
    """Where the run store keeps one netCDF file per run."""
    return data_dir() / "runs"


def figures_dir(notebook: str | None = None) -> Path:
    env = os.environ.get("STABSTUDY_FIGURES")
    base = Path(env).resolve() if env else root() / "figures"
    return base / notebook if notebook else base


def notebooks_dir() -> Path:
    return root() / "notebooks"


def build_dir() -> Path:
    """Executed notebook copies and rendered reports (gitignored)."""
    return root() / "build"


def results_dir(profile: str) -> Path:
    """Published results of a study profile (``results/quick`` is committed)."""
    return root() / "results" / profile


def claims_dir(profile: str) -> Path:
    """Where each executed notebook saves its claims table for the report."""
    return build_dir() / profile / "claims"


#: The study's profiles (``run/profiles/<name>.yaml``): here, not beside the YAML reader, so that the
#: CLI offers them with the core alone.
PROFILES = ("smoke", "quick", "standard", "paper")


def profiles_dir() -> Path:
    return _PKG / "run" / "profiles"


def atomic_write(target: Path, data: bytes | str) -> Path:
    """Write ``data`` to ``target`` so that a reader sees the old file or the new one, never half:
    a uniquely named temporary file in the same folder, flushed to disk, then ``os.replace``.
    The folder is created; the temporary file is removed if anything fails."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target
