"""Byte-level corpora that need no download, a seeded batch sampler, outlier batches.

``load_corpus("stdlib")`` concatenates the Python standard library's ``.py``
sources (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded), walked
in sorted order and capped at ``max_bytes``: the same Python version gives the
same bytes on every machine, and the SHA-256 of those bytes is recorded
(:attr:`Corpus.sha256`, stored by the LM learner as the ``corpus_sha256`` attribute).
Any other task string is read as the path of a text file. The built stdlib corpus
is cached atomically under ``data/corpus/``.

Outlier batches imitate the junk found in web-scale corpora: rows made of a long
repetition of one byte that is rare in the corpus.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stabstudy import paths

#: Directories never read when building the stdlib corpus (installed packages, caches).
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    """A byte-level corpus split into train and validation parts."""

    train: torch.Tensor
    """Training bytes (uint8, 1-D; :func:`get_batch` returns int64 token ids)."""
    val: torch.Tensor
    """Validation bytes (uint8, 1-D): the last ``val_frac`` of the corpus."""
    sha256: str
    """SHA-256 hex digest of the full corpus bytes."""
    name: str
    """``"stdlib"`` or the resolved path of the text file."""
    rare_token: int
    """The least frequent byte among those present in the training split."""
    vocab_size: int = 256

    @property
    def n_bytes(self) -> int:
        return int(self.train.numel() + self.val.numel())


def stdlib_bytes(max_bytes: int = 1_000_000) -> bytes:
    """The first ``max_bytes`` of the sorted stdlib ``.py`` sources, joined by blank lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        rel = Path(dirpath).relative_to(root)
        files.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    chunks, total = [], 0
    for rel in sorted(files):
        data = (root / rel).read_bytes()
        chunks.append(data)
        total += len(data) + len(_SEPARATOR)
        if total >= max_bytes:
            break
    return _SEPARATOR.join(chunks)[:max_bytes]


def _cache_path(max_bytes: int) -> Path:
    ver = f"py{sys.version_info.major}{sys.version_info.minor}{sys.version_info.micro}"
    return paths.data_dir() / "corpus" / f"stdlib_{ver}_{max_bytes}.bin"


def _stdlib_cached(max_bytes: int) -> bytes:
    p = _cache_path(max_bytes)
    if p.exists():
        return p.read_bytes()
    data = stdlib_bytes(max_bytes)
    try:
        paths.atomic_write(p, data)
    except OSError:
        pass  # a read-only data dir only costs a rebuild next time
    return data


_MEMO: dict[tuple, Corpus] = {}


def load_corpus(task: str = "stdlib", max_bytes: int = 1_000_000, val_frac: float = 0.1) -> Corpus:
    """Load the corpus named by ``task``: ``"stdlib"`` or the path of a text file.

    Raises ``ValueError`` for anything else. ``max_bytes`` caps the size (both kinds);
    the last ``val_frac`` of the bytes is the validation split.
    """
    p = Path(task).expanduser()
    if task != "stdlib" and not p.is_file():
        raise ValueError(f"unknown LM task {task!r}: use 'stdlib' (Python standard library sources) "
                         "or the path of an existing text file")
    # a file is memoized by what it is now (an edited file is read again), not by its name
    st = p.stat() if task != "stdlib" else None
    key = (task if st is None else str(p.resolve()), st and (st.st_mtime_ns, st.st_size),
           int(max_bytes), float(val_frac))
    if key in _MEMO:
        return _MEMO[key]
    if task == "stdlib":
        data, name = _stdlib_cached(int(max_bytes)), "stdlib"
    else:
        data, name = p.read_bytes()[: int(max_bytes)], str(p.resolve())
    if len(data) < 1000:
        raise ValueError(f"corpus {name!r} has only {len(data)} bytes; need at least 1000")
    if not 0.0 < val_frac < 0.5:
        raise ValueError(f"val_frac must lie in (0, 0.5), got {val_frac}")
    arr = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    n_val = int(len(arr) * val_frac)
    train, val = arr[:-n_val], arr[-n_val:]
    counts = torch.bincount(train.long(), minlength=256)
    present = torch.nonzero(counts > 0).flatten()
    rare = int(present[counts[present].argmin()])
    corpus = Corpus(train=train, val=val, sha256=hashlib.sha256(data).hexdigest(), name=name, rare_token=rare)
    _MEMO[key] = corpus
    return corpus


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random contiguous windows: ``x`` (batch, block) and next-token targets ``y`` (batch, block)."""
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    win = data[ix[:, None] + offsets[None, :]].long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def outlier_batch(x: torch.Tensor, y: torch.Tensor, fraction: float, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the first ``ceil(fraction * batch)`` rows of (``x``, ``y``) by repetitions of ``token``.

    The outlier rows are the byte ``token`` repeated over the whole context, so their
    targets are that same byte: a long run of one rare symbol, as found in web-scale
    corpora. Returns new tensors; ``fraction`` 0 returns the inputs unchanged.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"outlier fraction must lie in [0, 1], got {fraction}")
    n = int(np.ceil(fraction * x.shape[0] - 1e-9))
    if n == 0:
        return x, y
    x, y = x.clone(), y.clone()
    x[:n] = token
    y[:n] = token
    return x, y
