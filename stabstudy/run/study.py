"""Run the study: execute the notebooks in order with papermill under a profile.

Profiles live in ``stabstudy/profiles/<name>.yaml``: notebook stem -> parameter
overrides. ``smoke`` shrinks sizes for CI (minutes), ``quick`` is ``make study``
on a 2-core machine, ``standard`` is notebook 01's full design (more prefixes, claim (c), both
prefix regimes; the other notebooks at their quick sizes) for a Dask cluster or a many-core
machine, ``paper`` is hours on a Dask cluster. A
profile only changes sizes, never the code path. Executed copies go to
``build/<profile>/``; figures to ``figures/<notebook>/``.

While a notebook runs, the terminal shows papermill's cell bar and, for each
grid the notebook runs, a bar of runs done / total with an ETA, read from the
file the kernel's :func:`stabstudy.run.runner.run_grid` writes its progress to
(``$STABSTUDY_PROGRESS_FILE``, set here for each notebook), and the notes the kernel's grids
make (corrupt, stale or failed runs, waits for another study's runs). The executed copy is
then stored as a reader sees it: consecutive stream outputs merged, progress bars
reduced to their last state (:func:`collapse_streams`); warnings it printed are
repeated on the terminal (:func:`warnings_in`).

Ctrl-C stops the study within seconds (:class:`Interrupt`): the running kernel's grid cancels the
runs not started and drops those in flight, no further cell or notebook starts, the executed copy is
marked interrupted (``stabstudy report`` refuses it), and the same command resumes from the runs stored.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from stabstudy import paths

PROFILES = paths.PROFILES


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


#: What papermill injects into every notebook beside its profile's values: each notebook's
#: parameters cell declares them (papermill warns "Passed unknown parameter" otherwise).
INJECTED = ("profile", "scheduler", "retry_failed")


def parameters_for(nb: Path, profile: str, scheduler: str | None, retry_failed: bool = False) -> dict[str, Any]:
    """The parameters papermill injects into ``nb`` for ``profile``."""
    params = dict(load_profile(profile).get(nb.stem, {}))
    params.update(zip(INJECTED, (profile, scheduler or "", bool(retry_failed)), strict=True))
    return params


def notebook_defaults(stem: str) -> dict[str, Any]:
    """The literals of notebook ``stem``'s parameters cell: what it runs with where a profile sets nothing."""
    import ast
    import json

    nb = paths.notebooks_dir() / f"{stem}.ipynb"
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"{nb.name}: {len(tagged)} cells tagged 'parameters' (want 1)")
    src = tagged[0]["source"]
    body = ast.parse("".join(src) if isinstance(src, list) else src).body
    return {n.targets[0].id: ast.literal_eval(n.value) for n in body if isinstance(n, ast.Assign)}


def resolved_parameters(stem: str, profile: str) -> dict[str, Any]:
    """The parameters notebook ``stem`` runs with under ``profile``: its parameters cell with the
    profile's values over it (e.g. to estimate another profile's cost from inside a notebook)."""
    return {**notebook_defaults(stem), **load_profile(profile).get(stem, {}), "profile": profile}


#: A carriage return not followed by a newline, with what it overwrites (the rest of its line so far).
_OVERWRITTEN = re.compile(r"[^\n]*\r(?=[^\n])")
#: The line a Python warning prints: ``path:line: SomeWarning: message``.
_WARNING_LINE = re.compile(r"^.*\b\w*Warning: .*$", re.MULTILINE)


def terminal_text(text: str) -> str:
    """What a terminal or Jupyter shows of ``text``: a carriage return starts its line over, so a
    progress bar redrawn in place leaves only its last state."""
    return _OVERWRITTEN.sub("", text.replace("\r\n", "\n"))


