"""The ``stabstudy`` command: ``study``, ``runs``, ``report``, ``list``, ``new``.

``--help``, ``--version``, ``list`` and ``runs`` need the core install alone (``pip install
stabstudy``); the commands that execute or publish the study import the ``[study]`` extra's modules
when they run, and say which extra they need where it is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from stabstudy import __version__, paths

#: The extra each command needs beyond the core, and a module that extra brings.
NEEDS = {"study": ("study", "papermill"), "report": ("study", "nbconvert"), "new": ("study", "yaml")}


def _missing_extra(command: str) -> str | None:
    """Why ``command`` cannot run with the installed packages, or None."""
    extra, module = NEEDS.get(command, (None, None))
    if extra is None or importlib.util.find_spec(module) is not None:
        return None
    return f"`stabstudy {command}` needs the [{extra}] extra ({module} is not installed): pip install 'stabstudy[{extra}]'"


def _cmd_study(args: argparse.Namespace) -> int:
    from stabstudy.run import study  # the [study] extra's YAML profiles and papermill

    try:
        study.select(args.only)
    except ValueError as exc:
        print(f"stabstudy study: error: {exc}", file=sys.stderr)
        return 2
    if args.rerun_stale:
        os.environ["STABSTUDY_RERUN_STALE"] = "1"  # read by run_grid inside the notebooks' kernels
    from stabstudy.run.runner import SchedulerUnreachableError

    try:
        timings = study.run_study(args.profile, args.only, args.scheduler, retry_failed=args.retry_failed)
    except SchedulerUnreachableError as exc:
        print(f"stabstudy study: error: {exc}", file=sys.stderr)
        return 2
    except study.NotebookFailed as exc:
        print(f"stabstudy study: error: {exc}", file=sys.stderr)
        return 1
    except study.StudyInterrupted as exc:
        where = (f"in {exc.notebook}; its executed copy, marked interrupted, is {exc.executed}" if exc.executed
                 else f"before {exc.notebook}")
        print(f"stabstudy study: interrupted {where}. The runs stored so far are whole: the same "
              f"command resumes from them (runs in {paths.runs_dir()}/)", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
    total, cpu = sum(t[1] for t in timings), sum(t[2] for t in timings)
    print(f"study ({args.profile}) done: {len(timings)} notebooks in {total:.0f} s wall, {cpu / 3600:.2f} CPU-hours; "
          f"executed copies in {paths.build_dir() / args.profile}/, figures in {paths.figures_dir()}/, "
          f"runs in {paths.runs_dir()}/")
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    import pandas as pd

    from stabstudy.run.store import RunStore

    if args.data and not os.path.isdir(args.data):  # a mistyped folder is not an empty store
        print(f"stabstudy runs: error: no run store at {args.data} (not a folder); give the folder "
              f"holding the <spec_hash>.nc files, or leave --data out for {paths.runs_dir()}", file=sys.stderr)
        return 2
    store = RunStore(args.data) if args.data else RunStore()
    if store.hashes() and importlib.util.find_spec("netCDF4") is None:
        print(f"stabstudy runs: error: {store.root} holds netCDF runs; reading them needs netCDF4, in the [study] "
              "extra: pip install 'stabstudy[study]'", file=sys.stderr)
        return 2
    table = store.table()
    if table.empty:
        print(f"no stored runs in {store.root}")
        return 0
    if args.status:
        table = table[table["status"] == args.status]
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_columns", None):
        print(table.drop(columns=[c for c in ("error",) if c in table]).to_string(index=False))
    counts = table["status"].value_counts().to_dict()
    print(f"{len(table)} runs in {store.root}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    stale = int((table.get("version_drift", pd.Series(dtype=str)).fillna("") != "").sum())
    if stale:
        print(f"{stale} runs were made with other versions (column version_drift: stored -> installed); "
              "`stabstudy study --rerun-stale` recomputes them")
    if counts.get("corrupt") or counts.get("unverified"):
        print("corrupt and unverified (no checksum) runs are recomputed by the next `stabstudy study`")
    if counts.get("failed"):
        print("failed runs stay as they are; `stabstudy study --retry-failed` recomputes them")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from stabstudy.run import report  # the [study] extra's nbconvert

    if args.check:
        changed = report.check(args.profile)
        if changed:
            print(f"stabstudy report: results/{args.profile} is stale:", *changed, sep="\n  ", file=sys.stderr)
            return 1
        print(f"results/{args.profile} is current")
        return 0
    try:
        out = report.publish(args.profile)
    except FileNotFoundError as exc:
        print(f"stabstudy report: error: {exc}", file=sys.stderr)
        return 2
    except report.UnfinishedExecutionError as exc:
        print(f"stabstudy report: error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(out)} files in {paths.results_dir(args.profile)}/ (start with CLAIMS.md)")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from stabstudy.run import catalog

    try:
        print(catalog.markdown(tuple(args.sections) or catalog.SECTIONS, args.domain))
    except ValueError as exc:
        print(f"stabstudy list: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_new(args: argparse.Namespace) -> int:
    from stabstudy.run import scaffold

    try:
        written = scaffold.create(args.name)
    except ValueError as exc:
        print(f"stabstudy new: error: {exc}", file=sys.stderr)
        return 2
    root = paths.root()
    print(f"new experiment {args.name}:", *(p.relative_to(root) for p in written), sep="\n  ")
    print(f"next: stabstudy study --profile smoke --only {args.name[:2]}, then stabstudy report --profile smoke "
          "(docs/extending.md)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stabstudy", description="Perturbation auditing of training stability.")
    parser.add_argument("--version", action="version", version=f"stabstudy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("study", help="execute the study notebooks in order with papermill",
                       description="Execute the notebooks in order under a profile; executed copies go to build/<profile>/.")
    p.add_argument("--profile", choices=paths.PROFILES, default="quick",
                   help="parameter set: smoke (CI, minutes), quick (make study on 2 cores), standard (notebook 01's full "
                        "design, for a cluster), paper (hours)")
    p.add_argument("--only", nargs="+", metavar="NB", help="notebook numbers or names, e.g. --only 00 01")
    p.add_argument("--scheduler", default=None,
                   help="Dask scheduler address (default: $STABSTUDY_SCHEDULER, else an embedded LocalCluster)")
    p.add_argument("--rerun-stale", action="store_true",
                   help="recompute stored runs made with another stabstudy version or other package versions "
                        "(`stabstudy runs` lists them; a different git commit alone is no reason)")
    p.add_argument("--retry-failed", action="store_true",
                   help="recompute stored runs whose status is failed (the notebooks' retry_failed parameter)")
    p.set_defaults(func=_cmd_study)

    p = sub.add_parser("runs", help="list stored runs as a table", description="List stored runs (data/runs).")
    p.add_argument("--status", choices=("ok", "diverged", "failed", "corrupt", "unverified"),
                   help="only runs with this status (unverified: no checksum, written before runs had one)")
    p.add_argument("--data", help="run store folder (default: data/runs)")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser("report", help="publish results/<profile>/ from the executed study, or check it",
                       description="Write results/<profile>/ (CLAIMS.md, rendered notebooks, figures) from "
                                   "build/<profile>/ and figures/; --check exits 1 naming the sources changed since.")
    p.add_argument("--profile", choices=paths.PROFILES, default="quick")
    p.add_argument("--check", action="store_true", help="only say whether the published results are current")
    p.set_defaults(func=_cmd_report)

    from stabstudy.run.catalog import SECTIONS

    p = sub.add_parser("list", help="domains, learners, perturbation kinds, channels and hyperparameters",
                       description="Print the registry as Markdown (the same tables as docs/registry.md).")
    # no choices=: argparse rejects an empty list against them (Python 3.11); catalog names the valid ones
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"which tables: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--domain", help="only what a run of this domain can use: its learners and tasks, the kinds "
                                    "that apply to it, its channels and hyperparameters (e.g. --domain toy)")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("new", help="scaffold a new notebook experiment (docs/extending.md)",
                       description="Write notebooks/NN_name.ipynb, stabstudy/analysis/studies/name.py, its entries "
                                   "in the smoke, quick, standard and paper profiles and tests/test_study_name.py: an example "
                                   "toy experiment that runs as generated, to be made yours. Refuses a number or "
                                   "name in use.")
    p.add_argument("name", metavar="NN_name", help="two digits, an underscore, a module name: e.g. 07_warmup_dose")
    p.set_defaults(func=_cmd_new)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = _missing_extra(args.command)
    if missing:
        print(f"stabstudy {args.command}: error: {missing}", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
