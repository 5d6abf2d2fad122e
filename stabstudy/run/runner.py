"""Run a grid of specs on Dask, store every run, survive failures and interruptions.

``run_grid(specs)`` skips runs already stored (readable files with status ok,
diverged, or failed unless ``retry_failed``), recomputes corrupt files, runs the
rest on a ``dask.distributed`` cluster and writes each result atomically from
the client as it completes. Learners run on workers and return Datasets; they
know nothing of Dask or the store.

Scheduler choice (first that applies): the ``scheduler`` argument, the
``STABSTUDY_SCHEDULER`` environment variable, else an embedded
``LocalCluster`` with one single-threaded worker process per core.
``scheduler="serial"`` runs in this process without Dask (debugging, tests).

Progress: one tqdm bar per grid, redrawn in place. Where ``$STABSTUDY_PROGRESS_FILE``
is set (``stabstudy study`` sets it for each notebook's kernel), the grid's state
(:class:`GridProgress`) is also written there, atomically, after every run, so that
the study's terminal can show runs done / total and an ETA while the bar itself goes
into the notebook.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import xarray as xr

# tqdm.std, not tqdm.auto: in a kernel without ipywidgets tqdm.auto warns ("IProgress not found")
# into every executed notebook, and with ipywidgets its widget would be stored as an unreadable
# HBox repr; a text bar redrawn with carriage returns is what a stored notebook can show
from tqdm.std import tqdm

from stabstudy.registry import learner_for
from stabstudy.run.store import CorruptRunError, RunStore, code_identity, version_drift
from stabstudy.spec import RunSpec

log = logging.getLogger(__name__)

#: Environment variable naming the file where :func:`run_grid` reports its progress.
PROGRESS_ENV = "STABSTUDY_PROGRESS_FILE"
#: Seconds between redraws of the bar where stderr is not a terminal (a notebook): a stored
#: notebook keeps every redraw, so a few are enough (the terminal's bar comes from the file).
NOTEBOOK_MININTERVAL_S = 30.0
_GRID_NUMBERS = itertools.count(1)


@dataclass(frozen=True)
class GridProgress:
    """State of one :func:`run_grid` call, as written to ``$STABSTUDY_PROGRESS_FILE``."""

    pid: int
    """Process running the grid (with ``grid``, tells one grid from the next)."""
    grid: int
    """1 for the process's first grid, 2 for its second, ..."""
    done: int
    """Runs finished, ``cached`` included."""
    total: int
    cached: int
    """Runs found in the store when the grid started."""
    started_at: float
    """When the grid started, in seconds since the epoch: wall-clock time, which another process
    on the same machine (the study's terminal) can compare with its own."""
    elapsed_s: float
    finished: bool = False


def write_progress(path: str | Path, state: GridProgress) -> None:
    """Write ``state`` to ``path`` atomically (a reader sees the old or the new state, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)


def read_progress(path: str | Path) -> GridProgress | None:
    """The state last written to ``path``; None when it is absent or not a :class:`GridProgress`."""
    try:
        d = json.loads(Path(path).read_text())
        return GridProgress(pid=int(d["pid"]), grid=int(d["grid"]), done=int(d["done"]), total=int(d["total"]),
                            cached=int(d["cached"]), started_at=float(d["started_at"]),
                            elapsed_s=float(d["elapsed_s"]),
                            finished=bool(d.get("finished", False)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


class _Progress:
    """A grid's tqdm bar, mirrored to ``$STABSTUDY_PROGRESS_FILE`` where that is set."""

    def __init__(self, total: int, cached: int, show: bool) -> None:
        interactive = bool(getattr(sys.stderr, "isatty", lambda: False)())
        # a notebook: few redraws (maxinterval too, or tqdm's monitor thread forces one every 10 s),
        # and a fixed width, not that of whichever terminal started the kernel
        stored = {"mininterval": NOTEBOOK_MININTERVAL_S, "maxinterval": NOTEBOOK_MININTERVAL_S, "ncols": 100}
        self.bar = tqdm(total=total, initial=cached, desc="runs", unit="run", disable=not show,
                        **({} if interactive else stored))
        self.file = os.environ.get(PROGRESS_ENV) or None
        self.grid, self.t0, self.started_at = next(_GRID_NUMBERS), time.monotonic(), time.time()
        self.done, self.total, self.cached = cached, total, cached
        self._report()

    def update(self) -> None:
        """One more run finished."""
        self.done += 1
        self.bar.update()
        self._report()

    def close(self) -> None:
        """Draw the bar's last state and report the grid finished."""
        self.bar.close()
        self._report(finished=True)

    def _report(self, finished: bool = False) -> None:
        if not self.file:
            return
        state = GridProgress(os.getpid(), self.grid, self.done, self.total, self.cached, self.started_at,
                             time.monotonic() - self.t0, finished)
        try:
            write_progress(self.file, state)
        except OSError as e:  # the terminal's bar is a convenience: never fail a grid over it
            log.debug("cannot write progress to %s: %s", self.file, e)


