"""Which modules of a megatron-core model have their outputs dumped, under which names, laid out how:
one walk, megatron_adapter.py's, for megalign's megatron worker (stacks/megatron/worker.py) and
`Dumper.watch` on a user's megatron-core model alike.

Every module but the root (whose output is the caller's: the loss, logits) is hooked, named by its
global layer and expert index (megatron_names.py), except outputs another PP stage dumps and those
with no sequence layout (identities, an MoE layer's router and experts: megatron_outputs.py); the
MLP's activation is dumped too, as `...linear_fc2#input`. Duck-typed: no megatron import.
"""

from __future__ import annotations

from typing import Callable

import torch

from megalign.capture.hooks import Hooks
from megalign.capture.megatron_names import another_stage_dumps
from megalign.capture.megatron_outputs import (INPUT_CAPTURED, LocalShape, View, input_sharding, output_sharding,
                                               without_layout)
from megalign.dump.sharding import Sharding

# (its name, the module's name, the tensor, its sharding, the view it is dumped through)
Recorder = Callable[[str, str, torch.Tensor, Sharding, View], None]


def hook_megatron_model(hooks: Hooks, model: torch.nn.Module, record: Recorder, local: Callable[[], LocalShape], *,
                        named: Callable[[str], str], packed: Callable[[], bool], live: Callable[[], bool],
                        router: Callable[[torch.nn.Module, str], bool]) -> None:
    """Hook `model`'s modules to `record` their outputs. `local()`: this rank's LocalShape in the call
    under way; `named(path)`: a module's dump name; `packed()`: whether the call under way packs its
    rows (the RoPE table is then no token's: left out); `live()`: whether anything is recorded now
    (a Dumper outside the steps it writes reads no layout); `router(module, name)`: True where it hooked
    `module` itself (an MoE router whose decisions it traces)."""
    for path, module in model.named_modules():
        if not path or another_stage_dumps(path):
            continue
        name = named(path)
        if router(module, name) or without_layout(path, module):
            continue
        hooks.on_outputs(module, name, _outputs(record, path, name, local, packed, live))
        if path.endswith(INPUT_CAPTURED):
            hooks.on_input(module, name, _input(record, name, local, live))


def _outputs(record: Recorder, path: str, name: str, local: Callable[[], LocalShape], packed: Callable[[], bool],
             live: Callable[[], bool]):
    def outputs(module: torch.nn.Module, key: str, tensor: torch.Tensor, index: int) -> None:
        if not live() or (packed() and path == "rotary_pos_emb"):
            # Packed rows: a table of max_seqlen_q positions that every document restarts from, no
            # token's: nothing to line up, and its length differs between DP ranks.
            return
        sharding, view = output_sharding(module, path, tensor, local())
        record(key, name, tensor, sharding, view)

    return outputs


def _input(record: Recorder, name: str, local: Callable[[], LocalShape], live: Callable[[], bool]):
    """The down projection's input: SwiGLU's output, a bare function with no module of its own."""
    def taken(module: torch.nn.Module, key: str, tensor: torch.Tensor) -> None:
        if live():
            record(key, name, tensor, input_sharding(tensor, local()), None)

    return taken
