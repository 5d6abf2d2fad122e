"""The run store: one netCDF file per run, written atomically, checksummed, locked, keyed by spec hash.

Schema (the contract between notebooks, see the README): dimension ``step``,
the shared channels always present (NaN where a learner cannot measure them),
provenance attributes (strings and numbers only). Failed runs are stored too,
as records with no steps and the traceback in ``error``.

Guarantees (docs/store.md): a file is written to a temporary name and renamed, so a
reader sees a whole run or none; it carries the SHA-256 of its content
(:data:`CHECKSUM_ATTR`), checked on every load, so a damaged file reads as ``corrupt``;
a run being written (or computed, see :func:`stabstudy.run.runner.run_grid`) holds a
lock file per spec hash, which the operating system releases when its process dies, and
temporary files no live process holds are removed when the store opens.
"""

from __future__ import annotations

import datetime as _dt
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import uuid
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import xarray as xr

from stabstudy import __version__, paths, registry
from stabstudy.interventions.perturb import Schedule
from stabstudy.registry import SHARED_CHANNELS
from stabstudy.spec import RunSpec, hash_of_json

if TYPE_CHECKING:  # the [study] extra's (see _lock)
    from filelock import FileLock

log = logging.getLogger(__name__)

STATUSES = ("ok", "diverged", "failed")
ENGINE = "netcdf4"
#: Global attribute holding :func:`content_sha256` of the rest of the file.
CHECKSUM_ATTR = "content_sha256"
#: Folder of the store holding one lock file per spec hash.
LOCKS_DIR = ".locks"
#: How temporary files are named: ``.<spec_hash>.<random>.nc.tmp`` (see :meth:`RunStore.save`).
TMP_GLOB = ".*.nc.tmp"


class CorruptRunError(RuntimeError):
    """A stored run file exists but cannot be read, does not match its name or its checksum;
    ``reason`` says which in a few words."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class RunWriteError(OSError):
    """A run could not be written to the store's folder; says which folder and why (``errno`` is
    ``ENOSPC`` or ``EDQUOT`` when there was no room for it, else that of the error, or None)."""

    def __str__(self) -> str:  # the message alone: it names the cause already, "[Errno None]" says nothing
        return str(self.strerror)


class UnverifiedRunError(CorruptRunError):
    """A stored run file without a checksum (written before runs carried one): it cannot be
    checked, so it is not used; :func:`stabstudy.run.runner.run_grid` recomputes it."""


def content_sha256(ds: xr.Dataset) -> str:
    """SHA-256 of a run as read from its file: the Dataset's attributes (all but
    :data:`CHECKSUM_ATTR`) and every variable's name, dims, dtype, shape, attributes and values.

    Computed on what :meth:`RunStore.load` reads, never on the Dataset before writing, so the
    decoding netCDF applies (strings, fill values) is the same on both sides."""
    h = hashlib.sha256()

    def feed(obj: object) -> None:
        h.update(json.dumps(obj, sort_keys=True, default=_plain).encode())
        h.update(b"\0")

    feed({k: v for k, v in ds.attrs.items() if k != CHECKSUM_ATTR})
    for name in sorted(ds.variables, key=str):
        var = ds.variables[name]
        text = var.dtype.kind in "OUS"
        feed([str(name), list(var.dims), "str" if text else var.dtype.str, list(var.shape), dict(var.attrs)])
        if text:
            feed([str(v) for v in np.ravel(var.values)])
        else:
            h.update(np.ascontiguousarray(var.values).tobytes())
    return h.hexdigest()


def _plain(v: object) -> object:
    """JSON for the numpy values netCDF returns (attributes read back as numpy scalars or arrays)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return str(v)


def _read(path: Path) -> xr.Dataset:
    with xr.open_dataset(path, engine=ENGINE) as f:
        return f.load()


