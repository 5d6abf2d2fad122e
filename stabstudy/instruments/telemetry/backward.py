"""The gradient as ``backward()`` left it: its norm before anything between ``backward()`` and
``optimizer.step()`` changes it (clipping, a GradScaler's unscaling, a user's own edits).

The Monitor's step hooks see the gradient the optimizer receives; clipping at 1.0 shows 1.0
there when ``backward()`` produced 1.22 (or 1e4, in a real blow-up), the norm the Hugging Face
Trainer logs and ZClip and OLMo's spike rules judge. :class:`BackwardWatch` reads that norm at the
end of every backward pass: each watched parameter's post-accumulate-grad hook only queues one
callback on the autograd engine (``queue_callback``, as DDP's reducer does), which runs when the
whole pass is done (after DDP's own callback has averaged the gradients: it queues itself once
more, so that it runs after every callback queued during the pass) and reads every gradient once,
by one ``torch._foreach_norm``, into a 0-d tensor on the device: no host read. With gradient
accumulation each pass reads the gradient accumulated so far, so the last one before the step is
the whole accumulated gradient. It also notes each gradient tensor and its version counter; the
step's pre-hook compares them (:meth:`BackwardRead.changed`), so where nothing changed the
gradient the step's own norm is recorded (the same bits as without the watch) and the backward
read is used only where something did.

Cost: one read of the gradient per backward pass, a Python call per parameter per pass (the
hook), and one comparison of version counters per step (``benchmarks/telemetry_overhead.py``).
Not read: sharded parameters (FSDP2 assigns their gradients outside the autograd graph, so no
hook fires; the step's norm is the one recorded), sparse or complex gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

#: The autograd engine: ``queue_callback`` runs a function once the current backward pass ends.
_engine = torch.autograd.Variable._execution_engine


@dataclass(slots=True, eq=False)
class BackwardRead:
    """One optimizer's gradient as the latest backward pass left it."""

    g2: torch.Tensor  #: 0-d, ||g||^2 (a loss scale not divided out), on the gradient's device
    grads: list[torch.Tensor] = field(default_factory=list)  #: the gradient tensors read
    versions: list[int] = field(default_factory=list)  #: their version counters then

    def changed(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` (the step's) differ from the gradient read: other tensors, or the same
        ones changed in place since (a version counter moved)."""
        mine = self.grads
        if len(grads) != len(mine):
            return True
        for g, h, v in zip(grads, mine, self.versions, strict=True):
            if g is not h or g._version != v:
                return True
        return False


class BackwardWatch:
    """Calls ``read()`` once at the end of every backward pass that accumulated a gradient into
    one of ``params`` (see the module docstring); ``remove()`` takes the hooks off."""

    def __init__(self, params: Iterable[torch.Tensor], read: Callable[[], None]):
        self._read = read
        self._queued = False
        self._handles: list[Any] = []
        seen: set[int] = set()
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            _engine.queue_callback(self._requeue)

    def _requeue(self) -> None:
        # callbacks queued during the pass (DDP's averaging) run before this second one
        _engine.queue_callback(self._done)

    def _done(self) -> None:
        self._queued = False
        self._read()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def read_g2(grads: list[torch.Tensor], out: torch.Tensor) -> None:
    """||g||^2 of ``grads`` into 0-d ``out`` (in ``out``'s dtype: per-tensor norms by one foreach
    call, then their squared sum; a half-precision gradient's norm does not overflow)."""
    norms = torch.stack(torch._foreach_norm(grads, 2, dtype=out.dtype))
    torch.dot(norms, norms, out=out)
