"""Model and run configuration: dataclasses read from YAML (model) and validated from the CLI's options
(RunSpec, from options.RunConfig).

The defaults of `ModelConfig` are the embedded tiny model, so that `megalign backward` runs on a
laptop with no file at hand; configs/tiny.yaml spells the same values out for copying.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Hashable
from typing import Literal, Optional

import yaml

from megalign.dump.layout import Layout  # noqa: F401 (the run's layout: RunSpec.layout; re-exported)
from megalign.errors import UserError, is_int, is_number, read_user_text
from megalign.options import (Attention, Batch, Dtype, GradSource, Launch, LossNorm, Mode, MoeDispatcher, Numerics,
                              Output, PackedSplit, Parallelism, Recompute)

# megatron parameters whose rows are the vocabulary: padded when TP does not divide vocab_size.
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


# The sizes a config file must give: the defaults are the tiny model's.
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping: PyYAML keeps the last value
    silently, so a config would run with a value other than the one its reader sees first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: merged keys may be overridden by the mapping's own, as YAML says
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader refuses it itself
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, in the terms megatron-core's TransformerConfig uses."""

    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    kv_channels: Optional[int] = None
    vocab_size: int = 128
    max_position_embeddings: int = 256
    position_embedding: Literal["rope", "yarn", "learned_absolute"] = "rope"
    rotary_base: float = 10000.0
    # YaRN (position_embedding yarn; under multi_latent_attention, MLA's own rope_type yarn): megatron's yarn_*
    # settings. A None mscale or mscale_all_dim makes the attention factor 0.1 ln(factor) + 1, else their ratio.
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: Optional[float] = None
    yarn_mscale_all_dim: Optional[float] = None
    yarn_correction_range_round_to_int: bool = True
    rotary_percent: float = 1.0  # the share of each head's channels RoPE rotates (GLM's partial_rotary_factor)
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = True  # a gated MLP: activation(gate) * (up + glu_linear_offset)
    activation: Literal["silu", "quick_gelu"] = "silu"  # quick_gelu: x * sigmoid(1.702 x) (GPT-OSS)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None  # gate clamped above, up on both sides (quick_gelu only)
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_embeddings: bool = False
    # learnable: a per-head logit in every attention softmax's denominator (GPT-OSS's sinks, softmax_offset).
    softmax_type: Literal["vanilla", "learnable"] = "vanilla"
    # Sliding-window attention: megatron's window_size [left, right] (how many keys before and after each
    # query it sees) on the layers window_attn_skip_freq marks 1 (0: full attention); None: all windowed.
    window_size: Optional[list[int]] = None
    window_attn_skip_freq: Optional[list[int]] = None
    init_method_std: float = 0.02
    # Mixture of experts (megatron-core's MoELayer in every layer) when num_moe_experts is set.
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # each expert's; default ffn_hidden_size
    moe_shared_expert_intermediate_size: Optional[int] = None  # a shared expert of this size, none by default
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k (Mixtral's order)
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "none"
    moe_aux_loss_coeff: float = 0.0
    # Per layer, 1 for an MoE layer and 0 for a dense one (DeepSeek-V3's first_k_dense_replace); None: all MoE.
    moe_layer_freq: Optional[list[int]] = None
    moe_router_num_groups: Optional[int] = None  # group-limited routing: experts in this many groups,
    moe_router_group_topk: Optional[int] = None  # of which each token may use this many
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3's and GLM-4.5's score-correction bias, a buffer
    moe_router_fp32: bool = False  # the router's matmul and scores in float32 whatever the run's dtype
    # Multi-latent attention (DeepSeek-V3): low-rank q and kv projections; qk_head_dim is the part without RoPE.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None

    @classmethod
    def from_yaml(cls, path: Path) -> "ModelConfig":
        text = read_user_text(path, "config")
        try:
            raw = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"config {path}{where}: not valid YAML ({problem})") from None
        if not isinstance(raw, dict):
            raise UserError(f"config {path} must be a mapping of keys to values")
        return cls.from_dict(raw, source=str(path), required=REQUIRED_KEYS)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config", required: tuple[str, ...] = ()) -> "ModelConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(map(str, raw)) - set(fields))
        if unknown:
            raise UserError(f"{source}: unknown config key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
        missing = [key for key in required if key not in raw]
        if missing:
            # The defaults are the tiny model's: a config that leaves out a size would silently run it.
            raise UserError(f"{source}: missing {', '.join(missing)} (required: {', '.join(required)})")
        if "num_attention_heads" in raw and "num_query_groups" not in raw:
            raw = {**raw, "num_query_groups": raw["num_attention_heads"]}  # multi-head attention, as HF's default
        config = cls(**raw)
        config.validate(source)
        return config

    def validate(self, source: str = "config") -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise UserError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.kv_channels is not None and (not is_int(self.kv_channels) or self.kv_channels <= 0):
            raise UserError(f"{source}: kv_channels must be a positive integer, got {self.kv_channels!r}")
        if not is_number(self.rotary_percent) or not 0 < self.rotary_percent <= 1:
            raise UserError(f"{source}: rotary_percent must be in (0, 1], got {self.rotary_percent!r}")
        for name in ("layernorm_epsilon", "rotary_base", "init_method_std"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise UserError(f"{source}: {name} must be a finite number > 0, got {value!r}")
        for name in ("swiglu", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{source}: {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.name, str) or not self.name:
            raise UserError(f"{source}: name must be a non-empty string, got {self.name!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise UserError(f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_query_groups={self.num_query_groups}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise UserError(f"{source}: hidden_size={self.hidden_size} is not a multiple of "
                            f"num_attention_heads={self.num_attention_heads}; set kv_channels")
        if self.position_embedding not in ("rope", "yarn", "learned_absolute"):
            raise UserError(f"{source}: position_embedding must be rope, yarn or learned_absolute")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise UserError(f"{source}: normalization must be RMSNorm or LayerNorm")
        self._validate_moe(source)
        self._validate_variants(source)

    def _validate_variants(self, source: str) -> None:
        """The activation, attention and RoPE variants (GPT-OSS's, YaRN)."""
        if self.activation not in ("silu", "quick_gelu"):
            raise UserError(f"{source}: activation must be silu or quick_gelu")
        if self.softmax_type not in ("vanilla", "learnable"):
            raise UserError(f"{source}: softmax_type must be vanilla or learnable")
        for name in ("glu_linear_offset", "yarn_rotary_scaling_factor", "yarn_beta_fast", "yarn_beta_slow"):
            if not is_number(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                raise UserError(f"{source}: {name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("activation_func_clamp_value", "yarn_mscale", "yarn_mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not math.isfinite(value) or value <= 0):
                raise UserError(f"{source}: {name} must be a finite number > 0, got {value!r}")
        if self.activation_func_clamp_value is not None and self.activation != "quick_gelu":
            # megatron clamps only in its quick_gelu GLU; silu would run unclamped
            raise UserError(f"{source}: activation_func_clamp_value needs activation quick_gelu")
        if not is_int(self.yarn_original_max_position_embeddings) or self.yarn_original_max_position_embeddings <= 0:
            raise UserError(f"{source}: yarn_original_max_position_embeddings must be a positive integer")
        if not isinstance(self.yarn_correction_range_round_to_int, bool):
            raise UserError(f"{source}: yarn_correction_range_round_to_int must be true or false")
        if self.window_size is not None and (
                not isinstance(self.window_size, list) or len(self.window_size) != 2
                or any(not is_int(v) or v < -1 for v in self.window_size)):
            raise UserError(f"{source}: window_size must be [left, right], whole numbers (-1: unbounded), "
                            f"got {self.window_size!r}")
        if self.window_attn_skip_freq is not None and (
                not isinstance(self.window_attn_skip_freq, list) or len(self.window_attn_skip_freq) != self.num_layers
                or any(v not in (0, 1) for v in self.window_attn_skip_freq)):
            raise UserError(f"{source}: window_attn_skip_freq must list 1 (windowed) or 0 (full) for each of the "
                            f"{self.num_layers} layers, got {self.window_attn_skip_freq!r}")

    def _validate_moe(self, source: str) -> None:
        if self.num_moe_experts is None:
            return
        for name in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "moe_router_num_groups", "moe_router_group_topk"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise UserError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.moe_router_topk > self.num_moe_experts:
            raise UserError(f"{source}: moe_router_topk={self.moe_router_topk} exceeds num_moe_experts="
                            f"{self.num_moe_experts}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise UserError(f"{source}: moe_router_score_function must be softmax or sigmoid")
        if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
            raise UserError(f"{source}: moe_router_load_balancing_type must be aux_loss, seq_aux_loss, "
                            "global_aux_loss or none")
        for name in ("moe_aux_loss_coeff", "moe_router_topk_scaling_factor"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not math.isfinite(value) or value < 0):
                raise UserError(f"{source}: {name} must be a finite number >= 0, got {value!r}")
        for name in ("moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_fp32"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{source}: {name} must be true or false")
        if self.moe_layer_freq is not None and (
                not isinstance(self.moe_layer_freq, list) or len(self.moe_layer_freq) != self.num_layers
                or any(v not in (0, 1) for v in self.moe_layer_freq)):
            raise UserError(f"{source}: moe_layer_freq must list 0 (dense) or 1 (MoE) for each of the "
                            f"{self.num_layers} layers, got {self.moe_layer_freq!r}")

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (self.moe_layer_freq is None or bool(self.moe_layer_freq[layer]))

    def padded_vocab_size(self, tp: int) -> int:
        """megatron splits the vocabulary evenly over TP ranks; a checkpoint's vocab need not divide."""
        return -(-self.vocab_size // tp) * tp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# A run's layout against its model and batch: here, beside the model, so that dump/layout.py (which
# readers use without any model) knows nothing of ModelConfig.
def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention(attention: str, device: str, cp: int, packed: bool) -> str:
    """--attention auto resolved: TE on CUDA when installed, megatron's local attention at CP=1 (unpacked),
    else megalign's torch attention; any other value as it is."""
    if attention != "auto":
        return attention
    if device == "cuda" and has_transformer_engine():
        return "te"
    return "local" if cp == 1 and not packed else "torch"


def check_layout(layout: Layout, model: ModelConfig, seq_len: int, sequences: int) -> None:
    """Raise UserError for a layout the model or the batch cannot be split into."""
    layout.check_sizes()
    if layout.sp and layout.tp == 1:
        raise UserError("--sp splits the sequence over the TP ranks: it needs --tp > 1")
    if model.multi_latent_attention and layout.tp > 1:
        # Measured on a tiny DeepSeek-V3 at TP=2 (+SP): the gradient of kv_down_proj's rope rows 21-25% short.
        raise UserError(f"--tp {layout.tp} with multi-latent attention: megatron-core's MLA gathers "
                        "linear_kv_down_proj's output over TP, whose backward keeps each rank's slice and drops the "
                        "other ranks' heads' share of the rope key's gradient; use --cp or --ep")
    _check_experts(layout, model)
    layout.check_sequences(sequences)
    if model.num_attention_heads % layout.tp or model.num_query_groups % layout.tp:
        raise UserError(f"--tp {layout.tp} does not divide num_attention_heads={model.num_attention_heads} "
                        f"and num_query_groups={model.num_query_groups}")
    if model.ffn_hidden_size % layout.tp:
        raise UserError(f"--tp {layout.tp} does not divide ffn_hidden_size={model.ffn_hidden_size}")
    if model.num_layers % layout.pp:
        raise UserError(f"--pp {layout.pp} does not divide num_layers={model.num_layers}")
    _check_seq_len(layout, model, seq_len)


def _check_experts(layout: Layout, model: ModelConfig) -> None:
    if model.is_moe and layout.tp > 1 and not layout.sp:
        raise UserError("an MoE model with --tp > 1 needs --sp (megatron-core refuses MoE with tensor "
                        "parallelism and without sequence parallelism in training)")
    if model.is_moe and model.add_bias_linear and layout.expert_tp > 1:
        raise UserError(f"--etp {layout.expert_tp} (the default is --tp) with biased experts (add_bias_linear): "
                        "megatron-core supports expert biases at expert tensor parallelism 1 only; pass --etp 1")
    if (layout.ep, layout.expert_tp) == (1, layout.tp):
        return
    if not model.is_moe:
        raise UserError(f"--ep/--etp split experts, and the model {model.name!r} has none (set num_moe_experts)")
    if model.num_moe_experts % layout.ep:
        raise UserError(f"--ep {layout.ep} does not divide num_moe_experts={model.num_moe_experts}")
    if layout.expert_tp not in (1, layout.tp):
        raise UserError(f"--etp {layout.expert_tp}: megalign runs expert tensor parallelism of 1 or --tp ({layout.tp})")
    if (layout.tp * layout.cp * layout.dp) % (layout.ep * layout.expert_tp):
        raise UserError(f"--ep {layout.ep} x --etp {layout.expert_tp} ranks must divide tp*cp*dp="
                        f"{layout.tp * layout.cp * layout.dp} (experts are split over those ranks); "
                        f"pass --dp {layout.expert_dp()}")


def _check_seq_len(layout: Layout, model: ModelConfig, seq_len: int) -> None:
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        raise UserError(f"sequence length {seq_len} is not divisible by 2*cp={2 * layout.cp} "
                        f"(CP's load-balanced layout); pass --seq-len with a multiple of {2 * layout.cp}")
    if layout.sp and seq_len % (layout.cp * layout.tp):
        raise UserError(f"sequence length {seq_len} is not divisible by cp*tp={layout.cp * layout.tp} (sequence "
                        f"parallelism splits each CP rank's tokens over the TP ranks); pass --seq-len")
    if seq_len > model.max_position_embeddings:
        raise UserError(f"sequence length {seq_len} exceeds max_position_embeddings="
                        f"{model.max_position_embeddings}")


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs, written to JSON by the launcher and read by every rank: a RunConfig
    (options.py) validated by run/plan.py. A field named as an option holds that option's value, with
    its type and default, and means what its --help says; the rest are resolved from the options."""

    mode: Mode
    out: str
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: Layout = field(default_factory=Layout)
    tokens: list = field(default_factory=list)  # list of token-id lists, one per sequence
    # --rollout: per sequence, per position, 1 where the next token is a response token the loss counts;
    # None: every position with a next token counts
    label_mask: Optional[list] = None
    seq_len: int = 0
    device: Literal["cpu", "cuda"] = "cpu"  # --device, resolved
    dtype: Dtype = Numerics.dtype
    seed: int = Numerics.seed
    attention: Attention = Numerics.attention
    loss_norm: LossNorm = Numerics.loss_norm
    grad_source: GradSource = Numerics.grad_source
    recompute: Recompute = Numerics.recompute
    filter: Optional[str] = Output.filter
    stats_only: bool = Output.stats_only
    dump_only: Optional[str] = Output.dump_only
    timeout_s: float = Launch.timeout_s
    distributed_optimizer: bool = Parallelism.distributed_optimizer
    hf: Optional[str] = None  # --hf: a Hugging Face checkpoint folder to load instead of seeded weights
    load: Optional[str] = None  # --load: a Megatron distributed checkpoint's folder (an iteration's), weights from it
    save: Optional[str] = None  # --save: the folder to write this run's weights to as one (the launcher's staging)
    packed: bool = Batch.packed
    packed_split: PackedSplit = Batch.packed_split
    moe_dispatcher: MoeDispatcher = Parallelism.moe_dispatcher
    routing_replay: Optional[str] = None  # --routing replay: a safetensors file of recorded expert choices to force

    @property
    def cp_split(self) -> str:
        """How each row is cut for CP (dump.layout.CP_SPLITS): a padded row is one document."""
        return self.packed_split if self.packed else "document"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        raw = json.loads(text)
        raw["model"] = ModelConfig(**raw["model"])
        raw["layout"] = Layout(**raw["layout"])
        return cls(**raw)
