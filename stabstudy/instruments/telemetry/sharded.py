"""Sharded parameters (FSDP2's ``fully_shard``, DTensor): the Monitor's sums over each rank's shard,
all-reduced over the shards' process group.

Every device field of a row (:class:`~stabstudy.instruments.telemetry.channels.DevField`) is a
sum over coordinates, so the sums over the local shards add up to the global ones: each hook
all-reduces the fields it wrote (two small all-reduces per measured step, one on the others),
so that every rank records, and a pre-step hook sees, the global values. Every rank steps its
optimizer at the same points, so the collectives line up. Parameters replicated on every rank
(DDP, or a ``Replicate`` placement) need nothing of this: their gradients are already reduced.
"""

from __future__ import annotations

import sys

import torch


def _dtensor() -> type | None:
    """The DTensor class when ``torch.distributed.tensor`` was imported (by whoever built one),
    else None: no DTensor can exist then, and importing it here would cost seconds."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def shard_group(params: list[torch.Tensor]) -> object | None:
    """The process group to all-reduce the sums of ``params`` over: None when none of them is a
    DTensor; the group of their device mesh when every one is sharded (``Shard`` placements)
    on one 1-D mesh; otherwise a ValueError saying what is supported."""
    DTensor = _dtensor()
    if DTensor is None or not any(isinstance(p, DTensor) for p in params):
        return None
    from torch.distributed.tensor import Shard

    meshes = {id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}
    ok = all(isinstance(p, DTensor) for p in params) and len(meshes) == 1
    mesh = next(iter(meshes.values()))
    if not ok or mesh.ndim != 1 or not all(isinstance(pl, Shard) for p in params for pl in p.placements):
        raise ValueError("Monitor: the parameters of one optimizer must be all plain tensors (DDP included) or all "
                         "DTensors sharded (Shard placements) on one 1-D device mesh (FSDP2's fully_shard); got "
                         f"{sorted({type(p).__name__ + str(getattr(p, 'placements', '')) for p in params})}")
    return mesh.get_group()


def local(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (it shares the DTensor's storage: in-place updates show)."""
    DTensor = _dtensor()
    if DTensor is None:
        return ts
    with torch.no_grad():  # a view for the Monitor's copies, not part of any graph
        return [t.to_local() if isinstance(t, DTensor) else t for t in ts]


def all_reduce_(t: torch.Tensor, group: object) -> None:
    """Sum ``t`` (contiguous) over ``group``, in place."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def total(n: int, group: object, device: torch.device) -> int:
    """``n`` summed over ``group`` (through a tensor on ``device``, where its backend reduces)."""
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def rank() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
