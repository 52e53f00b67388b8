"""What the Dumper asks of the framework a watched model is written in, behind one protocol: how a
module's output and a parameter are named, how each is split over ranks, where a parameter's
gradient is read and whether this rank holds one, and the hooks that catch its outputs (the MoE
router's decisions too). One adapter a framework, in one module: megatron-core's
(megatron_adapter.py), torch's own (torch_adapter.py: DDP, FSDP2 and tensor parallel's DTensors,
any other module) and transformers' as megalign's HF worker writes it (transformers_adapter.py).
The Dumper picks one for each model it watches (megalign's workers hand theirs to hook_outputs)
and keeps the rest: steps, writing, landing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from megalign.dump.format import Kind
from megalign.dump.layout import BatchRow
from megalign.dump.sharding import Sharding

View = Optional[Callable[[torch.Tensor], torch.Tensor]]  # how a tensor is turned before it is dumped


@dataclass(frozen=True)
class Sink:
    """Where an adapter's hooks hand what they catch: the Dumper that installed them."""

    live: Callable[[], bool]  # whether anything is recorded now (inside a step the Dumper writes)
    # (kind, name, module, tensor, sharding, view, and the gradient's sharding where it lies otherwise:
    # None), as Dumper.add_output: the output, and its gradient as activation_grad
    output: Callable[[Kind, str, str, torch.Tensor, Sharding, View, Optional[Sharding]], None]
    add: Callable[..., None]  # a tensor of a kind of its own (routing), as Dumper.add
    wants: Callable[[str, str], bool]  # (kind, name) passes the name filter
    saw_rows: Callable[[tuple[BatchRow, ...], bool], None]  # this step's rows as the model saw them, packed
    lost_rows: Callable[[str, bool], None]  # why they cannot be recorded, packed


class Adapter(Protocol):
    """One watched model, as its framework lays it out."""

    def name(self, path: str) -> str:
        """A module's or parameter's dump name, from its path in the watched model."""

    def dumps_param(self, name: str, param: torch.nn.Parameter) -> bool:
        """Whether this rank dumps the parameter (a copy another rank dumps: not)."""

    def param_sharding(self, name: str, param: torch.nn.Parameter) -> Sharding:
        """How a parameter (and its gradient) is split over ranks; a DTensor's placements say it themselves."""

    def read_grads(self, params: dict[str, torch.nn.Parameter]) -> dict[str, Optional[torch.Tensor]]:
        """Each parameter's gradient where the framework leaves it at a step's end (a collective for
        some: every rank calls it, in the same order)."""

    def held(self, grads: list[Optional[torch.Tensor]], params: list[torch.nn.Parameter]) -> list[bool]:
        """Whether this rank holds each gradient (an all-zero one is missing, unless the framework
        says a rank beside it vouches for it); None is left untested, and not held."""

    def hook(self, hooks, sink: Sink, named: Callable[[str], str], seq_dim: Optional[int]) -> None:
        """Hook the model's modules to hand `sink` their outputs (named by `named`), and what else
        the framework decides (a router's choices, the rows of the batch). ValueError where
        `seq_dim` is given to a model whose layout is known."""