@dataclass(frozen=True)
class RunRecord:
    """Outcome of one spec in a grid."""

    spec: RunSpec
    status: str
    """``ok`` | ``diverged`` | ``failed``."""
    cached: bool
    wall_time_s: float
    error: str = ""


def results_version(domain: str) -> int:
    """``RESULTS_VERSION`` of the domain's learner module (1 when it declares none).

    The store key is the spec alone, so a learner change that alters results
    must bump this number: stored runs of another version are then recomputed
    instead of silently reused.
    """
    return int(getattr(sys.modules[learner_for(domain).__module__], "RESULTS_VERSION", 1))


def execute(spec: RunSpec, threads: int | None = None) -> tuple[xr.Dataset | None, str, str, float]:
    """Run one spec, never raising: ``(dataset, status, error, wall_time_s)``.

    ``threads`` pins torch's intra-op threads (workers use 1 so N workers use N
    cores without oversubscription).
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        ds = learner_for(spec.domain)(spec)
        if not isinstance(ds, xr.Dataset):
            raise TypeError(f"learner for domain {spec.domain!r} returned {type(ds).__name__}, not xarray.Dataset")
        status = str(ds.attrs.get("status", "ok"))
        if status not in ("ok", "diverged"):
            raise ValueError(f"learner returned status {status!r}; learners return 'ok' or 'diverged'")
        return ds, status, "", time.perf_counter() - t0
    except Exception:  # a run that raises is data: stored as failed, the grid goes on
        return None, "failed", traceback.format_exc(), time.perf_counter() - t0


def made_by(domain: str) -> dict:
    """What a stored run records of the code that produced it: :func:`stabstudy.run.store.code_identity`
    and the learner's :func:`results_version`, read where the run executes (a worker's code may
    differ from the client's)."""
    return {**code_identity(domain), "results_version": results_version(domain)}


def _worker_task(spec: RunSpec) -> tuple[tuple[xr.Dataset | None, str, str, float], dict]:
    return execute(spec, threads=1), made_by(spec.domain)


def pending(specs: Iterable[RunSpec], store: RunStore, retry_failed: bool = False,
            statuses: dict[str, str | None] | None = None) -> list[RunSpec]:
    """Specs that still need running: absent, corrupt, stored by another
    :func:`results_version` of their learner, stale by the learner module's own
    ``stale(spec, attrs) -> reason | None`` where it has one (an LM run whose corpus
    file changed since), or failed when ``retry_failed``. Runs stored under other package
    versions (:func:`stabstudy.run.store.version_drift`) are recomputed only on request:
    ``$STABSTUDY_RERUN_STALE=1`` (``stabstudy study --rerun-stale``); ``stabstudy runs`` lists them.

    ``statuses`` (spec hash -> stored status), when given, is filled in so that
    callers need not read the store twice.
    """
    todo = []
    versions: dict[str, int] = {}
    for spec in specs:
        try:
            stored = store.load(spec)
            st = str(stored.attrs["status"])
            if spec.domain not in versions:
                versions[spec.domain] = results_version(spec.domain)
            why = None
            if int(stored.attrs.get("results_version", 1)) != versions[spec.domain]:
                why = (f"comes from results version {stored.attrs.get('results_version', 1)} of the "
                       f"{spec.domain} learner (now {versions[spec.domain]})")
            elif st != "failed":
                stale = getattr(sys.modules[learner_for(spec.domain).__module__], "stale", None)
                why = stale(spec, stored.attrs) if stale is not None else None
            if not why and os.environ.get("STABSTUDY_RERUN_STALE") == "1":
                drift = version_drift(stored.attrs, spec.domain)
                why = f"was made with other package versions ({'; '.join(drift)})" if drift else None
            if why:
                print(f"stabstudy: stored run {store.path(spec).name} {why}; recomputing {spec.label}")
                st = "stale"
        except FileNotFoundError:
            st = None
        except CorruptRunError:
            log.warning("stored run %s is corrupt; recomputing", store.path(spec))
            print(f"stabstudy: stored run {store.path(spec).name} is corrupt; recomputing {spec.label}")
            st = "corrupt"
        if statuses is not None:
            statuses[spec.spec_hash] = st
        if st in (None, "corrupt", "stale") or (st == "failed" and retry_failed):
            todo.append(spec)
    return todo


_CLUSTERS: dict[str, object] = {}


