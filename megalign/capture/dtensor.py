"""DTensors (torch's FSDP2 `fully_shard`, tensor parallel's `parallelize_module`): this rank's piece
and where it lies in the whole, from the DTensor's own placements, with nothing declared.

The local piece is written as it is, with its offset (MeshPlacement), never gathered: a gather is a
collective every rank must enter, it holds the whole tensor on every rank, and it would hide how the
value was split. Partial(sum) pieces are recorded as partial and summed by compare, for the same
reasons; a partial of another reduction (avg, max) is reduced here first, a collective, which the
Dumper's callers make on every rank in the same order (a step's end). Nothing here calls bool() or
item() on a DTensor: that too is a collective.
"""

from __future__ import annotations

import sys

import torch

from megalign.dump.sharding import MeshPlacement, Sharding


def is_dtensor(tensor: object) -> bool:
    """Without importing torch.distributed.tensor: no program that has not imported it holds a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_piece(tensor: torch.Tensor) -> tuple[torch.Tensor, Sharding]:
    """This rank's local tensor of a DTensor, and the Sharding that places it in the whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # what DCP uses

    if any(p.is_partial() and p.reduce_op != "sum" for p in tensor.placements):
        tensor = tensor.redistribute(placements=[Replicate() if p.is_partial() and p.reduce_op != "sum" else p
                                                 for p in tensor.placements])
    mesh = tensor.device_mesh
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    placement = MeshPlacement(shape=tuple(mesh.shape), coord=tuple(mesh.get_coordinate()),
                              placements=tuple(_code(p) for p in tensor.placements), whole=tuple(tensor.shape),
                              offset=tuple(offset))
    return tensor.to_local(), Sharding(mesh=placement)


def _code(placement) -> str:
    """Shard(dim=d) and _StridedShard (FSDP2 over TP) -> S<d>; Replicate -> R; Partial(sum) -> P."""
    if placement.is_partial():
        return "P"
    if placement.is_replicate():
        return "R"
    return f"S{placement.dim}"