@functools.cache
def _lock(path: str) -> FileLock:
    # filelock is the [study] extra's: imported here so that reading a store (`stabstudy runs`)
    # needs the core alone
    from filelock import FileLock

    # one object per file in a process: acquiring it again in the same process is reentrant
    # (save() inside a claim held by run_grid), while another process's attempt waits
    return FileLock(path, thread_local=False)


#: Folders whose contents decide the published numbers.
SOURCE_FOLDERS = ("stabstudy", "notebooks")


def source_hashes() -> dict[str, str]:
    """sha256 of every source file under :data:`SOURCE_FOLDERS`, keyed by its repo-relative path."""
    root = paths.root()
    out = {}
    for folder in SOURCE_FOLDERS:
        for f in sorted((root / folder).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and ".ipynb_checkpoints" not in f.parts:
                out[f.relative_to(root).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@functools.cache
def git_commit() -> str:
    """Commit of the checkout holding the code (``+dirty`` when it has changes), or ``unknown``."""
    try:
        root = paths.root()
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover
        return "none"


def conform(ds: xr.Dataset, spec: RunSpec) -> xr.Dataset:
    """Bring a learner's Dataset to the shared schema.

    Adds missing shared channels as NaN, the ``perturbed`` channel from the
    spec's schedule when the learner did not record it, and casts booleans to
    floats (netCDF has no bool).
    """
    if "step" not in ds.dims:
        raise ValueError(f"learner for {spec.label} returned a Dataset without a 'step' dimension: dims {dict(ds.sizes)}")
    ds = ds.copy()
    n = ds.sizes["step"]
    if "step" not in ds.coords:
        ds = ds.assign_coords(step=np.arange(n))
    if "perturbed" not in ds:
        unit = "env_step" if "env_step" in ds.coords and spec.domain == "rl" else "step"
        ds["perturbed"] = ("step", Schedule(spec.perturbations).mask(ds[unit].values))
    for name in SHARED_CHANNELS:
        if name not in ds:
            ds[name] = ("step", np.full(n, np.nan))
    for name, var in ds.data_vars.items():
        if var.dtype == bool:
            ds[name] = var.astype("float64")
    return registry.annotate(ds)


def _clean_attrs(attrs: dict) -> dict:
    out = {}
    for k, v in attrs.items():
        if isinstance(v, bool | np.bool_):
            v = int(v)
        elif v is None:
            v = ""
        elif isinstance(v, dict | list | tuple):
            v = json.dumps(v)
        elif not isinstance(v, str | int | float | np.integer | np.floating):
            v = str(v)
        out[k] = v
    return out


#: Distributions whose versions a stored run records: every run, and per domain.
RECORDED_PACKAGES: dict[str, tuple[str, ...]] = {
    "*": ("numpy", "xarray", "scipy"),
    "rl": ("stable-baselines3", "gymnasium", "mujoco"),
}


def package_versions(domain: str | None = None) -> dict[str, str]:
    """``<name>_version`` of python and the :data:`RECORDED_PACKAGES` a run of ``domain`` uses."""
    import importlib.metadata as md
    import platform

    names = RECORDED_PACKAGES["*"] + (RECORDED_PACKAGES.get(domain, ()) if domain else ())
    out = {"python_version": platform.python_version()}
    for name in names:
        try:
            out[f"{name.replace('-', '_')}_version"] = md.version(name)
        except md.PackageNotFoundError:
            out[f"{name.replace('-', '_')}_version"] = "not installed"
    return out


def code_identity(domain: str | None = None) -> dict[str, str]:
    """The code that produces runs in this process: package version, git commit, torch version,
    the telemetry Monitor's implementation (``TELEMETRY_VERSION``), and the
    :func:`package_versions` of ``domain``."""
    from stabstudy.instruments.telemetry import TELEMETRY_VERSION  # imports torch: only when asked

    return {"stabstudy_version": __version__, "git_commit": git_commit(), "torch_version": _torch_version(),
            "telemetry_version": TELEMETRY_VERSION, **package_versions(domain)}


def version_drift(attrs: dict, domain: str | None = None) -> list[str]:
    """``name stored -> installed`` for each recorded version that differs from this process's:
    ``stabstudy_version``, torch's, the telemetry Monitor's and the :func:`package_versions`
    (a run stored before versions were recorded reports nothing). The git commit is not a
    version: a new commit that changes results bumps its learner's ``RESULTS_VERSION``
    (or the package's version), so a commit alone never makes a run stale."""
    now = {k: v for k, v in code_identity(domain).items() if k.endswith("_version")}
    return [f"{k[:-8]} {attrs[k]} -> {v}" for k, v in now.items() if k in attrs and str(attrs[k]) != v]


def provenance(spec: RunSpec, status: str, wall_time_s: float, error: str = "",
               made_by: dict[str, str] | None = None) -> dict:
    """Provenance attributes of a stored run (README, "Stored runs"). ``made_by``: the :func:`code_identity`
    of the process that ran it (a Dask worker's), when not this one."""
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}; valid: {', '.join(STATUSES)}")
    code = {**code_identity(spec.domain), **(made_by or {})}
    return {
        "spec": spec.to_json(),
        "spec_hash": spec.spec_hash,
        "domain": spec.domain,
        "learner": spec.learner,
        "perturbation": json.dumps([p.to_dict() for p in spec.perturbations]),
        "seed": spec.seed,
        **code,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "wall_time_s": float(wall_time_s),
        "status": status,
        "error": error,
    }


@dataclass
class RunStore:
    """A folder of ``<spec_hash>.nc`` files. Defaults to ``data/runs``."""

    root: Path | str | None = None

    def __post_init__(self) -> None:
        self.root = Path(self.root) if self.root is not None else paths.runs_dir()
        self.remove_stale_tmp()

    def path(self, spec_or_hash: RunSpec | str) -> Path:
        h = spec_or_hash.spec_hash if isinstance(spec_or_hash, RunSpec) else spec_or_hash
        return Path(self.root) / f"{h}.nc"

    def lock(self, spec_or_hash: RunSpec | str) -> FileLock:
        """The lock of one run, ``<root>/.locks/<spec_hash>.lock``: held while the run is written
        (:meth:`save`) and while :func:`~stabstudy.run.runner.run_grid` computes it. It is an
        ``flock`` on the file, so the operating system releases it when the holding process dies
        (a crashed study leaves no lock anyone must remove). One object per file per process:
        acquiring it again in the process that holds it is reentrant."""
        h = spec_or_hash.spec_hash if isinstance(spec_or_hash, RunSpec) else spec_or_hash
        folder = Path(self.root) / LOCKS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return _lock(str((folder / f"{h}.lock").resolve()))

    def claim(self, spec_or_hash: RunSpec | str) -> bool:
        """Take the run's :meth:`lock` without waiting: False when another process holds it."""
        from filelock import Timeout  # see _lock

        try:
            self.lock(spec_or_hash).acquire(timeout=0)
        except Timeout:
            return False
        return True

    def release(self, spec_or_hash: RunSpec | str) -> None:
        """Give back a :meth:`claim`."""
        lock = self.lock(spec_or_hash)
        if lock.is_locked:
            lock.release()

    def remove_stale_tmp(self) -> list[Path]:
        """Delete the temporary files (``.<hash>.<random>.nc.tmp``) that no live process is writing:
        those whose run's :meth:`lock` can be taken (an interrupted or killed writer's). Returns them."""
        removed: list[Path] = []
        for tmp in sorted(Path(self.root).glob(TMP_GLOB)):
            h = tmp.name[1:].split(".", 1)[0]
            try:
                lock = self.lock(h)
                if lock.is_locked or not self.claim(h):
                    continue  # being written, here or by another process
            except OSError:  # a store this process may read but not write: leave it as it is
                return removed
            try:
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
            finally:
                self.release(h)
        if removed:
            log.warning("removed %d temporary file(s) left by an interrupted write in %s", len(removed), self.root)
        return removed

    def save(self, ds: xr.Dataset, spec: RunSpec, status: str, wall_time_s: float, error: str = "",
             extra_attrs: dict | None = None, made_by: dict[str, str] | None = None) -> Path:
        """Write a run atomically: a temporary file in the same folder, read back to stamp its
        :func:`content_sha256`, then ``os.replace``; under the run's :meth:`lock` throughout.
        ``made_by``: see :func:`provenance`."""
        ds = conform(ds, spec) if status != "failed" else ds
        ds.attrs = _clean_attrs({**ds.attrs, **(extra_attrs or {}),
                                 **provenance(spec, status, wall_time_s, error, made_by)})
        for var in ds.variables.values():
            var.attrs = _clean_attrs(var.attrs)
        ds.attrs.pop(CHECKSUM_ATTR, None)
        target = self.path(spec)
        target.parent.mkdir(parents=True, exist_ok=True)
        # not mkstemp: its files are private (0600); created like this the run gets the mode of a
        # plain write (0666 less the umask), so that a store shared by a group stays readable
        tmp = str(target.parent / f".{spec.spec_hash}.{uuid.uuid4().hex}.nc.tmp")
        with self.lock(spec):
            try:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
                ds.to_netcdf(tmp, engine=ENGINE)
                _stamp(Path(tmp))
                os.replace(tmp, target)
            except (OSError, RuntimeError) as exc:  # netCDF reports a full disk as RuntimeError("NetCDF: HDF error")
                if os.path.exists(tmp):
                    os.unlink(tmp)  # first: the half-written file holds the room the check below looks for
                raise _write_error(exc, spec, target.parent, ds.nbytes) from exc
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return target

    def save_failed(self, spec: RunSpec, error: str, wall_time_s: float, extra_attrs: dict | None = None,
                    made_by: dict[str, str] | None = None) -> Path:
        """Store a run that raised: no steps, its traceback in ``error``."""
        empty = xr.Dataset(coords={"step": np.arange(0)})
        return self.save(empty, spec, "failed", wall_time_s, error=error, extra_attrs=extra_attrs, made_by=made_by)

    def load(self, spec_or_hash: RunSpec | str) -> xr.Dataset:
        """Load one run fully into memory; raise :class:`CorruptRunError` if unreadable or mismatched."""
        p = self.path(spec_or_hash)
        want = spec_or_hash.spec_hash if isinstance(spec_or_hash, RunSpec) else spec_or_hash
        if not p.exists():
            raise FileNotFoundError(f"no stored run {want} at {p}")
        try:
            ds = _read(p)
        except Exception as exc:  # netCDF4 raises OSError, RuntimeError, ValueError on damage
            raise CorruptRunError(f"run file {p} is unreadable ({type(exc).__name__}: {exc})", "unreadable") from exc
        if CHECKSUM_ATTR not in ds.attrs:
            raise UnverifiedRunError(f"run file {p} carries no checksum (written before stored runs had one), "
                                     "so it cannot be checked: run_grid recomputes it", "no checksum")
        digest = content_sha256(ds)
        if ds.attrs[CHECKSUM_ATTR] != digest:
            raise CorruptRunError(f"run file {p} does not match its checksum (content SHA-256 {digest}, "
                                  f"recorded {ds.attrs[CHECKSUM_ATTR]}): its content changed after it was written",
                                  "content does not match its checksum")
        if ds.attrs.get("spec_hash") != want or ds.attrs.get("status") not in STATUSES:
            raise CorruptRunError(f"run file {p} does not hold run {want} (attrs spec_hash="
                                  f"{ds.attrs.get('spec_hash')!r}, status={ds.attrs.get('status')!r})",
                                  "holds another run")
        # the checksum says the file is as written, not that its spec is the run's: a spec put there
        # later, with the checksum stamped again, would be read as this run's
        try:
            spec_hash = hash_of_json(str(ds.attrs.get("spec")))
        except ValueError:  # json.JSONDecodeError included
            spec_hash = "unreadable JSON"
        if spec_hash != want:
            raise CorruptRunError(f"run file {p} is named and marked as run {want}, but its spec hashes to "
                                  f"{spec_hash}: the spec attribute was changed after the run was written",
                                  "spec does not match its hash")
        return ds

    def status(self, spec_or_hash: RunSpec | str) -> str | None:
        """``ok`` / ``diverged`` / ``failed`` for a readable stored run, ``corrupt``, ``unverified``
        (no checksum), or None if absent."""
        if not self.path(spec_or_hash).exists():
            return None
        try:
            return str(self.load(spec_or_hash).attrs["status"])
        except UnverifiedRunError:
            return "unverified"
        except CorruptRunError:
            return "corrupt"

    def hashes(self) -> list[str]:
        return sorted(p.stem for p in Path(self.root).glob("*.nc"))

    def table(self) -> pd.DataFrame:
        """One row per stored file: hash, status, domain, learner, task, seed, perturbation, steps, wall time."""
        rows = []
        for h in self.hashes():
            try:
                ds = self.load(h)
            except CorruptRunError as exc:
                rows.append({"spec_hash": h, "status": "unverified" if isinstance(exc, UnverifiedRunError)
                             else "corrupt", "error": str(exc)})
                continue
            spec = RunSpec.from_json(ds.attrs["spec"])
            rows.append({
                "spec_hash": h, "status": ds.attrs["status"], "domain": spec.domain, "learner": spec.learner,
                "task": spec.task, "seed": spec.seed,
                "perturbation": ",".join(f"{p.kind}x{p.dose:g}@{p.start}" for p in spec.perturbations) or "none",
                "steps": int(ds.sizes.get("step", 0)), "wall_time_s": round(float(ds.attrs.get("wall_time_s", np.nan)), 1),
                "created_utc": ds.attrs.get("created_utc", ""),
                "version_drift": "; ".join(version_drift(ds.attrs, spec.domain)),
            })
        return pd.DataFrame(rows)


#: Errors that mean "no room": a full device, a user's exhausted quota.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def _write_error(exc: BaseException, spec: RunSpec, folder: Path, nbytes: int) -> RunWriteError:
    """What went wrong writing ``spec``'s run to ``folder``, as a :class:`RunWriteError` naming both.

    netCDF (HDF5) turns a failed write into ``RuntimeError: NetCDF: HDF error``, without the
    operating system's reason; whether the folder still has room for the run (about ``nbytes``,
    the Dataset's size) is then asked of the file system itself: ``posix_fallocate`` of that many
    bytes fails with ``ENOSPC`` or ``EDQUOT`` where there is none."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code not in _NO_ROOM:
        code = _no_room(folder, nbytes) or code
    where = f"cannot store run {spec.spec_hash} in {folder}"
    if code in _NO_ROOM:
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        why = ("no space left on device" if code == errno.ENOSPC else "disk quota exceeded") + \
              f" ({errno.errorcode[code]}; {free / 2**20:.1f} MiB free there, the run needs about {nbytes / 2**20:.1f} MiB)"
        return RunWriteError(code, f"{where}: {why}; free some space or set STABSTUDY_DATA to a folder "
                                   "with room (the runs stored so far are whole: the next study resumes)")
    return RunWriteError(code, f"{where}: {type(exc).__name__}: {exc}")


def _no_room(folder: Path, nbytes: int) -> int | None:
    """``ENOSPC`` / ``EDQUOT`` when ``folder``'s file system cannot give a file ``nbytes`` bytes now, else None."""
    probe = folder / f".space-probe.{uuid.uuid4().hex}.tmp"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        return exc.errno if exc.errno in _NO_ROOM else None
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, max(int(nbytes), 1))
        elif shutil.disk_usage(folder).free < nbytes:  # macOS, Windows: no way to reserve the room
            return errno.ENOSPC
    except OSError as exc:  # EOPNOTSUPP where the file system cannot tell: not known to be full
        return exc.errno if exc.errno in _NO_ROOM else None
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return None


