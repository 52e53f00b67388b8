"""torch's adapter: any model that is not megatron-core's, as the Dumper writes it (capture/adapter.py's
Adapter). torch's DDP (unwrapped: its replicas are the DP group's), FSDP2 and tensor parallel's
DTensors (placed by their own placements: dtensor.py), and any module's outputs: split over DP
ranks on `batch_dim`, token tensors on `seq_dim`, the rows' real tokens from each call's
attention_mask; how DDP and FSDP2 reduce gradients (for reducers.py). Ranks: torch.distributed's,
each a DP rank over the world or over `dp_group`; under parallelize_module, TP ranks over its mesh
(place_tensor_parallel), and the outputs read are those whose placements are known: each
parallelized module's, as the DTensor its forward returns (before the style's hook makes it a plain
local piece), and any DTensor output."""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.distributed as dist

from megalign.capture.adapter import Sink
from megalign.capture.coverage import have_gradients, read_grad
from megalign.capture.dtensor import is_dtensor
from megalign.capture.hooks import Hooks
from megalign.dump.format import Kind, RankCoords
from megalign.dump.grad_convention import GradReduction, mean_of
from megalign.dump.layout import Layout, padded_rows
from megalign.dump.partial import shared_output_grad
from megalign.dump.sharding import Sharding
from megalign.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def place(dp_group: Union[dist.ProcessGroup, "DeviceMesh", None]) -> tuple[RankCoords, Layout, list[int]]:
    """This rank's coordinates, the job's layout and the ranks of its DP group: torch.distributed's
    ranks as DP ranks over the world or `dp_group`, each group of those a stage (pp_rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp_group is None:
        return RankCoords(rank=rank, dp_rank=rank), Layout(dp=world), list(range(world))
    if hasattr(dp_group, "get_group"):  # a 1-D DeviceMesh (several dims: get_group refuses)
        dp_group = dp_group.get_group()
    members = sorted(dist.get_process_group_ranks(dp_group))
    every: list = [None] * world
    dist.all_gather_object(every, members)
    groups = sorted(set(map(tuple, every)))
    if sorted(r for group in groups for r in group) != list(range(world)) or len(set(map(len, groups))) != 1:
        raise UserError(f"dp_group: the ranks' groups {[list(g) for g in groups]} do not split the world of {world} "
                        "ranks into groups of one size")
    return (RankCoords(rank=rank, dp_rank=members.index(rank), pp_rank=groups.index(tuple(members))),
            Layout(pp=len(groups), dp=len(members)), members)


def place_tensor_parallel(model: torch.nn.Module, dp_ranks: list[int]
                          ) -> Optional[tuple[RankCoords, Layout, list[int]]]:
    """Under parallelize_module, where its mesh splits the model over more than one rank: this rank's
    coordinates, the layout (TP over that mesh, DP over the rest of the world) and this rank's DP
    group. The TP mesh is a parallelized parameter's: the styles take a 1-D mesh, and FSDP2 over TP
    puts its own dims before it. A collective (every rank watches the model)."""
    mesh = next((p.device_mesh for sub in model.modules() if _parallelized(sub)
                 for p in sub.parameters(recurse=False) if is_dtensor(p)), None)
    if mesh is None or mesh.size(mesh.ndim - 1) == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    every: list = [None] * world
    dist.all_gather_object(every, sorted(dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1))))
    groups = sorted(set(map(tuple, every)))
    if sorted(r for group in groups for r in group) != list(range(world)) or len(set(map(len, groups))) != 1:
        raise UserError(f"parallelize_module's meshes {[list(g) for g in groups]} do not split the world of {world} "
                        "ranks into TP groups of one size")
    mine = next(group for group in groups if rank in group)
    tp_rank = mine.index(rank)
    members = [group[tp_rank] for group in groups]  # the ranks of this rank's place in every TP group
    if dp_ranks not in (list(range(world)), members):
        raise UserError(f"dp_group: ranks {dp_ranks}; beside parallelize_module's TP groups {[list(g) for g in groups]} "
                        f"the data-parallel group of rank {rank} is ranks {members}")
    return (RankCoords(rank=rank, tp_rank=tp_rank, dp_rank=groups.index(mine)), Layout(tp=len(mine), dp=len(groups)),
            members)


def check_ddp_group(group: dist.ProcessGroup, dp_ranks: Optional[list[int]]) -> None:
    """torch DDP averages gradients over `group`: the Dumper's DP ranks must be its ranks, or its
    replicas would be placed over ranks that hold other values (a false FAIL) or not all of them."""
    ranks = sorted(dist.get_process_group_ranks(group))
    if dp_ranks is not None and ranks != dp_ranks:
        raise UserError(f"DDP averages gradients over ranks {ranks}, the Dumper's data-parallel group is ranks "
                        f"{dp_ranks}: pass megalign.Dumper(..., dp_group=) the process_group given to DDP")


def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 modules in `module`, each of which reduces its parameter groups' gradients."""
    return [m for m in module.modules() if hasattr(m, "_get_fsdp_state")]


