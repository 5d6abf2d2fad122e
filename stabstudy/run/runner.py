"""Run a grid of specs on Dask, store every run, survive failures and interruptions.

``run_grid(specs)`` skips runs already stored (readable files with status ok,
diverged, or failed unless ``retry_failed``), recomputes corrupt files, runs the
rest on a ``dask.distributed`` cluster and writes each result atomically from
the client as it completes. Learners run on workers and return Datasets; they
know nothing of Dask or the store.

Concurrent grids on one store share the work: a run is claimed (its lock file,
:meth:`stabstudy.run.store.RunStore.claim`) before it is computed and released when it is
stored, so a second grid computes the runs nobody holds and then waits for the rest,
reusing what the other stored. A crashed holder's claim ends with its process.

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

import collections
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

from stabstudy import paths
from stabstudy.registry import learner_for
from stabstudy.run.store import (
    CorruptRunError,
    RunStore,
    UnverifiedRunError,
    code_identity,
    version_drift,
)
from stabstudy.spec import RunSpec

log = logging.getLogger(__name__)

#: Environment variable naming the file where :func:`run_grid` reports its progress.
PROGRESS_ENV = "STABSTUDY_PROGRESS_FILE"
#: Seconds between redraws of the bar where stderr is not a terminal (a notebook): a stored
#: notebook keeps every redraw, so a few are enough (the terminal's bar comes from the file).
NOTEBOOK_MININTERVAL_S = 30.0
#: Seconds between two looks at runs another process is computing.
WAIT_POLL_S = 1.0
#: Seconds to reach a Dask scheduler before giving up (distributed's own default is 30).
SCHEDULER_TIMEOUT_S = 5.0
_GRID_NUMBERS = itertools.count(1)
#: What this process's grids said about stored runs (corrupt, stale, failed, waiting), in order:
#: printed where they happen and written to the progress file, so the study's terminal lists them.
_NOTES: list[str] = []


def note(message: str) -> None:
    """Print ``stabstudy: message`` and keep it for the study's terminal (:attr:`GridProgress.notes`)."""
    print(f"stabstudy: {message}", flush=True)
    _NOTES.append(message)


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
    notes: tuple[str, ...] = ()
    """Everything :func:`note` said in this process so far (corrupt, stale and failed runs, waits)."""
    found: int = 0
    """Runs another process stored while this grid ran (in ``done``, not in ``cached``): stored, not computed."""


def write_progress(path: str | Path, state: GridProgress) -> None:
    """Write ``state`` to ``path`` atomically (a reader sees the old or the new state, never half)."""
    paths.atomic_write(Path(path), json.dumps(asdict(state)))