def _stamp(path: Path) -> None:
    """Record :func:`content_sha256` of the file at ``path`` (as :meth:`RunStore.load` reads it) in it."""
    import netCDF4

    digest = content_sha256(_read(path))
    with netCDF4.Dataset(path, "a") as f:
        f.setncattr(CHECKSUM_ATTR, digest)


def run_coords(spec: RunSpec) -> dict[str, object]:
    """Grid coordinates of one run along the ``run`` dimension."""
    p = spec.perturbations[0] if spec.perturbations else None
    coords: dict[str, object] = {
        "spec_hash": spec.spec_hash, "domain": spec.domain, "learner": spec.learner, "task": spec.task,
        "seed": spec.seed,
        "pert_kind": p.kind if p else "none",
        "pert_dose": p.dose if p else np.nan,
        "pert_start": p.start if p else np.nan,
        "pert_duration": p.duration if p else np.nan,
    }
    for k, v in spec.hp.items():
        coords[f"hp_{k}"] = json.dumps(v) if isinstance(v, list) else v
    return coords


def load_runs(specs: Iterable[RunSpec], store: RunStore | None = None, *, include_failed: bool = True,
              missing: str = "raise") -> xr.Dataset:
    """Load stored runs into one Dataset with dims ``(run, step)``.

    Runs of different length are aligned on ``step`` (NaN-padded). Coordinates
    along ``run`` come from :func:`run_coords` plus ``status`` and ``wall_time_s`` (the
    run's own compute time, when it was computed); hyperparameters
    absent from some specs are NaN there. ``missing``: ``"raise"`` or ``"skip"``
    runs that are not stored.
    """
    if missing not in ("raise", "skip"):
        raise ValueError(f"missing must be 'raise' or 'skip', got {missing!r}")
    store = store or RunStore()
    specs = list(dict.fromkeys(specs))
    loaded: list[tuple[xr.Dataset, dict]] = []
    failed = 0
    for spec in specs:
        try:
            ds = store.load(spec)
        except FileNotFoundError:
            if missing == "skip":
                continue
            raise
        if ds.attrs["status"] == "failed" and not include_failed:
            failed += 1
            continue
        coords = run_coords(spec)
        coords["status"] = ds.attrs["status"]
        coords["wall_time_s"] = float(ds.attrs.get("wall_time_s", np.nan))  # what a unit cost, stored or not
        loaded.append((ds, coords))
    if not loaded:
        if failed:
            raise ValueError(f"load_runs: every stored run of the given specs failed ({failed} of {len(specs)}; "
                             "the rest not stored); pass include_failed=True to load them with their errors, "
                             "or rerun them with run_grid(..., retry_failed=True)")
        raise ValueError("load_runs: none of the given specs is stored; run them with run_grid first")
    # Hyperparameters absent from some specs become NaN there, so every run has every coordinate.
    keys = list(dict.fromkeys(k for _, c in loaded for k in c))
    parts = [
        ds.expand_dims(run=[c["spec_hash"]]).assign_coords({k: ("run", [c.get(k, np.nan)]) for k in keys if k != "spec_hash"})
        for ds, c in loaded
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = xr.concat(parts, dim="run", join="outer", combine_attrs="drop", coords="different",
                        compat="equals", fill_value=np.nan)
    return out


def load_spec(ds: xr.Dataset) -> RunSpec:
    """The RunSpec stored in a single run's attributes."""
    return RunSpec.from_json(ds.attrs["spec"])


def stored_specs(store: RunStore | None = None) -> Sequence[RunSpec]:
    """Specs of every readable stored run."""
    store = store or RunStore()
    out = []
    for h in store.hashes():
        try:
            out.append(load_spec(store.load(h)))
        except CorruptRunError:
            continue
    return out
