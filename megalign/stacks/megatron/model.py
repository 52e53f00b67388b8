"""Building megatron-core's GPTModel for one rank, with weights that do not depend on the layout.

Every parameter is set from a weight source asked for this rank's ParamShard of the parameter's full,
unsharded tensor, by global name (stacks/shard.py): seeded weights (stacks/seeded.py) draw only
that shard, a checkpoint's full tensors are cut to it; so TP=1, TP=2, PP=2 and CP=N all hold the
same numbers. `load_weights` is the one place a parameter's shard is worked out.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megalign.capture.ddp_grads import tp_group
from megalign.capture.megatron_adapter import mask_vocab_padding, param_sharding
from megalign.capture.megatron_names import global_name, is_duplicate_embedding
from megalign.dump.format import PRECISION_DTYPES
from megalign.spec import ModelConfig, RunSpec, resolve_attention
from megalign.stacks.shard import ParamShard, WeightSource


def transformer_config(spec: RunSpec) -> TransformerConfig:
    model, layout, dtype = spec.model, spec.layout, PRECISION_DTYPES[spec.dtype]
    config_class, mla = (MLATransformerConfig, _mla_config(model)) if model.multi_latent_attention \
        else (TransformerConfig, {})
    config = config_class(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size, kv_channels=model.kv_channels,
        normalization=model.normalization, layernorm_epsilon=model.layernorm_epsilon,
        gated_linear_unit=model.swiglu, activation_func=_activation(model),
        glu_linear_offset=model.glu_linear_offset, activation_func_clamp_value=model.activation_func_clamp_value,
        softmax_type=model.softmax_type, window_attn_skip_freq=model.window_attn_skip_freq,
        window_size=tuple(model.window_size) if model.window_size is not None else None,
        add_bias_linear=model.add_bias_linear, add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, sequence_parallel=layout.sp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False,
        # The loss function normalises (see loss.py), so megatron must neither average nor rescale.
        calculate_per_token_loss=True,
        **_moe_config(spec), **mla, **_recompute_config(spec),
        # Fusions go through torch.compile (about 20 s cold) and are not what is being compared.
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    if model.position_embedding == "yarn" and not model.multi_latent_attention:
        # GPTModel and the attention read these with getattr: TransformerConfig declares none of them.
        for name, value in _yarn(model).items():
            setattr(config, f"yarn_{name}", value)
    return config


def _recompute_config(spec: RunSpec) -> dict:
    """--recompute as Megatron-LM's --recompute-* flags set it: full, one layer a checkpointed unit."""
    if spec.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if spec.recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


def _activation(model: ModelConfig):
    if not model.swiglu:
        return F.gelu
    return quick_gelu if model.activation == "quick_gelu" else F.silu


def _yarn(model: ModelConfig) -> dict:
    return dict(rotary_scaling_factor=model.yarn_rotary_scaling_factor,
                original_max_position_embeddings=model.yarn_original_max_position_embeddings,
                beta_fast=model.yarn_beta_fast, beta_slow=model.yarn_beta_slow, mscale=model.yarn_mscale,
                mscale_all_dim=model.yarn_mscale_all_dim,
                correction_range_round_to_int=model.yarn_correction_range_round_to_int)


def _moe_config(spec: RunSpec) -> dict:
    model = spec.model
    if not model.is_moe:
        return {}
    return dict(
        num_moe_experts=model.num_moe_experts, moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_router_score_function=model.moe_router_score_function, moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type, moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type=spec.moe_dispatcher, expert_model_parallel_size=spec.layout.ep,
        expert_tensor_parallel_size=spec.layout.expert_tp,
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        moe_enable_routing_replay=spec.routing_replay is not None,
        moe_layer_freq=model.moe_layer_freq or 1,
        moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_dtype="fp32" if model.moe_router_fp32 else None,
        # megatron moves the expert bias in finalize_model_grads after every step, transformers never: frozen,
        # so that step 2 onward of a multi-step pair still computes what the other stack does.
        **({"moe_router_bias_update_rate": 0.0} if model.moe_router_enable_expert_bias else {}),
    )


def _mla_config(model: ModelConfig) -> dict:
    """RoPE (or YaRN) over the qk_pos_emb_head_dim part; qk_layernorm (the family sets it) norms the q and kv
    latents. MLA's YaRN always rounds its correction range (families.py refuses truncate=false)."""
    mla = dict(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
               qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim, rope_type="rope",
               rotary_base=model.rotary_base)
    if model.position_embedding != "yarn":
        return mla
    yarn = _yarn(model)
    del yarn["correction_range_round_to_int"]
    # MLA scales the softmax by mscale(factor, mscale_all_dim)^2, where 0 means no scaling (transformers' unset).
    return {**mla, **yarn, "rope_type": "yarn", "mscale_all_dim": model.yarn_mscale_all_dim or 0.0}