def ddp_reduction(ddp: torch.nn.parallel.DistributedDataParallel) -> GradReduction:
    """A torch DDP's: a mean over its process group, unless a comm hook it was given replaces that."""
    if ddp._comm_hooks:  # torch 2.13 keeps register_comm_hook's hooks there
        return GradReduction(None, "torch DDP's comm hook: say it with grad_reduction=")
    return GradReduction(float(ddp.process_group.size()), f"torch DDP, {mean_of(ddp.process_group.size())}")


def fsdp_reductions(fsdp: torch.nn.Module) -> list[GradReduction]:
    """An FSDP2 module's, one a parameter group (torch 2.13: `_get_fsdp_state()._fsdp_param_groups`):
    its gradient_divide_factor, else (torch's _get_gradient_divide_factors) the data-parallel size:
    the shard group's, times HSDP's replicas."""
    found = []
    for group in fsdp._get_fsdp_state()._fsdp_param_groups:
        if group.gradient_divide_factor is not None:
            found.append(GradReduction(float(group.gradient_divide_factor),
                                       f"FSDP2, divide factor {group.gradient_divide_factor:g}"))
            continue
        info = group.mesh_info
        size = getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)
        found.append(GradReduction(float(size), f"FSDP2, {mean_of(size)}"))
    return found


class TorchParams:
    """A torch model's parameters as the Dumper reads them: named by their paths, each a replica over
    the DP ranks (DDP's) or a DTensor placed by its placements, gradients where DDP or FSDP2 leave them."""

    def name(self, path: str) -> str:
        return path

    def dumps_param(self, name: str, param: torch.nn.Parameter) -> bool:
        return True

    def param_sharding(self, name: str, param: torch.nn.Parameter) -> Sharding:
        return Sharding()  # a replica over the DP ranks (DDP's), or a DTensor placed by its placements

    def read_grads(self, params: dict[str, torch.nn.Parameter]) -> dict[str, Optional[torch.Tensor]]:
        """`.grad` as torch's DDP (averaged over the DP group) or FSDP2 (a DTensor, reduce-scattered)
        leaves it at a step's end: the one place a torch model's gradients are read."""
        return {name: read_grad(param) for name, param in params.items()}

    def held(self, grads: list[Optional[torch.Tensor]], params: list[torch.nn.Parameter]) -> list[bool]:
        return have_gradients(grads)  # each rank alone: no rank holds a piece of another's


