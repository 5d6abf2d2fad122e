"""Fused one-pass kernels for the Monitor on float32 CPU tensors, compiled on first use.

A measured Monitor step needs, over every stepped parameter, ||g||^2, g.g_prev, ||w||^2,
||u||^2, u.g, ||m||^2, sum(v) and #(v < thr), plus copies of g and w. As torch ops each is a
separate pass over cold memory with a dispatch per tensor or per row. ``kernels.c`` does them
in three passes (gradient and weights before the step; update after it; Adam state), called
through :mod:`ctypes` with the tensors' data pointers.

The C file ships with the package and is compiled with the system C compiler (``$CC``, else
``cc``) into ``$STABSTUDY_CACHE`` (default ``$XDG_CACHE_HOME/stabstudy``, else
``~/.cache/stabstudy``) under a name that hashes the source, the flags and the platform, so an
edited source recompiles; the file is written atomically (several processes may compile at
once). Without a compiler, or with ``STABSTUDY_FUSED=0``, :func:`load` returns None and the
Monitor uses its torch path; :func:`unavailable_reason` says why (and a warning, unless disabled).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
# -fassociative-math lets gcc vectorize the float reductions; no -ffast-math, whose
# -ffinite-math-only would let it assume away the NaN / inf a diverging run produces
FLAGS = ("-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-shared", "-fPIC")

_P = ctypes.c_void_p
_I = ctypes.c_int64


class Kernels:
    """The loaded library; arguments are plain integers (addresses, counts) or None for NULL."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self.grad = lib.ss_grad
        self.grad.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P]
        self.update = lib.ss_update
        self.update.argtypes = [_I, _P, _P, _P, _P, _P]
        self.adam = lib.ss_adam
        self.adam.argtypes = [_I, _P, _P, _P, ctypes.c_float, _P]
        for f in (self.grad, self.update, self.adam):
            f.restype = None


_loaded: Kernels | None = None
_reason: str | None = None
_tried = False
_lock = threading.Lock()  # one compile per process, whichever thread builds the first Monitor


def cache_dir() -> Path:
    env = os.environ.get("STABSTUDY_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stabstudy"


def _library_name(cc: str) -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), cc.encode(), platform.machine().encode(),
                 sys.platform.encode()):
        h.update(part)
        h.update(b"\0")
    return f"kernels-{h.hexdigest()[:16]}.so"


def _compile(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*shlex.split(cc), *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        # the linker keeps mkstemp's private mode (0600 plus x): give the library a plain build's
        # mode (0777 less the umask, read off a probe file: os.umask would change it process-wide
        # for a moment) so that a cache shared through $STABSTUDY_CACHE is loadable by others
        probe = tmp + ".mode"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o777))
        try:
            os.chmod(tmp, os.stat(probe).st_mode & 0o777)
        finally:
            os.unlink(probe)
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> Kernels | None:
    """The compiled kernels (compiled now if missing from the cache), or None if unavailable;
    then a RuntimeWarning says why, once per process (not when disabled by ``STABSTUDY_FUSED``)."""
    global _tried, _reason
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get("STABSTUDY_FUSED", "1").strip().lower() in ("0", "false", "no", "off"):
            _reason = "disabled by STABSTUDY_FUSED"
            return None
        _try_load()
        if _loaded is None:
            warnings.warn(f"stabstudy.instruments.telemetry.kernels unavailable ({_reason}): the Monitor uses torch ops, which are "
                          "slower on the CPU", RuntimeWarning, stacklevel=2)
        return _loaded


def _try_load() -> None:
    global _loaded, _reason
    cc = os.environ.get("CC") or "cc"  # may carry a launcher or flags: "ccache gcc", "gcc -m64"
    words = shlex.split(cc)
    if not words or shutil.which(words[0]) is None:
        _reason = f"no C compiler: {cc!r} not found (set $CC)"
        return
    name = _library_name(cc)
    try:
        path = cache_dir() / name
        fresh = not path.exists()
        if fresh:
            try:
                _compile(cc, path)
            except OSError:  # cache folder not writable: compile into this process's temp folder
                path = Path(tempfile.mkdtemp(prefix="stabstudy-kernels-")) / name
                _compile(cc, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            if fresh:
                raise
            _compile(cc, path)  # a damaged cached library: build it again
            lib = ctypes.CDLL(str(path))
        _loaded = Kernels(lib, path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _reason = f"{type(e).__name__}: {e}"


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when the kernels loaded or were not tried yet)."""
    return _reason