def layer_spec(spec: RunSpec, config: TransformerConfig):
    backend = resolve_attention(spec.attention, spec.device, spec.layout.cp, spec.packed)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.model.qk_layernorm)
    if spec.model.moe_layer_freq is not None or spec.model.multi_latent_attention:
        return _mixed_block_spec(spec, config, backend)
    layer = get_gpt_layer_local_spec(num_experts=spec.model.num_moe_experts, moe_grouped_gemm=False,
                                     qk_layernorm=spec.model.qk_layernorm, normalization=spec.model.normalization)
    if backend == "torch":
        from megalign.stacks.megatron.cp_attention import ZigzagCPAttention

        layer.submodules.self_attention.submodules.core_attention = ZigzagCPAttention
    if not spec.layout.sp:
        return layer
    # The norms in the sequence-parallel region (the layers' and the final one) mark their weights for
    # finalize_model_grads' all-reduce over TP; the block is spelled out to reach the final norm.
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megalign.stacks.megatron.norm import SequenceParallelNorm

    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelNorm)


def _mixed_block_spec(spec: RunSpec, config: TransformerConfig, backend: str):
    """Dense and MoE layers in one model (moe_layer_freq), or MLA: megatron's own block spec, local modules.
    MLA's core attention is megalign's torch one on the CPU (cpu_patches.MLA_CORE_ATTENTION)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=spec.model.normalization)
    for layer in block.layer_specs:
        if backend == "torch":
            from megalign.stacks.megatron.cp_attention import ZigzagCPAttention

            layer.submodules.self_attention.submodules.core_attention = ZigzagCPAttention
        if spec.layout.sp:
            from megalign.stacks.megatron.norm import SequenceParallelNorm

            # MLA scatters its q and kv latents over the sequence too: their norms' weights see a part of it.
            attention = layer.submodules.self_attention.submodules
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
            for norm in ("q_layernorm", "kv_layernorm"):
                if hasattr(attention, norm):
                    setattr(attention, norm, SequenceParallelNorm)
    if spec.layout.sp:
        block.layer_norm = SequenceParallelNorm
    return block


def build_model(spec: RunSpec, config: TransformerConfig) -> GPTModel:
    vocab = spec.model.padded_vocab_size(spec.layout.tp)
    # On a GPU the parameters are made there (torch's default device): allocated in host memory first,
    # an 8B model's 32 GB of fp32 pages would be touched, then copied. What megatron computes on the CPU
    # on purpose (RoPE's inv_freq, device="cpu") stays there, as in a CPU run.
    on_device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else contextlib.nullcontext()
    with on_device:
        model = _gpt_model(spec, config, vocab)
    if spec.device == "cuda":
        model.cuda(torch.cuda.current_device())
    if vocab > spec.model.vocab_size and model.post_process:
        model.output_layer.register_forward_hook(mask_vocab_padding(spec.model.vocab_size))
    return model


def _gpt_model(spec: RunSpec, config: TransformerConfig, vocab: int) -> GPTModel:
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec(spec, config), vocab_size=vocab,
        max_sequence_length=spec.model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.model.tie_embeddings,
        # MLA makes its own rotary embedding (rope_type in its config); GPTModel's would be unused.
        position_embedding_type="rope" if spec.model.multi_latent_attention else spec.model.position_embedding,
        rotary_base=spec.model.rotary_base,
        rotary_percent=spec.model.rotary_percent,
        parallel_output=True,
    )


# Buffers that are part of the model's weights: DeepSeek-V3's and GLM-4.5's expert bias picks the experts.
# A loader that sets only parameters leaves it zero and routes otherwise, silently.
LOADED_BUFFERS = (".mlp.router.expert_bias",)


def load_weights(model: GPTModel, model_config: ModelConfig, weights: WeightSource, buffers: bool = True) -> None:
    """Set every parameter, and the LOADED_BUFFERS (unless `buffers` is False: a planted loader bug), from
    `weights(global_name, its ParamShard)`."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    loaded = [(local, buffer) for local, buffer in model.named_buffers() if buffers and local.endswith(LOADED_BUFFERS)]
    with torch.no_grad():
        for local, param in [*model.named_parameters(), *loaded]:
            name = global_name(model, local)
            if is_duplicate_embedding(name, param):
                name = "embedding.word_embeddings.weight"
            sharding = param_sharding(name, param, model_config.swiglu)
            tp_size = _tp_size(param)
            shape = list(param.shape)
            if sharding.tp_dim is not None:
                shape[sharding.tp_dim] *= tp_size
            param.copy_(weights(name, ParamShard(tuple(shape), sharding, tp_rank, tp_size, param.dtype, param.device)))


def _tp_size(param: torch.nn.Parameter) -> int:
    group = tp_group(param)
    return 1 if group is None else group.size()
