"""From what a user typed to a validated RunSpec: every user mistake is caught here, before a launch."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from megalign.dump.landing import check_out
from megalign.errors import UserError, compile_pattern
from megalign.run.tokens import check_tokens, default_tokens, load_tokens, resolve_seq_len
from megalign.spec import Layout, ModelConfig, RunSpec


@dataclass
class RunRequest:
    mode: str
    out: Path
    config: Optional[Path] = None
    tokens: Optional[Path] = None
    seq_len: Optional[int] = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: Optional[int] = None  # None: 1, or what --ep needs
    sp: bool = False
    ep: int = 1
    etp: Optional[int] = None
    moe_dispatcher: str = "alltoall"
    distributed_optimizer: bool = False
    device: str = "auto"
    dtype: str = "fp32"
    seed: int = 1234
    attention: str = "auto"
    loss_norm: str = "global"
    grad_source: str = "auto"
    filter: Optional[str] = None
    stats_only: bool = False
    overwrite: bool = False
    timeout_s: float = 600.0
    hf: Optional[Path] = None
    stack: str = "megatron"
    packed: bool = False
    packed_split: str = "document"


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    return device


def check_attention(attention: str, cp: int, dtype: str, packed: bool) -> None:
    if attention == "local" and packed:
        raise UserError("--attention local (megatron's DotProductAttention) does not take packed sequences; "
                        "use --attention torch or te")
    if attention == "te" and dtype == "fp64":
        raise UserError("--dtype fp64 with --attention te: TransformerEngine's attention has no float64 kernels")
    if attention == "local" and cp > 1:
        raise UserError("--attention local (megatron's DotProductAttention) cannot run with --cp > 1; "
                        "use --attention torch or te")
    if attention == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise UserError("--attention te needs TransformerEngine, which is not installed")


def resolve_model(request: RunRequest) -> ModelConfig:
    """--hf derives the model from the checkpoint's config.json; else --config, else the tiny model."""
    if request.hf is None:
        return ModelConfig.from_yaml(request.config) if request.config else ModelConfig()
    if request.config:
        raise UserError("--hf and --config cannot be combined: --hf takes the model from the checkpoint's config.json")
    from megalign.stacks.hf.checkpoint import open_checkpoint

    return open_checkpoint(request.hf).model


def check_distributed_optimizer(request: RunRequest) -> None:
    if request.distributed_optimizer and request.mode != "backward":
        raise UserError("--distributed-optimizer shards gradients: it needs backward, not forward")
    if request.grad_source == "shard" and not request.distributed_optimizer:
        raise UserError("--grad-source shard reads the distributed optimizer's shard: it needs --distributed-optimizer")


def check_stack(request: RunRequest) -> None:
    if request.stack == "megatron":
        return
    if request.stack != "hf":
        raise UserError(f"--stack {request.stack!r}: expected megatron or hf")
    if request.hf is None:
        raise UserError("--stack hf needs a checkpoint: pass --hf PATH")
    if (request.tp, request.pp, request.cp, request.dp or 1, request.ep) != (1, 1, 1, 1, 1) or request.sp \
            or request.distributed_optimizer:
        raise UserError("--stack hf runs transformers in one process: --tp, --pp, --cp, --dp and --ep must be 1, "
                        "without --sp or --distributed-optimizer")
    if request.packed:
        raise UserError("--stack hf runs padded batches only: drop --packed (compare lines a packed megatron run "
                        "up with a padded one)")


def plan_run(request: RunRequest) -> RunSpec:
    check_stack(request)
    model = resolve_model(request)
    tokens = load_tokens(request.tokens) if request.tokens else default_tokens(model.vocab_size)
    check_tokens(tokens, model.vocab_size)
    layout = Layout(tp=request.tp, pp=request.pp, cp=request.cp, dp=1 if request.dp is None else request.dp,
                    sp=request.sp, ep=request.ep, etp=request.etp)
    layout.check_sizes()
    if request.dp is None:
        layout = replace(layout, dp=layout.expert_dp())
    seq_len = resolve_seq_len(tokens, request.seq_len)
    if request.packed:
        seq_len = _packed_seq_len(tokens, request.seq_len, layout)
    layout.check(model, seq_len, len(tokens))
    check_distributed_optimizer(request)
    if request.filter:
        compile_pattern("--filter", request.filter)
    check_attention(request.attention, request.cp, request.dtype, request.packed)
    if not (math.isfinite(request.timeout_s) and request.timeout_s > 0):
        raise UserError(f"--timeout must be a positive number of seconds, got {request.timeout_s:g}")
    check_out(request.out, request.overwrite)
    return RunSpec(mode=request.mode, out=str(request.out), model=model, layout=layout, tokens=tokens, seq_len=seq_len,
                   device=resolve_device(request.device), dtype=request.dtype, seed=request.seed,
                   attention=request.attention, loss_norm=request.loss_norm, grad_source=request.grad_source,
                   filter=request.filter, stats_only=request.stats_only, timeout_s=request.timeout_s,
                   distributed_optimizer=request.distributed_optimizer,
                   hf=str(request.hf) if request.hf else None, packed=request.packed, moe_dispatcher=request.moe_dispatcher,
                   packed_split=request.packed_split)


def _packed_seq_len(tokens: list[list[int]], seq_len: Optional[int], layout: Layout) -> int:
    """The packed row's length: --seq-len, which must hold each DP rank's padded documents, or the shortest that does."""
    from megalign.stacks.batch import packed_length, packed_rows

    layout.check_sequences(len(tokens))
    multiple = layout.packing_multiple
    if seq_len is None:
        return packed_length(tokens, layout.dp, multiple)
    if seq_len % multiple:
        raise UserError(f"--packed: --seq-len {seq_len} is not a multiple of {multiple} (each document is padded to "
                        f"a multiple of {multiple} for the CP zigzag{' and SP' if layout.sp else ''})")
    packed_rows(tokens, seq_len, layout.dp, multiple)  # raises when the documents do not fit
    return seq_len
