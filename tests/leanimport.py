"""Run Python code as if only some of stabstudy's extras were installed.

    python tests/leanimport.py EXTRAS CODE      # EXTRAS: comma-separated ("" for the core alone)

The importable third-party packages are the distributions pyproject.toml's core dependencies and
the named extras pull in, transitively (read from the installed packages' metadata); the standard
library and stabstudy itself stay importable. Every other module is not found, as if it were not
installed: each meta-path finder is wrapped so that it answers None for it, which is also what
``importlib.util.find_spec`` then reports to libraries that probe for optional packages, and the
other distributions' metadata is not found either (``importlib.metadata``, which libraries such
as lightning and torchmetrics probe instead). Much faster than a fresh virtual environment, and
it checks the same thing: what an import needs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import re
import sys
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(extras: list[str]) -> set[str]:
    """Normalized names of the distributions the core and ``extras`` need (transitively)."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    todo = [Requirement(r) for r in proj["dependencies"]]
    for e in extras:
        if e not in proj["optional-dependencies"]:
            raise ValueError(f"unknown extra {e!r}; valid: {', '.join(proj['optional-dependencies'])}")
        todo += [Requirement(r) for r in proj["optional-dependencies"][e]]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        key = (_norm(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if key[0] == "stabstudy":  # a self-reference: stabstudy[rl,warning]
            for e in req.extras:
                todo += [Requirement(r) for r in proj["optional-dependencies"][e]]
            continue
        try:
            dist = md.distribution(key[0])
        except md.PackageNotFoundError:
            continue  # not installed here (a marker for another platform, ...)
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": x}) for x in (req.extras or {""})):
                todo.append(sub)
    return {name for name, _ in seen}


def allowed_modules(extras: list[str]) -> set[str]:
    """Top-level module names importable with the core and ``extras``."""
    names = distributions(extras)
    return {mod for mod, dists in md.packages_distributions().items() if any(_norm(d) in names for d in dists)}


_STDLIB_DIRS = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")] + \
    [p for p in sys.path if p.endswith("lib-dynload")]


def _stdlib(top: str) -> bool:
    return top in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(top, _STDLIB_DIRS) is not None


class _Hide:
    """One meta-path finder, wrapped: a module or a distribution outside the allowed sets is not found."""

    def __init__(self, finder, allowed: set[str], dists: set[str], hidden: list[str]):
        # allowed (top-level modules) and dists (normalized distribution names): shared, changed in place
        self.finder, self.allowed, self.dists, self.hidden = finder, allowed, dists, hidden

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if not (top in self.allowed or top == "stabstudy" or _stdlib(top)):
            self.hidden.append(name)
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        found = find(*args, **kwargs) if find else ()
        if _READING_ALL[0]:  # allow_only() reads every distribution's metadata
            return found
        return (d for d in found if _norm(d.metadata["Name"] or "") in self.dists)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


def hide_all_but(extras: list[str]) -> list[str]:
    """From now on only the core's and ``extras``' packages are importable; returns the list that
    collects the names of the modules hidden since. :func:`allow_only` changes the extras later."""
    allowed, dists, hidden = allowed_modules(extras), distributions(extras) | {"stabstudy"}, []
    sys.meta_path[:] = [_Hide(f, allowed, dists, hidden) for f in sys.meta_path]
    return hidden


#: True while :func:`allow_only` reads the metadata of every distribution (the hidden ones included).
_READING_ALL = [False]


def allow_only(extras: list[str]) -> None:
    """Make the core's and ``extras``' packages the importable ones from now on (after
    :func:`hide_all_but`); modules imported before stay imported."""
    _READING_ALL[0] = True
    try:
        allowed, dists = allowed_modules(extras), distributions(extras) | {"stabstudy"}
    finally:
        _READING_ALL[0] = False
    for f in sys.meta_path:
        if isinstance(f, _Hide):
            f.allowed.clear()
            f.allowed.update(allowed)
            f.dists.clear()
            f.dists.update(dists)


if __name__ == "__main__":
    extras = [e for e in sys.argv[1].split(",") if e]
    hidden = hide_all_but(extras)
    exec(compile(sys.argv[2], "<lean import check>", "exec"), {"__name__": "__main__"})
    print("hidden:", " ".join(sorted({h.partition(".")[0] for h in hidden})))
