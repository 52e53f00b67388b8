"""One rank of a megatron-core forward or backward run: build, run the real schedule, dump.

Started once per rank by torch's launcher (`python -m megalign.stacks.megatron.worker SPEC.json`),
or in-process by `megalign ... --launcher none` under a user's own torchrun/srun. Progress and
failures go to stdout as `@@megalign {json}` lines that the launcher reads (stacks/events.py). Every
tensor is written through megalign.Dumper, the model's outputs as capture/'s megatron-core adapter
names and lays them out (capture/megatron_adapter.py, with the worker's own outputs).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

from megalign.spec import RunSpec
from megalign.stacks.events import emit, failures_reported

LOADED = time.monotonic()  # the rank's start-up (dump.json's start_s) counts from here


def run_worker(spec: RunSpec) -> None:
    rank = int(os.environ.get("RANK", "0"))
    with failures_reported(rank):
        _run(spec, rank)


def _run(spec: RunSpec, rank: int) -> None:
    _import_megatron(spec.device)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megalign.capture.dumper import Dumper
    from megalign.capture.megatron_adapter import MegatronAdapter, WorkerOutputs
    from megalign.dump.format import Kind
    from megalign.dump.layout import cp_split_bounds, dp_rows
    from megalign.dump.sharding import Sharding
    from megalign.stacks.batch import batch_rows, build_batch
    from megalign.stacks.megatron.grads import ExpertTokens, collect_param_grads
    from megalign.stacks.megatron.loss import token_loss
    from megalign.stacks.megatron.model import build_model, load_weights, transformer_config
    from megalign.stacks.megatron.packing import packed_seq_params, split_packed_over_cp
    from megalign.stacks.meta import run_meta
    from megalign.stacks.precision import precision
    from megalign.stacks.seeded import seeded_weights

    started = time.monotonic()
    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", timeout=timedelta(seconds=spec.timeout_s))
    layout = spec.layout
    parallel_state.initialize_model_parallel(layout.tp, layout.pp, context_parallel_size=layout.cp,
                                             expert_model_parallel_size=layout.ep,
                                             expert_tensor_parallel_size=layout.expert_tp)
    # The launcher has claimed spec.out and lands it. The Dumper reads this rank's coordinates from parallel_state.
    dumper = Dumper(spec.out, stats_only=spec.stats_only, name_filter=spec.filter, dump_only=spec.dump_only,
                    claim=False)
    coords = dumper.coords
    if layout.expert_tp == layout.tp > 1 and parallel_state.get_expert_tensor_parallel_rank() != coords.tp_rank:
        raise RuntimeError("expert TP ranks differ from TP ranks: megalign cannot reassemble expert shards here")
    emit("started", rank)

    torch.manual_seed(spec.seed)
    model_parallel_cuda_manual_seed(spec.seed)
    config = transformer_config(spec)
    model = build_model(spec, config)
    weights_from = time.monotonic()
    if spec.load:
        from megalign.stacks.megatron.checkpoint import load_checkpoint

        load_checkpoint(model, Path(spec.load), spec.model)
    elif spec.hf:
        from megalign.stacks.hf.checkpoint import megatron_weights, open_checkpoint
        from megalign.stacks.shard import from_full

        # MEGALIGN_FAULT=parameters-only plants a loader that sets only parameters (DeepSeek-V3: expert bias 0).
        load_weights(model, spec.model, _planted_weights(from_full(megatron_weights(open_checkpoint(Path(spec.hf))))),
                     buffers=os.environ.get("MEGALIGN_FAULT") != "parameters-only")
    else:
        load_weights(model, spec.model, _planted_weights(seeded_weights(spec.seed, spec.model.init_method_std)))
    if spec.save:
        from megalign.stacks.megatron.checkpoint import save_checkpoint

        save_checkpoint(model, Path(spec.save), spec)
    weights_s = time.monotonic() - weights_from
    emit("built", rank)
    _inject_fault(rank)
    _plant_recompute_fault(model)

    backward = spec.mode == "backward"
    rows = batch_rows(spec)
    batch = build_batch(spec.tokens, rows, spec.label_mask).as_dict()
    # Each DP rank takes its contiguous share of the rows, then each CP rank its chunks of those.
    mine = dp_rows(len(rows), layout.dp, _rows_read(rank, coords.dp_rank))
    batch = {key: value[mine] for key, value in batch.items()}
    cp_group = parallel_state.get_context_parallel_group()
    packed = None
    if spec.packed:
        (row,) = rows[mine]  # one packed row a DP rank
        batch = split_packed_over_cp(batch, cp_split_bounds(row, spec.cp_split), cp_group)
        dumper.cut_at(cp_split_bounds(row, spec.cp_split))  # the inputs' sketches, before the forward says so
        packed = packed_seq_params(row, cp_group, "cuda" if spec.device == "cuda" else "cpu")
    elif layout.cp > 1:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    if spec.device == "cuda":
        batch = {k: v.cuda() for k, v in batch.items()}

    if coords.pp_rank == 0:  # every stage sees the same inputs; one copy keeps names unique across stages
        for key, value in batch.items():
            dumper.add(Kind.INPUT, key, value, Sharding(seq_dim=1, dp_dim=0))
    if spec.routing_replay:
        from megalign.stacks.megatron.moe import replay_routing

        replay_routing(model, spec, rows, coords)  # before the capture's hooks, which then see the forced choices
    outputs = WorkerOutputs(spec.model.vocab_size, spec.model.padded_vocab_size(layout.tp))
    dumper.hook_outputs(model, MegatronAdapter(model, [], dumper.layout, outputs))  # its gradients: grads.py

    if backward:
        # Forward-only runs never wrap in DDP: its gradient buffers would be allocated for nothing.
        # Gradients are reduced in float32, or in float64 for the fp64 reference run.
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=spec.dtype != "fp64",
                                                   use_distributed_optimizer=spec.distributed_optimizer)
        chunk = DistributedDataParallel(config, ddp_config, model)
        chunk.train()
        # The loss function normalises (--loss-norm), so finalize must not divide by the token count again.
        config.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks)
    else:
        chunk = model
        chunk.train(False)

    def forward_step(data_iterator, module):
        data = next(data_iterator)
        losses = module(data["tokens"], data["position_ids"], attention_mask=None, labels=data["labels"],
                        packed_seq_params=packed)
        return losses, partial(token_loss, dumper, data["loss_mask"], spec.loss_norm)

    # Counted for the gradient coverage: an expert no token reached has no gradient to miss.
    experts = ExpertTokens(model, spec.model.num_layers, spec.model.num_moe_experts) \
        if backward and spec.model.num_moe_experts else None
    schedule = get_forward_backward_func()
    with torch.set_grad_enabled(backward), precision(spec.dtype):
        reduced = schedule(forward_step_func=forward_step, data_iterator=iter([batch]), model=[chunk],
                           num_microbatches=1, seq_length=spec.seq_len, micro_batch_size=batch["tokens"].shape[0],
                           forward_only=not backward)
    emit("backward" if backward else "forward", rank)

    manifest = {}
    if backward:
        manifest["grad_coverage"] = collect_param_grads(chunk, model, dumper, spec, experts)
    dumper.close(manifest, lambda: run_meta(spec, elapsed_s=time.monotonic() - started,
                                            rows=[row.to_dict() for row in rows], cp_split=spec.cp_split,
                                            start_s=round(started - LOADED, 3), weights_s=round(weights_s, 3)))
    loss = float(reduced[0]["loss"]) if reduced else None
    emit("written", rank, tensors=len(dumper.records), bytes=dumper.bytes_written, loss=loss)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    emit("done", rank)


def preload(device: str) -> None:
    """What every rank imports, imported once by the server that launchers and their ranks are forked
    from (run/forked.py, run/preloaded.py)."""
    _import_megatron(device)
    import megalign.capture.megatron_adapter  # noqa: F401
    import megalign.stacks.megatron.model  # noqa: F401


def _import_megatron(device: str) -> None:
    """The patches the device needs, which import megatron-core: without torch's compiler (imports.py)."""
    from megalign.stacks.megatron.imports import compile_on_first_call

    with compile_on_first_call():
        if device == "cpu":
            from megalign.stacks.megatron.cpu_patches import apply_cpu_patches, install_import_stubs

            install_import_stubs()
            apply_cpu_patches()
        else:
            from megalign.stacks.megatron.cpu_patches import apply_te_stand_ins

            apply_te_stand_ins()