def collapse_streams(nb: Any) -> Any:
    """``nb`` (an nbformat notebook) with each cell's stream outputs shown as a reader sees them.

    Between two non-stream outputs (figures, tables), the pieces of stdout are merged into one
    output and those of stderr into another (kernels send a stream in many messages, and a
    print between two redraws of a progress bar would otherwise split it); then each is reduced
    by :func:`terminal_text`. Figures and tables keep their place. Modifies and returns ``nb``.
    """
    for cell in nb.cells:
        if cell.get("cell_type") != "code" or not cell.get("outputs"):
            continue
        outputs, open_streams = [], {}
        for out in cell.outputs:
            if out.get("output_type") != "stream":
                outputs.append(out)
                open_streams = {}  # a figure or table ends the run of streams
                continue
            text = "".join(out.text) if isinstance(out.text, list) else out.text
            if out.name in open_streams:
                open_streams[out.name].text += text
            else:
                out.text = text
                open_streams[out.name] = out
                outputs.append(out)
        for out in outputs:
            if out.get("output_type") == "stream":
                out.text = terminal_text(out.text)
        cell.outputs = [o for o in outputs if o.get("output_type") != "stream" or o.text]
    return nb


def warnings_in(nb: Any) -> list[str]:
    """The Python warning lines (``...: SomeWarning: ...``) that ``nb``'s cells printed to stderr."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = "".join(out.text) if isinstance(out.text, list) else out.text
                found += [m.group(0).strip() for m in _WARNING_LINE.finditer(text)]
    return found


class TerminalProgress:
    """One terminal tqdm bar per grid a notebook runs, polled from the kernel's progress file.

    Use as a context manager around the notebook's execution; reads ``path`` every
    ``interval_s`` seconds in a background thread. A missing or unreadable file shows nothing.
    """

    def __init__(self, notebook: str, path: Path, interval_s: float = 1.0) -> None:
        self.notebook, self.path, self.interval_s = notebook, path, interval_s
        self.bar: Any = None
        self._grid: tuple[int, int] | None = None
        self._finished: set[tuple[int, int]] = set()
        self._noted: dict[int, int] = {}  # kernel pid -> notes already printed
        # (pid, grid) -> (runs, found stored: at the start, or stored by another process meanwhile)
        self._counts: dict[tuple[int, int], tuple[int, int]] = {}
        self._tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"progress-{notebook}", daemon=True)

    def __enter__(self) -> TerminalProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the grid's last state, should it have ended between two polls
        self._close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as e:  # a display problem must not stop the study
                print(f"stabstudy: progress display stopped: {e}", file=sys.stderr)
                return

    def poll(self) -> None:
        """Read the progress file once and bring the bars up to date."""
        from tqdm.std import tqdm

        from stabstudy.run.runner import NOTEBOOK_MININTERVAL_S, read_progress

        state = read_progress(self.path)
        if state is None:
            return
        for text in state.notes[self._noted.get(state.pid, 0):]:  # corrupt, stale, failed runs: as they happen
            tqdm.write(f"   {self.notebook}: " + text.replace("\n", "\n     "), file=sys.stderr)
        self._noted[state.pid] = len(state.notes)
        key = (state.pid, state.grid)
        self._counts[key] = (state.total, state.cached + state.found)
        if key in self._finished:
            return  # the grid ended and its bar is closed; the next one has not started
        if self.bar is None or key != self._grid:
            self._close()
            self._grid = key
            # smoothing=0: the ETA comes from the mean rate over the grid (runs take seconds to minutes);
            # a log file (stderr no terminal) keeps every redraw, so it gets one every 30 s at most
            every = {} if self._tty else {"mininterval": NOTEBOOK_MININTERVAL_S, "maxinterval": NOTEBOOK_MININTERVAL_S}
            self.bar = tqdm(total=state.total, initial=state.cached, desc=f"{self.notebook} grid {state.grid}",
                            unit="run", smoothing=0, file=sys.stderr, **every)
            # elapsed time and rate since the grid started in the kernel, not since this bar appeared
            self.bar.start_t = self.bar.last_print_t = min(state.started_at, time.time())
        if state.done > self.bar.n:
            self.bar.update(state.done - self.bar.n)
        if self._tty:
            self.bar.refresh()  # the elapsed time ticks on between two runs
        if state.finished:
            self._finished.add(key)
            self._close()

    @property
    def runs(self) -> tuple[int, int]:
        """(runs computed, runs found stored) over the grids seen so far: whether a notebook's time
        was that of computing its runs or of reading them."""
        return (sum(t - c for t, c in self._counts.values()), sum(c for _, c in self._counts.values()))

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class CpuMeter:
    """CPU seconds (user + system) of this process's descendants while the context is open: the
    notebook's kernel and the Dask workers it starts, sampled every ``interval_s`` seconds
    (psutil), so that a process that has exited counts with its last sample (a process that lived
    less than one interval may be missed). ``seconds`` holds the total after the context closes."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s, self.seconds = interval_s, 0.0
        self._last: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.seconds = sum(self._last.values())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        import psutil

        for proc in psutil.Process().children(recursive=True):
            try:
                with proc.oneshot():
                    t = proc.cpu_times()
                    self._last[(proc.pid, proc.create_time())] = t.user + t.system
            except psutil.Error:  # exited between the listing and the read
                continue


