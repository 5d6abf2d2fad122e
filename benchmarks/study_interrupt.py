"""How long Ctrl-C takes to stop `stabstudy study` while minute-long runs are in flight.

A throwaway project holds one notebook whose grid is ``--runs`` toy runs of about ``--run-s``
seconds each (the step count is calibrated here first) on an embedded cluster of ``--workers``
workers. `stabstudy study --profile smoke` runs it in a process group of its own, as a terminal
starts a command; once the first run is stored and ``--after`` more seconds have passed (runs are
then in flight on every worker), SIGINT goes to the whole group, as Ctrl-C sends it. Printed: the
seconds from the signal to the command's exit, its exit status, the runs stored at the signal and
at the end, and whether the kernel and its workers are gone.

    OMP_NUM_THREADS=1 python benchmarks/study_interrupt.py [--runs 8] [--run-s 60] [--workers 2] [--after 30]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import psutil

from stabstudy.run.runner import execute
from stabstudy.spec import RunSpec

NOTEBOOK = """
import json, os
from pathlib import Path
from stabstudy.run.runner import get_client, run_grid
from stabstudy.spec import RunSpec
data = Path(os.environ["STABSTUDY_DATA"])
workers = list(get_client(None, {workers}).run(os.getpid).values())
(data / "pids.json").write_text(json.dumps([os.getpid(), *workers]))
specs = [RunSpec("toy", "gd", "digits", steps={steps}, seed=s, hparams={{"width": 8}}) for s in range({runs})]
run_grid(specs, scheduler=scheduler or None, n_workers={workers}, retry_failed=retry_failed)
"""


def steps_for(seconds: float) -> int:
    """Toy steps that take about ``seconds`` on this machine now (one thread)."""
    n = 2000
    execute(RunSpec("toy", "gd", "digits", steps=50, seed=0, hparams={"width": 8}), threads=1)  # warm up
    t0 = time.perf_counter()
    execute(RunSpec("toy", "gd", "digits", steps=n, seed=0, hparams={"width": 8}), threads=1)
    return max(50, int(n * seconds / (time.perf_counter() - t0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--run-s", type=float, default=60.0, help="seconds a run should take")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--after", type=float, default=30.0, help="seconds after the first stored run to send Ctrl-C")
    args = ap.parse_args()
    steps = steps_for(args.run_s)
    root = Path(tempfile.mkdtemp(prefix="stabstudy-interrupt-"))
    (root / "notebooks").mkdir()
    data = root / "data"
    data.mkdir()
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell('profile = "smoke"\nscheduler = ""\nretry_failed = False',
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(NOTEBOOK.format(workers=args.workers, steps=steps, runs=args.runs))]
    nbformat.write(nb, root / "notebooks" / "00_minute.ipynb")
    env = {**os.environ, "STABSTUDY_ROOT": str(root), "STABSTUDY_DATA": str(data),
           "STABSTUDY_FIGURES": str(root / "figures")}
    env.pop("STABSTUDY_SCHEDULER", None)
    print(f"{args.runs} runs of {steps} toy steps (about {args.run_s:.0f} s each when calibrated), {args.workers} workers")
    t_start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "stabstudy", "study", "--profile", "smoke"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    runs = data / "runs"
    while not list(runs.glob("*.nc")):
        if proc.poll() is not None:
            sys.exit(f"the study ended before storing a run:\n{proc.stderr.read()}")
        time.sleep(0.1)
    first = time.monotonic()
    time.sleep(args.after)
    at_signal = len(list(runs.glob("*.nc")))
    t0, wall0 = time.monotonic(), time.time()
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate()[1]
    latency = time.monotonic() - t0
    executed = nbformat.read(root / "build" / "smoke" / "00_minute.ipynb", as_version=4)
    ends = [c.metadata.get("papermill", {}).get("end_time") for c in executed.cells]
    cell_end = max(datetime.datetime.fromisoformat(e).timestamp() for e in ends if e)
    kernel_end = datetime.datetime.fromisoformat(executed.metadata["papermill"]["end_time"]).timestamp()
    pids = json.loads((data / "pids.json").read_text())
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    print(f"first run stored {first - t_start:.1f} s after the start; Ctrl-C {args.after:.0f} s later")
    print(f"Ctrl-C to exit: {latency:.1f} s, exit status {proc.returncode}; runs stored at the signal {at_signal}, "
          f"at the end {len(list(runs.glob('*.nc')))} of {args.runs}; kernel and workers still alive: {alive or 'none'}")
    print(f"of which: to the interrupted cell's end {cell_end - wall0:.1f} s, then the kernel's shutdown "
          f"{kernel_end - cell_end:.1f} s, then the command's exit {latency - (kernel_end - wall0):.1f} s")
    print("last lines of stderr:", *err.strip().splitlines()[-3:], sep="\n  ")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
