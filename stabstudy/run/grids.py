"""Grid manifests: which runs a notebook ran, by role, so that another notebook reads the same runs
without rebuilding that notebook's grid.

A notebook whose grid depends on its own data (notebook 01 sets its forks' lengths from its prefixes'
learning curves) cannot be rebuilt from its parameters by a later notebook. So it records what it ran:
:func:`save_grid` writes ``<data>/grids/<notebook>.<profile>.json`` (one file per notebook and profile;
the runs themselves stay in the run store, keyed by spec hash) holding, per *group* (a role the
notebook names: ``prefixes``, ``lr_spike``, ...), every spec's hash and its full JSON
(:meth:`stabstudy.spec.RunSpec.to_json`), plus literal ``meta`` (the notebook's settings a reader
needs). :func:`load_grid` reads it back as a :class:`Grid`, or None when that notebook has not run
at that profile.

Guarantees: written atomically (a temporary file in the same folder, then ``os.replace``: a reader
sees the old manifest or the new one, never a part); checksummed (the SHA-256 of the canonical JSON of
its content is stored in it and checked on load), and each spec's recorded hash is checked against the
hash this code computes for its JSON, so that a damaged or stale manifest raises
:class:`CorruptGridError` naming the file and the remedy instead of selecting other runs.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabstudy import __version__, paths
from stabstudy.spec import RunSpec

#: Version of the manifest layout (a manifest of another version is refused with the remedy).
FORMAT = 1


class CorruptGridError(RuntimeError):
    """A stored grid manifest that cannot be trusted (unreadable, checksum mismatch, stale hashes)."""


@dataclass(frozen=True)
class Grid:
    """A notebook's grid as :func:`save_grid` recorded it: ``groups`` (role -> specs, in the order
    given), ``meta`` (literals), the notebook ``name``, ``profile``, ``created_utc``, ``git_commit``."""

    name: str
    profile: str
    groups: dict[str, list[RunSpec]]
    meta: dict[str, Any] = field(default_factory=dict)
    created_utc: str = ""
    git_commit: str = ""

    def specs(self, *groups: str) -> list[RunSpec]:
        """The distinct specs of ``groups`` (all groups when none), in order; ``KeyError`` naming the
        recorded groups for one that is absent."""
        names = groups or tuple(self.groups)
        bad = [g for g in names if g not in self.groups]
        if bad:
            raise KeyError(f"grid {self.name!r} ({self.profile}) has no group(s) {bad}; recorded: "
                           f"{', '.join(self.groups)}")
        return list(dict.fromkeys(s for g in names for s in self.groups[g]))

    def roles(self, spec: RunSpec | str) -> list[str]:
        """The groups a spec (or its hash) belongs to."""
        h = spec.spec_hash if isinstance(spec, RunSpec) else spec
        return [g for g, ss in self.groups.items() if any(s.spec_hash == h for s in ss)]


def _check_profile(profile: str) -> str:
    if profile not in paths.PROFILES:
        raise ValueError(f"unknown profile {profile!r}; valid profiles: {', '.join(paths.PROFILES)}")
    return profile


def grid_path(name: str, profile: str) -> Path:
    """Where the manifest of notebook ``name`` at ``profile`` lives: ``<data>/grids/<name>.<profile>.json``."""
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        raise ValueError(f"a grid name is a notebook's file stem (no path separators, no leading dot), got {name!r}")
    return paths.data_dir() / "grids" / f"{name}.{_check_profile(profile)}.json"


def _digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _remedy(name: str, profile: str) -> str:
    return f"run notebook {name} at profile {profile!r} again (it rewrites the manifest; stored runs are reused)"


def save_grid(name: str, profile: str, groups: Mapping[str, Sequence[RunSpec]],
              meta: Mapping[str, Any] | None = None) -> Path:
    """Record the specs notebook ``name`` ran at ``profile``, by group (module docstring); returns the path.

    ``groups``: role -> specs (a spec may belong to several groups). ``meta``: JSON literals only
    (``ValueError`` otherwise). Replaces an earlier manifest of the same notebook and profile atomically.
    """
    if not groups:
        raise ValueError("save_grid needs at least one group of specs")
    body_groups = []  # a list, so that the groups keep their order through sort_keys
    for g, specs in groups.items():
        if not isinstance(g, str) or not g:
            raise ValueError(f"group names are non-empty strings, got {g!r}")
        bad = [type(s).__name__ for s in specs if not isinstance(s, RunSpec)]
        if bad:
            raise ValueError(f"group {g!r} holds {sorted(set(bad))}, not RunSpec objects")
        body_groups.append({"group": g, "specs": [{"spec_hash": s.spec_hash, "spec": s.to_json()} for s in specs]})
    try:
        meta = json.loads(json.dumps(dict(meta or {}), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must hold JSON literals (str, finite numbers, bool, None, lists, dicts): {e}") from e
    from stabstudy.run.store import git_commit

    body = {"format": FORMAT, "name": name, "profile": _check_profile(profile), "groups": body_groups, "meta": meta,
            "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "stabstudy_version": __version__}
    return paths.atomic_write(grid_path(name, profile),
                              json.dumps({**body, "sha256": _digest(body)}, indent=1, sort_keys=True))


def load_grid(name: str, profile: str) -> Grid | None:
    """The manifest of notebook ``name`` at ``profile`` (:func:`save_grid`), or None when that notebook
    has not recorded one there. Raises :class:`CorruptGridError` (naming the file and the remedy) for a
    manifest that is unreadable, of another format, fails its checksum, or whose specs hash differently
    under this code."""
    path = grid_path(name, profile)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        body = {k: v for k, v in doc.items() if k != "sha256"}
        stored = doc["sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptGridError(f"grid manifest {path} is unreadable ({type(e).__name__}: {e}); "
                               f"{_remedy(name, profile)}") from e
    if body.get("format") != FORMAT:
        raise CorruptGridError(f"grid manifest {path} is of format {body.get('format')!r}, not {FORMAT}; "
                               f"{_remedy(name, profile)}")
    if _digest(body) != stored:
        raise CorruptGridError(f"grid manifest {path} does not match its checksum (a damaged or edited file); "
                               f"{_remedy(name, profile)}")
    if (body.get("name"), body.get("profile")) != (name, profile):
        raise CorruptGridError(f"grid manifest {path} describes {body.get('name')!r} at {body.get('profile')!r}; "
                               f"{_remedy(name, profile)}")
    groups: dict[str, list[RunSpec]] = {}
    for entry in body["groups"]:
        g, specs = entry["group"], []
        for e in entry["specs"]:
            try:
                s = RunSpec.from_json(e["spec"])
            except (ValueError, KeyError, TypeError) as err:
                raise CorruptGridError(f"grid manifest {path}: a spec of group {g!r} is no longer valid ({err}); "
                                       f"{_remedy(name, profile)}") from err
            if s.spec_hash != e["spec_hash"]:
                raise CorruptGridError(f"grid manifest {path}: spec {e['spec_hash']} of group {g!r} hashes to "
                                       f"{s.spec_hash} under this code (the manifest is stale); {_remedy(name, profile)}")
            specs.append(s)
        groups[g] = specs
    return Grid(name, profile, groups, dict(body.get("meta", {})), str(body.get("created_utc", "")),
                str(body.get("git_commit", "")))