#: The kernel managers this process made (:func:`kernel_manager_class`): where Ctrl-C is passed on.
_KERNELS: weakref.WeakSet = weakref.WeakSet()


def kernel_manager_class() -> type:
    """The Jupyter kernel manager the study's kernels run under: local IPC sockets, not TCP.

    ipykernel prints "Kernel is running over TCP without encryption" on the terminal for every
    kernel it serves over TCP, a warning a user cannot act on. The study's kernels live on this
    machine only, so Unix-domain sockets (in Jupyter's private runtime folder) need no
    encryption; where there are none (Windows) the default TCP transport stays. Each manager is
    kept (weakly) so that :class:`Interrupt` can reach its kernel.
    """
    import uuid

    from jupyter_client.manager import KernelManager
    from jupyter_core.paths import jupyter_runtime_dir

    class StudyKernelManager(KernelManager):
        def __init__(self, **kwargs: Any):
            if os.name == "posix":
                kwargs.setdefault("transport", "ipc")
                # without a connection file yet, jupyter_client names the sockets kernel-ipc-N in the
                # working folder, where a killed kernel leaves them and two studies race for the names
                runtime = Path(jupyter_runtime_dir())
                runtime.mkdir(parents=True, exist_ok=True)
                kwargs.setdefault("ip", str(runtime / f"stabstudy-{uuid.uuid4().hex[:12]}-ipc"))
            super().__init__(**kwargs)
            _KERNELS.add(self)

    return StudyKernelManager


class StudyInterrupted(Exception):
    """Ctrl-C stopped ``stabstudy study`` in notebook ``notebook`` (its executed copy, marked
    interrupted, is ``executed``), or before it started (``executed`` None)."""

    def __init__(self, notebook: str, executed: Path | None) -> None:
        super().__init__(f"interrupted {'in' if executed else 'before'} {notebook}")
        self.notebook, self.executed = notebook, executed


class NotebookFailed(Exception):
    """A cell of notebook ``notebook`` raised (``ename: evalue``); its executed copy, with the
    traceback, is ``executed``. The study stops there."""

    def __init__(self, notebook: str, executed: Path, cell: int, ename: str, evalue: str) -> None:
        super().__init__(f"{notebook} failed: cell {cell} raised {ename}: {evalue} (the executed copy with the "
                         f"traceback: {executed}; the runs stored so far are whole, the same command resumes)")
        self.notebook, self.executed, self.ename, self.evalue = notebook, executed, ename, evalue


class Interrupt:
    """Ctrl-C during a study, as a context manager around the notebooks' execution (main thread only).

    The kernel runs in a session of its own (jupyter_client starts it so), so a terminal's SIGINT
    reaches this process only. The first one is passed on to the running kernel alone, not to its
    process group: the cell's grid gets ``KeyboardInterrupt``, cancels the runs not started and
    drops those in flight (a run's file is written whole or not at all), and the cell ends. No
    cell starts after it (:meth:`before_cell`, nbclient's ``on_cell_execute`` hook, also where the
    signal came while the kernel was between two cells and ignored it), and no notebook
    (:attr:`requested`). A second SIGINT stops this process at once.
    """

    def __init__(self) -> None:
        self.requested = False
        self._installed = False
        self._previous: Any = signal.default_int_handler

    def __enter__(self) -> Interrupt:
        # signals reach the main thread only; a process started to ignore SIGINT (`nohup`, `&`) keeps ignoring it
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            # None: a handler not set from Python, which cannot be put back; Python's own stands in
            self._previous = signal.signal(signal.SIGINT, self._handle) or signal.default_int_handler
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # the second Ctrl-C: now
            signal.signal(signal.SIGINT, self._previous)
            raise KeyboardInterrupt
        self.requested = True
        print("\nstabstudy: Ctrl-C: stopping after the runs in flight are dropped (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)
        for km in list(_KERNELS):
            # the Popen, not a bare pid: it signals no process once its kernel has been waited for
            process = getattr(getattr(km, "provisioner", None), "process", None)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)

    def before_cell(self, cell: Any = None, cell_index: int | None = None, **kw: Any) -> None:
        """nbclient's ``on_cell_execute`` hook: refuse to start a cell once interrupted."""
        if self.requested:
            from nbclient.exceptions import CellExecutionError

            raise CellExecutionError("stabstudy study was interrupted before this cell", "KeyboardInterrupt",
                                     "interrupted before this cell")


