"""Why a tensor is on one side only: the reason printed in its row.

Stacks and attention kernels expose different submodules; REASONS (the op map between HF and
megatron-core and their attention kernels) are the ones megalign knows, and a tensor they name may
be on one side only. Any other tensor on one side only fails the comparison (judge.py), unless
--allow-missing names it; a whole kind missing on the other side is said in its note.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megalign.compare.entries import Source
from megalign.dump.format import Kind

# (pattern, what must differ between the two sides for it to be one-sided, reason). "stack": only a
# dump of another stack lacks it; "kernel": another stack, or another attention kernel, lacks it;
# "server": a megalign run has it, an sglang server's dump (compared with one) does not.
# Between two dumps of one stack and kernel, every tensor is on both sides, or the comparison fails.
REASONS: tuple[tuple[re.Pattern, str, str], ...] = tuple((re.compile(pattern), scope, reason)
                                                         for pattern, scope, reason in (
    (r"core_attention\.(scale_mask_softmax|attention_dropout)$", "kernel",
     "inside megatron's local attention; other attention kernels do not expose it"),
    (r"self_attn#1$", "stack", "HF's attention probabilities; megatron's local attention has them inside core_attention"),
    # MLA's attention holds its own (self_attention.rotary_pos_emb).
    (r"((^|\.)rotary_pos_emb|rotary_emb(#\d+)?)$", "stack", "the RoPE table: each stack lays it out its own way"),
    (r"^embedding\.embedding_dropout$", "stack", "megatron's embedding dropout (off); its output is the `embedding` row"),
    (r"^embedding\.word_embeddings$", "stack",
     "megatron's batch-first lookup; the `embedding` row holds the same values"),
    (r"^decoder$", "stack", "megatron's decoder block: its output is the `decoder.final_layernorm` row"),
    (r"mlp(\.shared_experts)?\.act_fn$", "stack", "SiLU(gate) alone, fused into SwiGLU by megatron; SwiGLU's output is linear_fc2#input"),
    (r"^model\.layers\.\d+\.mlp#1$", "stack", "GPT-OSS's MoE block also returns its routing weights: the router's "
     "`weights` row"),
    (r"^(labels|loss_mask|logprobs|loss)$", "server", "a training run's: an sglang server computes no loss"),
    (r"^logits$", "server", "an sglang server's dump without its logits processor's next-token logits"),
    (r"self_attention\.linear_qkv$", "server",
     "sglang's fused qkv_proj lays q|k|v out apart, where megatron groups them by query group"),
    (r"self_attention\.[qk]_layernorm$", "server",
     "sglang's per-head q_norm and k_norm (GLM-4.5, Qwen3) run in place in a fused kernel, or over rows of one head"),
    (r"self_attention\.linear_kv_up_proj$", "server",
     "sglang's absorbed MLA passes run no kv_b_proj (its w_kc and w_vc are multiplied in), so not every token has it"),
    (r"mlp\.router\.weights$", "server",
     "sglang's top-k weights hold routed_scaling_factor or not, as its MoE backend chooses: the expert ids are compared"),
    (r"^decoder\.layers\.\d+$", "server",
     "sglang 0.5.23's decoder layer returns its FFN's contribution alone, the residual sum carried to the next norm"),
))


@dataclass(frozen=True)
class OtherSide:
    """The other source, as a one-sided tensor's note reads it: the kinds it holds, its stack, and
    what differs between it and this tensor's source."""

    kinds: set  # the kinds the other side holds at all (None: a plain tensor file, which does not say)
    stack: Optional[str]
    differ: frozenset  # "stack" and/or "kernel": what differs between the sides (unknown counts as differing)

    @classmethod
    def of(cls, this: Source, other: Source) -> "OtherSide":
        stacks_differ = this.stack is None or this.stack != other.stack
        kernels_differ = stacks_differ or this.kernel is None or this.kernel != other.kernel
        server = "sglang-server" in (this.format, other.format)
        return cls(kinds={e.kind for e in other.entries}, stack=other.stack,
                   differ=frozenset({"stack"} if stacks_differ else set()) | ({"kernel"} if kernels_differ else set())
                   | ({"server"} if server else set()))


def reason(kind: Optional[str], name: str, other: OtherSide) -> Optional[str]:
    """The note of a tensor on one side only."""
    expected = op_map(kind, name, other)
    if expected is None and kind is not None and None not in other.kinds and kind not in other.kinds:
        return f"the other side has no {kind} tensors at all"
    return expected


def op_map(kind: Optional[str], name: str, other: OtherSide) -> Optional[str]:
    """Why the op map expects this tensor on one side only, if it does."""
    if kind == Kind.ACTIVATION_GRAD and other.stack == "hf" and Kind.ACTIVATION_GRAD not in other.kinds:
        return "the other side's stack dumps no activation gradients (transformers)"
    if kind in (Kind.ACTIVATION_GRAD, Kind.PARAM_GRAD) and "server" in other.differ:
        return "an sglang server computes no gradients"
    for pattern, scope, text in REASONS:
        if scope in other.differ and pattern.search(name):
            return text
    return None
