"""From what a user typed (a RunConfig) to a validated RunSpec: every user mistake is caught here, before a launch."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from megalign.dump.landing import check_apart, check_out
from megalign.dump.zoom import full_values
from megalign.errors import UserError, compile_pattern
from megalign.options import RunConfig
from megalign.run.tokens import check_tokens, default_tokens, load_tokens, resolve_seq_len, rollout_sequences
from megalign.spec import Layout, ModelConfig, RunSpec, check_layout, has_transformer_engine, resolve_attention
from megalign.stacks.dist_checkpoint import check_data_files, checkpoint_folder, checkpoint_model


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
    if attention == "te" and not has_transformer_engine():
        raise UserError("--attention te needs TransformerEngine, which is not installed")


def check_attention_features(model: ModelConfig, attention: str, cp: int, packed: bool) -> None:
    """GPT-OSS's sinks and window are megatron's local DotProductAttention's; megalign's torch attention, which
    CP and packed rows use, computes neither."""
    if model.softmax_type == "vanilla" and model.window_size is None:
        return
    if attention == "torch" or cp > 1 or packed:
        used = "--attention torch" if attention == "torch" else f"--cp {cp}" if cp > 1 else "--packed"
        raise UserError(f"{used} with attention sinks or a sliding window: megalign's torch attention (CP, packed "
                        "rows) computes neither; use --ep")


def check_qk_norms(model: ModelConfig, attention: str, sp: bool) -> None:
    """A qk_layernorm model's q and k norms (Qwen3, GLM-4.5): megatron-core's local spec builds them with
    torch's norm, which asserts deep in the model's build that sequence parallelism is off; TransformerEngine's
    norm (its layer spec, on a GPU) takes it. `attention`: resolved (spec.resolve_attention)."""
    if sp and model.qk_layernorm and attention != "te":
        raise UserError("--sp with the model's q/k norms (qk_layernorm): megatron-core's local layer spec builds them "
                        "with torch's norm, which refuses sequence parallelism; run without --sp, or on a GPU "
                        "with TransformerEngine (--attention te)")


def resolve_model(config: RunConfig) -> ModelConfig:
    """--hf derives the model from the checkpoint's config.json; else --config; else --load's megalign.json;
    else the tiny model. With --load, --hf or --config must be the checkpoint's model."""
    source = config.source
    if source.hf and source.config:
        raise UserError("--hf and --config cannot be combined: --hf takes the model from the checkpoint's config.json")
    given = ModelConfig.from_yaml(source.config) if source.config else None
    if source.hf:
        from megalign.stacks.hf.checkpoint import open_checkpoint

        given = open_checkpoint(source.hf).model
    if source.load:
        return checkpoint_model(checkpoint_folder(source.load), given, f"--hf {source.hf}" if source.hf else f"--config {source.config}")
    return given or ModelConfig()


def check_checkpoints(config: RunConfig) -> None:
    """--load and --save are megatron's; --load's files are all there; --save lands like --out (dump/landing.py),
    by megalign's launcher."""
    load, save = config.source.load, config.output.save
    if (load or save) and config.source.stack != "megatron":
        raise UserError("--load and --save read and write Megatron checkpoints: they need --stack megatron")
    if load:
        check_data_files(checkpoint_folder(load))
    if save is None:
        return
    if config.launch.launcher == "none":
        raise UserError("--save cannot be used with --launcher none (megalign's launcher lands the checkpoint once "
                        "every rank has written it)")
    check_apart(config.dump_folder(), save, "--save")
    check_out(save, False, flag="--save")


def check_distributed_optimizer(config: RunConfig) -> None:
    if config.parallel.distributed_optimizer and config.mode != "backward":
        raise UserError("--distributed-optimizer shards gradients: it needs backward, not forward")
    if config.numerics.grad_source == "shard" and not config.parallel.distributed_optimizer:
        raise UserError("--grad-source shard reads the distributed optimizer's shard: it needs --distributed-optimizer")


def check_recompute(config: RunConfig) -> None:
    """megatron recomputes only in training (TransformerBlock checks self.training), and only its own layers."""
    recompute = config.numerics.recompute
    if recompute == "none":
        return
    if config.mode != "backward":
        raise UserError(f"--recompute {recompute} recomputes activations in backward: it needs backward, not forward")
    if config.source.stack != "megatron":
        raise UserError(f"--recompute {recompute} is megatron-core's activation recomputation: it needs "
                        "--stack megatron")