def expected_times(profile: str, stems: Sequence[str]) -> str | None:
    """A line saying how long ``stems`` took when their pages of ``results/<profile>/`` were made
    and, where a page was made with its runs stored, how long that notebook last took computing them
    (the page's ``from_scratch``), beside the number of runs stored here now: with none stored, the
    from-scratch times are the estimate. A page whose notebook has changed since it was made is
    flagged: its time may have been measured on another design. None when no page is published."""
    import json
    import math

    f = paths.results_dir(profile) / "manifest.json"
    pages = json.loads(f.read_text()).get("notebooks", {}) if f.exists() else {}
    known = [(s, pages[s]) for s in stems if s in pages and math.isfinite(pages[s].get("wall_s", math.nan))]
    if not known:
        return None

    def when(e: dict) -> str:
        return f"{e['commit'][:7]}, {str(e.get('end', ''))[:10]}"

    from stabstudy.run.store import source_hashes

    now = source_hashes()

    def redesigned(stem: str, e: dict) -> str:
        # A page's time says nothing about a design made after it. The notebook's own file, not the
        # profile's: the profile is one file for every notebook (and mostly comments).
        f = f"notebooks/{stem}.ipynb"
        then = e.get("sources", {}).get(f)
        changed = then is not None and f in now and now[f] != then
        return " [its notebook has changed since: this time may not hold]" if changed else ""

    parts, scratch = [], 0.0
    for s, e in known:
        n, stored, fs = e.get("runs_computed", -1), e.get("runs_stored", -1), e.get("from_scratch")
        if n > 0 and stored == 0:
            parts.append(f"{s[:2]} {e['wall_s'] / 60:.0f} min computing its {n} runs ({when(e)})" + redesigned(s, e))
        else:
            runs = f"{stored} of {n + stored} runs stored" if n >= 0 else "runs stored or not: not recorded"
            parts.append(f"{s[:2]} {e['wall_s'] / 60:.0f} min ({when(e)}; {runs})" +
                         (f", from scratch {fs['wall_s'] / 60:.0f} min ({when(fs)})" if fs else ", from scratch: not measured")
                         + redesigned(s, e))
        scratch += e["wall_s"] if n > 0 and stored == 0 else fs["wall_s"] if fs else math.nan
    missing = [s[:2] for s in stems if s not in dict(known)]
    here = len(list(paths.runs_dir().glob("*.nc"))) if paths.runs_dir().exists() else 0
    total = f"{scratch / 60:.0f} min" if math.isfinite(scratch) else "unknown (not every notebook measured)"
    return (f"last measured (results/{profile}): {'; '.join(parts)}" +
            (f"; never measured: {', '.join(missing)}" if missing else "") +
            f". Runs stored here now: {here}" + ("" if here else f"; from scratch the selected notebooks took {total}"))


