"""Why a tensor is on one side only: the reason printed in its row.

Stacks and attention kernels expose different submodules; REASONS (the op map between HF and
megatron-core and their attention kernels) are the ones megalign knows, and a tensor they name may
be on one side only. Any other tensor on one side only fails the comparison (verdict.py), unless
--allow-missing names it; a whole kind missing on the other side is said in its note.
"""

from __future__ import annotations

import re
from typing import Optional

REASONS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(pattern), reason) for pattern, reason in (
    (r"core_attention\.(scale_mask_softmax|attention_dropout)$",
     "inside megatron's local attention; other attention kernels do not expose it"),
    (r"self_attn#1$", "HF's attention probabilities; megatron's local attention has them inside core_attention"),
    (r"(^rotary_pos_emb|rotary_emb(#\d+)?)$", "the RoPE table: each stack lays it out its own way"),
    (r"^embedding\.embedding_dropout$", "megatron's embedding dropout (off); its output is the `embedding` row"),
    (r"^embedding\.word_embeddings$", "megatron's batch-first lookup; the `embedding` row holds the same values"),
    (r"^decoder$", "megatron's decoder block: its output is the `decoder.final_layernorm` row"),
    (r"mlp\.act_fn$", "SiLU(gate) alone, fused into SwiGLU by megatron; SwiGLU's output is linear_fc2#input"),
))


def reason(kind: Optional[str], name: str, other_kinds: set[Optional[str]]) -> Optional[str]:
    """The note of a tensor on one side only. `other_kinds`: the kinds the other side holds at all
    (None: a plain tensor file, which does not say)."""
    expected = op_map(kind, name, other_kinds)
    if expected is None and kind is not None and None not in other_kinds and kind not in other_kinds:
        return f"the other side has no {kind} tensors at all"
    return expected


def op_map(kind: Optional[str], name: str, other_kinds: set[Optional[str]]) -> Optional[str]:
    """Why the op map expects this tensor on one side only, if it does."""
    if kind == "activation_grad" and "activation_grad" not in other_kinds and "param_grad" in other_kinds:
        # A backward (it has parameter gradients) without activation gradients: transformers' stack,
        # which hooks no module's backward. A forward dump has neither: its missing gradients fail.
        return "the other side's stack dumps no activation gradients (transformers)"
    for pattern, text in REASONS:
        if pattern.search(name):
            return text
    return None