def check_stack(config: RunConfig) -> None:
    stack, p = config.source.stack, config.parallel
    if stack == "megatron":
        return
    if stack != "hf":
        raise UserError(f"--stack {stack!r}: expected megatron or hf")
    if config.source.hf is None:
        raise UserError("--stack hf needs a checkpoint: pass --hf PATH")
    if (p.tp, p.pp, p.cp, p.dp or 1, p.ep) != (1, 1, 1, 1, 1) or p.sp or p.distributed_optimizer:
        raise UserError("--stack hf runs transformers in one process: --tp, --pp, --cp, --dp and --ep must be 1, "
                        "without --sp or --distributed-optimizer")
    if config.batch.packed:
        raise UserError("--stack hf runs padded batches only: drop --packed (compare lines a packed megatron run "
                        "up with a padded one)")


def _rollout_vocabulary_fix(config: RunConfig) -> str:
    """A rollout's ids are its engine's tokenizer's: outside the model's vocabulary, the model is not the engine's."""
    source = config.source
    if source.hf:
        return f": the rollout's ids are another tokenizer's than --hf {source.hf}'s (the engine ran another model)"
    model = f"--config {source.config}" if source.config else "megalign's default tiny model"
    return f": the rollout's ids are a real model's, and this run has {model}; pass --hf CHECKPOINT, the " \
           "checkpoint the engine ran"


def plan_run(config: RunConfig) -> RunSpec:
    """The RunSpec of `config`, its defaults resolved (--out, --dp, --seq-len, --device, the model, the tokens)."""
    batch = config.batch
    # --rollout's file is read first: its errors are the first a run with one reports
    rollout = rollout_sequences(batch.rollout, config.source.hf) if batch.rollout else None
    if config.launch.launcher == "none" and config.output.overwrite:
        raise UserError("--overwrite cannot be used with --launcher none (ranks would race to clear "
                        "the folder); remove --out first")
    check_stack(config)
    check_recompute(config)
    check_checkpoints(config)
    model = resolve_model(config)
    p, numerics, output = config.parallel, config.numerics, config.output
    if batch.rollout and batch.tokens:
        raise UserError("--rollout and --tokens cannot be combined: the rollout's prompts and responses are the tokens")
    tokens, label_mask = rollout if rollout else \
        (load_tokens(batch.tokens) if batch.tokens else default_tokens(model.vocab_size), None)
    check_tokens(tokens, model.vocab_size, _rollout_vocabulary_fix(config) if rollout else "")
    layout = Layout(tp=p.tp, pp=p.pp, cp=p.cp, dp=1 if p.dp is None else p.dp, sp=p.sp, ep=p.ep, etp=p.etp)
    layout.check_sizes()
    if p.dp is None:
        layout = replace(layout, dp=layout.expert_dp())
    seq_len = resolve_seq_len(tokens, batch.seq_len)
    if rollout and batch.seq_len is None:  # a rollout's lengths are the engine's: pad them to what CP (and SP) cut
        seq_len = -(-seq_len // layout.packing_multiple) * layout.packing_multiple
    if batch.packed:
        seq_len = _packed_seq_len(tokens, batch.seq_len, layout)
    check_layout(layout, model, seq_len, len(tokens))
    check_distributed_optimizer(config)
    if output.filter:
        compile_pattern("--filter", output.filter)
    if output.dump_only:
        full_values(output.dump_only, "--dump-only")
    check_attention(numerics.attention, p.cp, numerics.dtype, batch.packed)
    check_attention_features(model, numerics.attention, p.cp, batch.packed)
    check_qk_norms(model, resolve_attention(numerics.attention, resolve_device(numerics.device), p.cp, batch.packed),
                   p.sp)
    timeout_s = config.launch.timeout_s
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UserError(f"--timeout must be a positive number of seconds, got {timeout_s:g}")
    out = config.dump_folder()
    check_out(out, output.overwrite)
    return RunSpec(mode=config.mode, out=str(out), model=model, layout=layout, tokens=tokens, label_mask=label_mask,
                   seq_len=seq_len,
                   device=resolve_device(numerics.device), dtype=numerics.dtype, seed=numerics.seed,
                   attention=numerics.attention, loss_norm=numerics.loss_norm, grad_source=numerics.grad_source,
                   recompute=numerics.recompute,
                   filter=output.filter, stats_only=output.stats_only, dump_only=output.dump_only,
                   timeout_s=timeout_s,
                   distributed_optimizer=p.distributed_optimizer, hf=str(config.source.hf) if config.source.hf else None,
                   load=str(checkpoint_folder(config.source.load)) if config.source.load else None,
                   save=str(output.save) if output.save else None,
                   packed=batch.packed, moe_dispatcher=p.moe_dispatcher, packed_split=batch.packed_split)


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