class TorchAdapter(TorchParams):
    """A model of torch's own modules. Refuses (NotImplementedError) watching the outputs of one
    split over CP ranks, or over TP ranks other than parallelize_module's, whose outputs carry no
    placement; under parallelize_module beside DP, too (a DTensor output is this DP rank's rows only)."""

    def __init__(self, model: torch.nn.Module, layout: Layout, outputs: bool, batch_dim: Optional[int]):
        self.parallel = _tensor_parallel(model)
        if outputs and (layout.cp > 1 or (layout.tp > 1 and not self.parallel)):
            # Labelled as replicas, outputs split over TP or CP ranks would be put back together wrong.
            raise NotImplementedError("watch() infers TP and CP splits of megatron-core models only; "
                                      "add() each tensor with its megalign.Sharding")
        if outputs and self.parallel and layout.dp > 1:
            # The DTensor's mesh is the TP one: its whole is this DP rank's rows, which read as
            # replicas of the other DP ranks' would disagree.
            raise NotImplementedError("watch() of a model under torch's tensor parallelism (parallelize_module) "
                                      "beside data parallelism: its outputs are placed over the TP ranks only; "
                                      "watch(model, outputs=False) dumps its parameters and gradients (DTensors)")
        self.model, self.layout, self.batch_dim = model, layout, batch_dim
        self._batch: Optional[int] = None  # rows of the model's input on batch_dim, once it ran
        self._seq_len: Optional[int] = None  # tokens a row of the model's input, where seq_dim is given

    def hook(self, hooks: Hooks, sink: Sink, named: Callable[[str], str], seq_dim: Optional[int]) -> None:
        batch_dim = self.batch_dim
        if seq_dim is not None and (batch_dim is None or seq_dim == batch_dim):
            raise ValueError("seq_dim names the token dim beside batch_dim, of a model other than megatron-core's "
                             "(whose layout is known)")
        if batch_dim is not None and (self.layout.dp > 1 or seq_dim is not None):
            # A DP split needs the batch's rows; token tensors, the rows' length and padding.
            hooks.before_call(self.model, self._batch_hook(sink, batch_dim, seq_dim))
        for path, sub in self.model.named_modules():
            if path:  # the root's output is the caller's (logits, a loss): add() it with its own kind
                hooks.on_outputs(sub, named(path), self._output_hook(sink, named(path), seq_dim),
                                 first=_parallelized(sub))

    def _output_hook(self, sink: Sink, name: str, seq_dim: Optional[int]) -> Callable:
        rows_split = self.batch_dim is not None and self.layout.dp > 1  # each DP rank its own rows

        def record(module, key, tensor, index):
            if self.parallel and not is_dtensor(tensor):
                # A plain output of a tensor-parallel model (after a style's hook, or of a module between
                # a column- and a row-parallel one) is a local piece or a replica: nothing says which.
                return
            sharding = self._sharding(tensor, seq_dim)
            # An output every DP rank holds whole while each has other rows (a learned position
            # embedding's [1, s, d]): forward a replica, its gradient a partial sum over the ranks.
            grad = shared_output_grad(sharding) if rows_split and not is_dtensor(tensor) else None
            sink.output(Kind.ACTIVATION, key, name, tensor, sharding, None, grad)

        return record

    def _sharding(self, tensor: torch.Tensor, seq_dim: Optional[int]) -> Sharding:
        """An output split over DP ranks on batch_dim where it has as many rows there as the model's
        input, else a replica; with `seq_dim`, one with the rows' tokens there is a token tensor (its
        batch dim recorded at any DP size)."""
        if is_dtensor(tensor):
            return Sharding()
        batch_dim = self.batch_dim
        split = (batch_dim is not None and tensor.ndim > batch_dim and (self.layout.dp > 1 or seq_dim is not None)
                 and self._batch in (None, tensor.shape[batch_dim]))
        tokens = seq_dim is not None and tensor.ndim > seq_dim and tensor.shape[seq_dim] == self._seq_len
        return Sharding(dp_dim=batch_dim if split else None, seq_dim=seq_dim if tokens else None)

    def _batch_hook(self, sink: Sink, batch_dim: int, seq_dim: Optional[int]) -> Callable:
        """A pre-hook on the model: its first tensor argument's rows on batch_dim are this rank's
        batch; with `seq_dim`, its tokens a row, and the rows' real tokens (padded_rows) from its
        attention_mask, passed by name or by position."""
        mask_of = _argument(self.model, "attention_mask")

        def read(module, args, kwargs):
            first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            if first is None or first.ndim <= max(batch_dim, seq_dim or 0):
                return
            self._batch = first.shape[batch_dim]
            if seq_dim is not None:
                self._seq_len = first.shape[seq_dim]
                if sink.live():
                    try:
                        sink.saw_rows(padded_rows(mask_of(args, kwargs), self._batch, self._seq_len), False)
                    except UserError as error:
                        sink.lost_rows(str(error), False)

        return read


def _argument(module: torch.nn.Module, name: str) -> Callable[[tuple, dict], object]:
    """Reads the argument `name` of a call of module's forward, given by name or by position
    (`model(ids, mask)`); None where absent."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward without a signature (a builtin): by name only
        signature = None

    def read(args: tuple, kwargs: dict) -> object:
        if signature is not None and args:
            with contextlib.suppress(TypeError):  # a call forward itself would refuse: by name only
                return signature.bind_partial(*args, **kwargs).arguments.get(name)
        return kwargs.get(name)

    return read


def _tensor_parallel(module: torch.nn.Module) -> bool:
    """Whether torch's parallelize_module hooked a submodule."""
    return any(map(_parallelized, module.modules()))


def _parallelized(module: torch.nn.Module) -> bool:
    """Whether a parallel style hooked `module`: distribute_module marks each module it hooks with
    `_distribute_module_applied` (private to torch; tests/trainer/test_torch_tp.py finds a real run
    labelled TP, so a torch that dropped the mark fails there)."""
    return getattr(module, "_distribute_module_applied", False)
