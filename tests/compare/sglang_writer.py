"""Write an sglang-format dump of a megalign dump's tensors with sglang's own dumper code.

Run one process per rank of the source dump (`torchrun --nproc-per-node N tests/compare/sglang_writer.py
SRC OUT`): each rank initialises megatron's parallel state in the source's layout (so that the
dumper's megatron plugin records `megatron_parallel_info`) and dumps its own shards:
activations with `dumper.dump(name, tensor, dims=...)`, their gradients through the dumper's own
grad hooks (a backward from the recorded gradient), parameter gradients with `dumper.dump_model`.

sglang's package `__init__`s need a GPU stack; the dumper module itself imports three sglang
modules only for its HTTP/ZMQ control server and the sglang-serving plugin. Those three are
stubbed (load_sglang_dumper); the code that names, tags and writes the files is sglang's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def load_sglang_dumper():
    """Import sglang.srt.debug_utils.dumper without running sglang's package __init__s."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    for name, folder in (("sglang", root), ("sglang.srt", root / "srt"), ("sglang.srt.managers", root / "srt/managers")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules.setdefault(name, package)

    def unavailable(*args, **kwargs):
        raise RuntimeError("not available outside an sglang server")

    stubs = {"sglang.srt.managers.io_struct": ("sock_recv", "sock_send", "wrap_as_pickle"),
             "sglang.srt.runtime_context": ("get_parallel", "get_server_args", "get_serving"),
             "sglang.srt.utils": ("get_device",)}
    for name, attributes in stubs.items():
        module = types.ModuleType(name)
        for attribute in attributes:
            setattr(module, attribute, unavailable)
        sys.modules.setdefault(name, module)
    from sglang.srt.debug_utils import dumper

    return dumper


def dims_of(record, layout):
    """The sglang dims string for a megalign record, or None where dims cannot say it."""
    sharding = record.sharding
    if not record.shape or (sharding.tp_dim is not None and sharding.tp_parts > 1 and layout.tp > 1):
        return None  # scalars have no dims; fused gate|up slices have no sglang spelling
    tokens = []
    for dim in range(len(record.shape)):
        if dim == sharding.seq_dim:
            tokens.append("s[cp:zigzag]" if layout.cp > 1 else "s")
        elif dim == sharding.tp_dim and layout.tp > 1:
            tokens.append(f"d{dim}[tp]")
        else:
            tokens.append(f"d{dim}")
    replicated = [axis for axis in ("tp", "cp") if getattr(layout, axis) > 1 and not any(
        f"[{axis}" in t for t in tokens)]
    return " ".join(tokens) + (" # " + " ".join(f"{a}:replicated" for a in replicated) if replicated else "")


def _module_tree(grads: dict):
    """An nn.Module whose named_parameters() are exactly the dotted names in `grads`."""
    import torch

    root = torch.nn.Module()
    for name, grad in grads.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        parameter = torch.nn.Parameter(torch.zeros_like(grad))
        parameter.grad = grad.clone()
        module.register_parameter(leaf, parameter)
    return root


def main(source: str, out: str) -> None:
    from megalign.stacks.megatron.cpu_patches import apply_cpu_patches, install_import_stubs

    install_import_stubs()
    apply_cpu_patches()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megalign.dump.reader import DumpFiles

    dist.init_process_group("gloo")
    dump = DumpFiles.open(Path(source))
    layout = dump.layout
    parallel_state.initialize_model_parallel(layout.tp, layout.pp, context_parallel_size=layout.cp)
    dumper = load_sglang_dumper().dumper
    dumper.configure(enable=True, dir=out, exp_name="exp", enable_output_console=False, enable_grad=True,
                     enable_model_grad=True, enable_model_value=False)
    rank = dump.ranks[dist.get_rank()]
    grads = {r.name: r for r in rank.records if r.kind == "activation_grad"}
    leaves = {}
    for record in rank.records:
        if record.kind in ("activation_grad", "param_grad") or (
                record.kind == "input" and record.name not in ("tokens", "position_ids")):
            continue  # gradients come below; sglang has no name for labels and loss masks
        tensor = dump.load(rank, record)
        name = "input_ids" if (record.kind, record.name) == ("input", "tokens") else record.name
        if record.kind in ("activation", "logits") and record.name in grads:
            tensor = leaves[record.name] = tensor.clone().requires_grad_(True)
        dumper.dump(name, tensor, dims=dims_of(record, layout))
    for record in rank.records:  # backward order, as recorded
        if record.kind == "activation_grad":
            leaves[record.name].backward(dump.load(rank, record))
    param_grads = {r.name: dump.load(rank, r) for r in rank.records if r.kind == "param_grad"}
    dumper.dump_model(_module_tree(param_grads))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