def run_study(profile: str = "quick", only: Sequence[str] | None = None, scheduler: str | None = None,
              out_dir: Path | None = None, retry_failed: bool = False) -> list[tuple[str, float, float]]:
    """Execute the selected notebooks in order; return ``(stem, wall seconds, CPU seconds)`` per
    notebook (:class:`CpuMeter`: the kernel and an embedded cluster's workers; a remote scheduler's
    workers are not counted).

    Validation happens before anything is executed or written, the scheduler's too: one that does
    not answer (``scheduler``, else ``$STABSTUDY_SCHEDULER``) raises
    :class:`~stabstudy.run.runner.SchedulerUnreachableError` within seconds, naming its address.
    Stops at the first failing notebook with :class:`NotebookFailed` (papermill keeps the executed
    copy with the error), and on Ctrl-C with :class:`StudyInterrupted` (:class:`Interrupt`).
    Each executed copy is stored with :func:`collapse_streams` applied. ``retry_failed``: every
    notebook's grids recompute the runs stored as failed.
    """
    import papermill as pm

    from stabstudy.run.runner import PROGRESS_ENV, check_scheduler
    from stabstudy.run.store import git_commit

    load_profile(profile)  # validate first: nothing is written for a bad profile
    selected = select(only)
    address = scheduler or os.environ.get("STABSTUDY_SCHEDULER")
    if address:
        check_scheduler(address)
    out_dir = out_dir or paths.build_dir() / profile
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = git_commit()  # the report may run at a later commit: the page names this one
    timings = []
    eta = expected_times(profile, [nb.stem for nb in selected])
    if eta:
        print(eta, flush=True)
    env_backup = {k: os.environ.get(k) for k in ("MPLBACKEND", PROGRESS_ENV)}
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        with tempfile.TemporaryDirectory(prefix="stabstudy-progress-") as tmp, Interrupt() as stop:
            for nb in selected:
                if stop.requested:  # Ctrl-C as the last notebook ended: it finished, the next does not start
                    raise StudyInterrupted(nb.stem, None)
                t0 = time.perf_counter()
                print(f"== {nb.stem} ({profile})", flush=True)
                progress = Path(tmp) / f"{nb.stem}.json"
                os.environ[PROGRESS_ENV] = str(progress)  # the kernel inherits it
                cpu, bars = CpuMeter(), TerminalProgress(nb.stem, progress)
                ended = False
                try:
                    with bars, cpu:
                        pm.execute_notebook(str(nb), str(out_dir / nb.name), cwd=str(paths.root()),
                                            parameters=parameters_for(nb, profile, scheduler, retry_failed),
                                            kernel_name="python3", progress_bar=True,
                                            kernel_manager_class=kernel_manager_class(),
                                            on_cell_execute=stop.before_cell)
                    ended = True
                except BaseException as exc:  # a second Ctrl-C (KeyboardInterrupt) included
                    if stop.requested:
                        raise StudyInterrupted(nb.stem, out_dir / nb.name) from exc
                    if isinstance(exc, pm.PapermillExecutionError):  # its own text is the whole traceback
                        raise NotebookFailed(nb.stem, out_dir / nb.name, exc.cell_index + 1, exc.ename,
                                             exc.evalue) from exc
                    raise
                finally:  # a failed or interrupted notebook's executed copy is read too
                    _tidy(out_dir / nb.name, cpu_s=cpu.seconds, runs=bars.runs, commit=commit,
                          interrupted=stop.requested and not ended)
                timings.append((nb.stem, time.perf_counter() - t0, cpu.seconds))
                print(f"   {nb.stem}: {timings[-1][1]:.0f} s wall, {cpu.seconds:.0f} CPU-s", flush=True)
    finally:
        for k, v in env_backup.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return timings


def _tidy(executed: Path, cpu_s: float | None = None, runs: tuple[int, int] | None = None,
          commit: str | None = None, interrupted: bool = False) -> None:
    """Store ``executed`` with :func:`collapse_streams` applied (and, for the report, its CPU seconds,
    the runs it computed and found stored and the commit it ran at in the metadata:
    ``stabstudy.cpu_s``, ``stabstudy.runs_computed``, ``stabstudy.runs_stored``, ``stabstudy.commit``
    with ``stabstudy.machine``;
    ``stabstudy.interrupted`` where Ctrl-C stopped it, which ``stabstudy report`` refuses)
    and repeat its warnings on the terminal."""
    import nbformat

    from stabstudy.run import costs

    if not executed.exists():
        return
    node = collapse_streams(nbformat.read(executed, as_version=4))
    if cpu_s is not None:
        node.metadata.setdefault("stabstudy", {})["cpu_s"] = round(float(cpu_s), 1)
    if runs is not None:
        node.metadata.setdefault("stabstudy", {}).update(runs_computed=int(runs[0]), runs_stored=int(runs[1]))
    if commit is not None:
        node.metadata.setdefault("stabstudy", {})["commit"] = commit
        node.metadata["stabstudy"]["machine"] = costs.machine()
    if interrupted:
        node.metadata.setdefault("stabstudy", {})["interrupted"] = True
    nbformat.write(node, executed)
    found = warnings_in(node)
    if found:
        print(f"   {executed.stem} printed {len(found)} warning(s):", *found, sep="\n     ", flush=True)
