"""`--stack hf`: the same padded batch through transformers' own model, written as a megalign dump
through megalign.Dumper, its outputs and gradients caught by capture/'s transformers adapter.

One rank in megalign's own process, no torchrun: transformers' eager attention, no attention mask
(right padding under a causal mask is what megatron's run sees too), labels and loss mask from
batch.build_batch, the loss normalised as in megatron/loss.py. Outputs and gradients with a megatron
counterpart are written under the megatron name and layout (namemap.py), so that `megalign compare`
lines them up; the rest under their HF names, where they show up as only-in-one-side rows.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megalign.capture.coverage import check_coverage
from megalign.capture.dumper import Dumper
from megalign.capture.transformers_adapter import BATCH_FIRST, TransformersAdapter
from megalign.dump.format import PRECISION_DTYPES, Kind, layer_of
from megalign.dump.meta import package_version
from megalign.dump.sharding import Sharding
from megalign.errors import UserError
from megalign.spec import RunSpec
from megalign.stacks.batch import batch_rows, build_batch, mean_token_loss
from megalign.stacks.events import emit, failures_reported
from megalign.stacks.hf.checkpoint import HFCheckpoint, open_checkpoint
from megalign.stacks.hf.namemap import NameMap
from megalign.stacks.meta import run_meta
from megalign.stacks.precision import precision


def run_worker(spec: RunSpec) -> None:
    """Run and write the whole dump (one rank, then dump.json) into `spec.out`, a folder the caller has claimed."""
    with failures_reported(0):
        _run(spec)


def _run(spec: RunSpec) -> None:
    emit("started", 0)
    started = time.monotonic()
    checkpoint = open_checkpoint(Path(spec.hf))
    model = load_model(checkpoint, spec)
    emit("built", 0)
    rows = batch_rows(spec)
    batch = build_batch(spec.tokens, rows, spec.label_mask)
    inputs = {k: v.to(spec.device) for k, v in batch.as_dict().items()}
    dumper = Dumper(spec.out, stats_only=spec.stats_only, name_filter=spec.filter, dump_only=spec.dump_only,
                    claim=False)
    for key, value in inputs.items():
        dumper.add(Kind.INPUT, key, value, BATCH_FIRST)

    backward = spec.mode == "backward"
    adapter = TransformersAdapter(model, checkpoint.names, spec.seq_len, moe=checkpoint.family.experts is not None)
    dumper.hook_outputs(model, adapter)
    with torch.set_grad_enabled(backward), precision(spec.dtype):
        logits = model(input_ids=inputs["tokens"], position_ids=inputs["position_ids"], use_cache=False).logits
        dumper.add(Kind.LOGITS, "logits", logits, BATCH_FIRST)
        labels = inputs["labels"]
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
        dumper.add(Kind.LOGPROBS, "logprobs", -per_token, BATCH_FIRST)
        mask = inputs["loss_mask"]
        loss = mean_token_loss(per_token, mask, mask.sum())
        dumper.add(Kind.LOSS, "loss", loss, Sharding())
        if backward:
            loss.backward()
    emit(spec.mode, 0)
    manifest = {"grad_coverage": write_param_grads(model, adapter, checkpoint.names, dumper,
                                                   checkpoint.family.experts)} if backward else {}
    dumper.close(manifest, lambda: run_meta(spec, elapsed_s=time.monotonic() - started, stack="hf",
                                            transformers=package_version("transformers"),
                                            rows=[row.to_dict() for row in rows], cp_split="document"))
    emit("written", 0, tensors=len(dumper.records), bytes=dumper.bytes_written, loss=float(loss.detach()))
    emit("done", 0)


def load_model(checkpoint: HFCheckpoint, spec: RunSpec) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the CLI draws its own status
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint.path, attn_implementation="eager",
                                                     dtype=PRECISION_DTYPES[spec.dtype], use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"--hf {checkpoint.path}: transformers cannot load it ({str(e).splitlines()[0]})") from None
    return model.to(spec.device).train(False)  # eval: no dropout, as megatron's run (dropout 0)


def write_param_grads(model: torch.nn.Module, adapter: TransformersAdapter, names: NameMap, dumper: Dumper,
                      experts=None) -> dict:
    """Gradients, read by `adapter`, joined into megatron's parameters (fused QKV, fused gate/up);
    HF-only ones as they are. MoE experts, fused in memory, are first cut into the checkpoint's
    per-expert tensors."""
    params = dict(model.named_parameters())
    grads = adapter.read_grads(params)
    present = adapter.held(list(grads.values()), list(params.values()))
    coverage = check_coverage([name for name, seen in zip(grads, present) if not seen], len(grads), ".grad")
    if experts is not None:
        grads = {key: value for name, grad in grads.items()
                 for key, value in experts.checkpoint_grads(name, grad, layer_of(name)).items()}
    used = set()
    for megatron, (rule, parts) in names.params().items():
        value = names.join(rule, [grads[p] for p in parts], dim=0)
        dumper.add(Kind.PARAM_GRAD, megatron, value, module=megatron.rsplit(".", 1)[0], stable=True)
        used.update(parts)
    for name in (n for n in grads if n not in used):
        dumper.add(Kind.PARAM_GRAD, name, grads[name], module=name.rsplit(".", 1)[0], stable=True)
    return coverage