def get_client(scheduler: str | None = None, n_workers: int | None = None):
    """A ``distributed.Client``: to ``scheduler`` if given, else an embedded LocalCluster (reused)."""
    from distributed import Client, LocalCluster

    address = scheduler or os.environ.get("STABSTUDY_SCHEDULER") or None
    key = address or f"local:{n_workers}"
    client = _CLUSTERS.get(key)
    if client is not None and client.status == "running":
        return client
    if address:
        client = Client(address)
    else:
        n = n_workers or os.cpu_count() or 1
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0",
                               silence_logs=logging.ERROR)
        client = Client(cluster)
    _CLUSTERS[key] = client
    return client


def close_clients() -> None:
    """Close every client and embedded cluster this process started."""
    for client in list(_CLUSTERS.values()):
        cluster = getattr(client, "cluster", None)
        client.close()
        if cluster is not None:
            cluster.close()
    _CLUSTERS.clear()


def _store_result(store: RunStore, spec: RunSpec, result: tuple, producer: dict | None = None) -> RunRecord:
    """Store ``execute``'s result; ``producer``: :func:`made_by` where the run executed (default: here)."""
    ds, status, error, wall = result
    producer = producer or made_by(spec.domain)
    version = {"results_version": producer["results_version"]}
    code = {k: v for k, v in producer.items() if k != "results_version"}
    if status == "failed":
        store.save_failed(spec, error, wall, extra_attrs=version, made_by=code)
        print(f"stabstudy: run {spec.label} failed; traceback stored in {store.path(spec).name}:\n"
              + error.strip().splitlines()[-1])
    else:
        store.save(ds, spec, status, wall, extra_attrs=version, made_by=code)
    return RunRecord(spec, status, False, wall, error)


def run_grid(specs: Iterable[RunSpec], scheduler: str | None = None, store: RunStore | None = None, *,
             progress: bool = True, retry_failed: bool = False, n_workers: int | None = None) -> list[RunRecord]:
    """Run every spec not yet stored and return one :class:`RunRecord` per distinct spec.

    Args:
        specs: the grid; duplicates (same hash) run once.
        scheduler: Dask scheduler address, ``"serial"`` for in-process execution,
            or None for ``$STABSTUDY_SCHEDULER`` / an embedded LocalCluster.
        store: where runs live (default ``data/runs``).
        progress: show a tqdm bar of runs done / total (redrawn every
            :data:`NOTEBOOK_MININTERVAL_S` where stderr is not a terminal). Progress is
            written to ``$STABSTUDY_PROGRESS_FILE`` whenever that is set, shown or not.
        retry_failed: rerun specs stored as failed.
        n_workers: LocalCluster size (default: one per core).

    Ctrl-C cancels outstanding runs; finished runs stay stored (each written
    atomically), so calling again resumes.
    """
    store = store or RunStore()
    specs = list(specs)
    for s in specs:
        if not isinstance(s, RunSpec):
            raise TypeError(f"run_grid takes RunSpec objects, got {type(s).__name__}")
    specs = list({s.spec_hash: s for s in specs}.values())
    statuses: dict[str, str | None] = {}
    todo = {s.spec_hash for s in pending(specs, store, retry_failed, statuses)}
    records: dict[str, RunRecord] = {}
    for s in specs:
        if s.spec_hash not in todo:
            records[s.spec_hash] = RunRecord(s, statuses[s.spec_hash] or "ok", True, 0.0)
    work = [s for s in specs if s.spec_hash in todo]
    bar = _Progress(len(specs), len(specs) - len(work), progress)
    try:
        if not work:
            pass
        elif (scheduler or os.environ.get("STABSTUDY_SCHEDULER")) == "serial":
            for s in work:
                records[s.spec_hash] = _store_result(store, s, execute(s))
                bar.update()
        else:
            from distributed import as_completed

            client = get_client(None if scheduler == "serial" else scheduler, n_workers)
            futures = {client.submit(_worker_task, s, key=f"run-{s.spec_hash}", pure=False): s for s in work}
            try:
                for fut in as_completed(futures):
                    s = futures[fut]
                    try:
                        result, producer = fut.result()
                    except Exception:  # a worker died (e.g. out of memory): record, go on
                        result, producer = (None, "failed", traceback.format_exc(), float("nan")), None
                    records[s.spec_hash] = _store_result(store, s, result, producer)
                    bar.update()
            except BaseException:
                client.cancel(list(futures))
                raise
    finally:
        bar.close()
    return [records[s.spec_hash] for s in specs]


def summarize(records: Iterable[RunRecord]) -> dict[str, int]:
    """Counts by status plus ``cached``."""
    out: dict[str, int] = {"ok": 0, "diverged": 0, "failed": 0, "cached": 0}
    for r in records:
        out[r.status] = out.get(r.status, 0) + 1
        out["cached"] += int(r.cached)
    return out


__all__ = ["RunRecord", "run_grid", "GridProgress", "PROGRESS_ENV", "write_progress", "read_progress", "execute", "pending", "get_client", "close_clients", "summarize",
           "learner_for", "results_version", "CorruptRunError"]