def _inject_fault(rank: int) -> None:
    """MEGALIGN_FAULT=crash@R or hang@R makes rank R fail or hang here: how the tests check that the
    launcher stops every worker and names the failing rank."""
    fault = os.environ.get("MEGALIGN_FAULT", "")
    kind, _, target = fault.partition("@")
    if not fault or int(target or 0) != rank:
        return
    if kind == "crash":
        raise RuntimeError(f"fault injected by MEGALIGN_FAULT={fault}")
    if kind == "hang":
        time.sleep(10 ** 6)


def _plant_recompute_fault(model) -> None:
    """MEGALIGN_FAULT=recompute-differs@L scales layer L's core attention output (this stage's layer L)
    by 1.001 in its recomputed forward only (--recompute full and selective both recompute it), as a
    recomputation that does not replay its first forward (an RNG state or a buffer not restored)
    computes otherwise: how the tests plant a difference that no activation shows, only the gradients
    backward takes through the recomputed layer."""
    from megalign.capture.recompute import recomputing

    kind, _, layer = os.environ.get("MEGALIGN_FAULT", "").partition("@")
    if kind != "recompute-differs":
        return

    def planted(module, inputs, output):
        return output * 1.001 if recomputing() else output

    model.get_submodule(f"decoder.layers.{layer}.self_attention.core_attention").register_forward_hook(planted)


def _rows_read(rank: int, dp_rank: int) -> int:
    """The DP rank whose rows this rank reads: its own, but DP rank 0's under MEGALIGN_FAULT=same-rows@R on
    rank R (two ranks on one data shard): how the tests plant a difference in one rank's rows."""
    kind, _, target = os.environ.get("MEGALIGN_FAULT", "").partition("@")
    return 0 if kind == "same-rows" and int(target or 0) == rank else dp_rank


def _planted_weights(weights):
    """MEGALIGN_FAULT=perturb-router@L adds noise to layer L's router, enough to send some tokens to
    other experts: how the tests plant a routing flip in seeded or loaded weights alike."""
    import torch

    kind, _, layer = os.environ.get("MEGALIGN_FAULT", "").partition("@")
    if kind != "perturb-router":
        return weights

    def planted(name: str, shard):
        value = weights(name, shard)
        if name == f"decoder.layers.{layer}.mlp.router.weight":  # a replica on every rank: the shard is whole
            value = value + 0.5 * value.std() * torch.randn(shard.shape, generator=torch.Generator().manual_seed(0))
        return value

    return planted


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m megalign.stacks.megatron.worker SPEC.json")
    run_worker(RunSpec.from_json(Path(argv[0]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