def read_progress(path: str | Path) -> GridProgress | None:
    """The state last written to ``path``; None when it is absent or not a :class:`GridProgress`."""
    try:
        d = json.loads(Path(path).read_text())
        return GridProgress(pid=int(d["pid"]), grid=int(d["grid"]), done=int(d["done"]), total=int(d["total"]),
                            cached=int(d["cached"]), started_at=float(d["started_at"]),
                            elapsed_s=float(d["elapsed_s"]),
                            finished=bool(d.get("finished", False)),
                            notes=tuple(str(n) for n in d.get("notes", ())), found=int(d.get("found", 0)))
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
        self.done, self.total, self.cached, self.found = cached, total, cached, 0
        self._report()

    def update(self, found: bool = False) -> None:
        """One more run finished; ``found``: another process stored it."""
        self.done += 1
        self.found += int(found)
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
                             time.monotonic() - self.t0, finished, tuple(_NOTES), self.found)
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
    """Specs that still need running: absent, corrupt, without a checksum (written before runs
    carried one), stored by another :func:`results_version` of their learner, stale by the learner
    module's own ``stale(spec, attrs) -> reason | None`` where it has one (an LM run whose corpus
    file changed since), or failed when ``retry_failed``. Runs stored under another
    ``stabstudy_version`` or other package versions (:func:`stabstudy.run.store.version_drift`;
    the git commit is not one) are recomputed only on request: ``$STABSTUDY_RERUN_STALE=1``
    (``stabstudy study --rerun-stale``); ``stabstudy runs`` lists them.

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
                note(f"stored run {store.path(spec).name} {why}; recomputing {spec.label}")
                st = "stale"
        except FileNotFoundError:
            st = None
        except UnverifiedRunError:
            note(f"stored run {store.path(spec).name} carries no checksum (written before runs had one); "
                 f"recomputing {spec.label}")
            st = "stale"
        except CorruptRunError as exc:
            log.warning("stored run %s is corrupt; recomputing", store.path(spec))
            note(f"stored run {store.path(spec).name} is corrupt ({exc.reason}); recomputing {spec.label}")
            st = "corrupt"
        if statuses is not None:
            statuses[spec.spec_hash] = st
        if st in (None, "corrupt", "stale") or (st == "failed" and retry_failed):
            todo.append(spec)
    return todo


_CLUSTERS: dict[str, object] = {}


class SchedulerUnreachableError(ConnectionError):
    """No Dask scheduler answered at the address given."""


def connect(address: str, timeout_s: float = SCHEDULER_TIMEOUT_S):
    """A ``distributed.Client`` to the scheduler at ``address``; :class:`SchedulerUnreachableError`
    naming the address when none answers within ``timeout_s`` seconds."""
    from distributed import Client

    try:
        return Client(address, timeout=timeout_s)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:  # refused, timed out, not an address
        raise SchedulerUnreachableError(
            f"no Dask scheduler answers at {address!r} within {timeout_s:g} s ({type(exc).__name__}: {exc}); "
            "start one there (`dask scheduler`), or leave the scheduler out for an embedded LocalCluster "
            "(or 'serial' to run in this process)") from exc


def check_scheduler(address: str, timeout_s: float = SCHEDULER_TIMEOUT_S) -> None:
    """Raise :class:`SchedulerUnreachableError` unless a scheduler answers at ``address`` within
    ``timeout_s`` (``"serial"`` needs none)."""
    if address != "serial":
        connect(address, timeout_s).close()


def get_client(scheduler: str | None = None, n_workers: int | None = None):
    """A ``distributed.Client``: to ``scheduler`` if given, else an embedded LocalCluster (reused)."""
    from distributed import Client, LocalCluster

    address = scheduler or os.environ.get("STABSTUDY_SCHEDULER") or None
    key = address or f"local:{n_workers}"
    client = _CLUSTERS.get(key)
    if client is not None and client.status == "running":
        return client
    if address:
        client = connect(address)
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
        note(f"run {spec.label} failed; traceback stored in {store.path(spec).name}:\n"
             + (error.strip().splitlines() or ["(no traceback)"])[-1])
    else:
        store.save(ds, spec, status, wall, extra_attrs=version, made_by=code)
    return RunRecord(spec, status, False, wall, error)


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells one version of a stored file from the next: inode, size, mtime (None: absent)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class _Claims:
    """The runs of a grid still to compute, handed out one at a time under their lock.

    :meth:`next` claims a run nobody else holds; a run held by another process is set aside and
    tried again later. Once claimed, a run whose file changed since the grid looked at the store
    was stored by that other process: it is used as stored (``found``) unless :func:`pending`
    still wants it recomputed (corrupt, stale)."""

    def __init__(self, work: list[RunSpec], store: RunStore, seen: dict[str, tuple | None]) -> None:
        self.store, self.seen = store, seen
        self.queue = collections.deque(work)
        self.waiting: list[RunSpec] = []
        self.held: set[str] = set()
        self.found: dict[str, str] = {}
        """spec hash -> status of runs another process stored meanwhile."""
        self._announced = False

    def _take(self, s: RunSpec) -> bool | None:
        """True: claimed and still to compute; False: held elsewhere; None: stored meanwhile."""
        if not self.store.claim(s):
            return False
        if _signature(self.store.path(s)) != self.seen.get(s.spec_hash):
            statuses: dict[str, str | None] = {}
            if not pending([s], self.store, statuses=statuses):  # retried there already: not again
                self.store.release(s)
                self.found[s.spec_hash] = statuses[s.spec_hash] or "ok"
                return None
        self.held.add(s.spec_hash)
        return True

    def next(self, block: bool) -> RunSpec | None:
        """A claimed run to compute, or None: nothing left, or (``block`` False) nothing free now.
        With ``block``, waits for runs other processes hold until each is stored or free."""
        while True:
            while self.queue:
                s = self.queue.popleft()
                got = self._take(s)
                if got:
                    return s
                if got is False:
                    self.waiting.append(s)
            for s in list(self.waiting):
                got = self._take(s)
                if got is not False:
                    self.waiting.remove(s)
                if got:
                    return s
            if not self.waiting or not block:
                return None
            if not self._announced:
                note(f"{len(self.waiting)} run(s) are being computed by another process (locks in "
                     f"{Path(self.store.root) / '.locks'}); waiting to use what it stores")
                self._announced = True
            time.sleep(WAIT_POLL_S)

    def done(self, s: RunSpec) -> None:
        self.held.discard(s.spec_hash)
        self.store.release(s)

    def release_all(self) -> None:
        for h in list(self.held):
            self.held.discard(h)
            self.store.release(h)


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
        retry_failed: rerun specs stored as failed (``stabstudy study --retry-failed``).
        n_workers: LocalCluster size (default: one per core).

    Each run is claimed (:meth:`RunStore.claim`) while it is computed: another grid on the same
    store computes other runs, then waits for these and reuses them (``cached``). On Dask, at most
    twice as many runs as the cluster has threads at the moment are claimed (and submitted) at a
    time, so that two grids share the work. Ctrl-C cancels the runs not started and drops those in flight
    (on Dask they run to their end on the workers, unused); finished runs stay stored (each written
    atomically), so calling again resumes. It raises ``KeyboardInterrupt`` saying how many were stored.
    """
    store = store or RunStore()
    specs = list(specs)
    for s in specs:
        if not isinstance(s, RunSpec):
            raise TypeError(f"run_grid takes RunSpec objects, got {type(s).__name__}")
    specs = list({s.spec_hash: s for s in specs}.values())
    seen = {s.spec_hash: _signature(store.path(s)) for s in specs}  # before reading: a later write shows
    statuses: dict[str, str | None] = {}
    todo = {s.spec_hash for s in pending(specs, store, retry_failed, statuses)}
    records: dict[str, RunRecord] = {}
    for s in specs:
        if s.spec_hash not in todo:
            records[s.spec_hash] = RunRecord(s, statuses[s.spec_hash] or "ok", True, 0.0)
    work = [s for s in specs if s.spec_hash in todo]
    bar = _Progress(len(specs), len(specs) - len(work), progress)
    claims = _Claims(work, store, seen)

    def next_run(block: bool) -> RunSpec | None:
        s = claims.next(block)
        for h, st in claims.found.items():  # stored by another process meanwhile
            records[h] = RunRecord(next(x for x in work if x.spec_hash == h), st, True, 0.0)
            bar.update(found=True)
        claims.found.clear()
        return s

    try:
        if not work:
            pass
        elif (scheduler or os.environ.get("STABSTUDY_SCHEDULER")) == "serial":
            while (s := next_run(block=True)) is not None:
                records[s.spec_hash] = _store_result(store, s, execute(s))
                claims.done(s)
                bar.update()
        else:
            from distributed import wait

            client = get_client(None if scheduler == "serial" else scheduler, n_workers)
            futures: dict = {}
            try:
                while True:
                    # read again each round: the workers of a cluster started with scale() arrive over minutes
                    window = 2 * max(1, sum(client.nthreads().values()))
                    while len(futures) < window and (s := next_run(block=not futures)) is not None:
                        futures[client.submit(_worker_task, s, key=f"run-{s.spec_hash}", pure=False)] = s
                    if not futures:
                        break
                    try:  # a timeout, so that runs other processes held are looked at again meanwhile
                        done = wait(list(futures), timeout=WAIT_POLL_S, return_when="FIRST_COMPLETED").done
                    except TimeoutError:
                        continue
                    for fut in done:
                        s = futures.pop(fut)
                        try:
                            result, producer = fut.result()
                        except Exception:  # a worker died (e.g. out of memory): record, go on
                            result, producer = (None, "failed", traceback.format_exc(), float("nan")), None
                        records[s.spec_hash] = _store_result(store, s, result, producer)
                        claims.done(s)
                        bar.update()
            except BaseException:
                client.cancel(list(futures))
                raise
    except KeyboardInterrupt:
        computed = sum(1 for r in records.values() if not r.cached)
        # a fresh exception, without the Dask or learner frames it came through: IPython takes seconds to
        # format those, which a notebook stopped by Ctrl-C would wait for
        raise KeyboardInterrupt(f"run_grid interrupted: {computed} of the {len(work)} runs to compute were stored, "
                                "the others not (those in flight dropped); calling it again resumes") from None
    finally:
        claims.release_all()
        bar.close()
    return [records[s.spec_hash] for s in specs]


def summarize(records: Iterable[RunRecord]) -> dict[str, int]:
    """Counts by status plus ``cached``."""
    out: dict[str, int] = {"ok": 0, "diverged": 0, "failed": 0, "cached": 0}
    for r in records:
        out[r.status] = out.get(r.status, 0) + 1
        out["cached"] += int(r.cached)
    return out


__all__ = ["RunRecord", "run_grid", "GridProgress", "PROGRESS_ENV", "write_progress", "read_progress", "execute", "pending",
           "get_client", "connect", "check_scheduler", "SchedulerUnreachableError", "close_clients", "summarize",
           "note", "learner_for", "results_version", "CorruptRunError"]
