"""One name map between the stacks, used for weights (HF -> megatron), gradients and activations.

HF keeps q/k/v and gate/up as separate linears; megatron fuses them. Joining the HF parts the way
megatron lays out its fused tensor is the same operation for a weight (rows, dim 0), its gradient
(dim 0) and the module output (last dim), so there is one `join` for all three.
"""

from __future__ import annotations

from typing import Optional

import torch

from megalign.spec import ModelConfig
from megalign.stacks.hf.families import Family, Rule

OUTPUT_LAYER = "output_layer"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """megatron's linear_qkv layout on `dim`: per query group, its query heads, then its key, then its value.

    HF's GQA gives query head j the key/value head j // (heads / groups), so the heads of a group are
    contiguous in q_proj, and [ng, (np/ng + 2) * head_dim] flattened is megatron's order.
    """
    parts = [t.movedim(dim, 0) for t in (q, k, v)]
    rest = parts[0].shape[1:]
    grouped = torch.cat([t.reshape(groups, -1, *rest) for t in parts], dim=1)
    return grouped.reshape(-1, *rest).movedim(0, dim)


class NameMap:
    """A family's rules expanded over the layers of one model."""

    def __init__(self, family: Family, model: ModelConfig, row_orders: Optional[dict[str, torch.Tensor]] = None):
        self.model = model
        self.row_orders = row_orders or {}  # Family.row_orders
        # Layer by layer, in the table's order: the order of megatron's parameters and module outputs.
        self.rules: list[Rule] = []
        block: list[Rule] = []
        for rule in family.rules_of(model) + (None,):
            if rule is not None and rule.when is not None and not getattr(model, rule.when):
                continue
            if rule is not None and rule.per_layer:
                block.append(rule)
                continue
            experts = range(model.num_moe_experts or 1)
            self.rules += [r.expand(i, e) for i in range(model.num_layers) for r in block
                           if r.layers == "all" or (r.layers == "moe") == model.is_moe_layer(i)
                           for e in (experts if r.per_expert else (0,))]
            block = []
            if rule is not None:
                self.rules.append(rule)
        self._by_hf_module = {(hf, rule.on): rule for rule in self.rules for hf in rule.hf}

    def rule_for_hf_module(self, hf_module: str, on: str = "output") -> Optional[Rule]:
        """The rule that writes `hf_module`'s output (or, on="input", its first input)."""
        return self._by_hf_module.get((hf_module, on))

    def join(self, rule: Rule, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The HF parts as megatron's tensor; a weight's rows, its gradient's and its output's last dim alike."""
        order = self.row_orders.get(rule.megatron.rsplit(".", 1)[-1])
        joined = self._join(rule, parts, dim)
        return joined if order is None else joined.index_select(dim, order.to(joined.device))

    def _join(self, rule: Rule, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        if rule.join == "qkv":
            return fuse_qkv(*parts, groups=self.model.num_query_groups, dim=dim)
        if rule.join == "cat":
            return torch.cat(parts, dim=dim)
        (only,) = parts
        return only

    def buffers(self) -> dict[str, str]:
        """Every megatron buffer loaded with the weights -> the HF tensor it is read from."""
        return {f"{rule.megatron}.{ours}": f"{hf}.{theirs}" for rule in self.rules
                for ours, theirs in rule.buffers for hf in rule.hf}

    def params(self) -> dict[str, tuple[Rule, tuple[str, ...]]]:
        """Every megatron parameter of the model -> (its rule, the HF tensors it is joined from)."""
        out = {}
        for rule in self.rules:
            # Tied embeddings: megatron's output layer reuses the word embeddings, as HF's lm_head does.
            if not rule.params or (rule.megatron == OUTPUT_LAYER and self.model.tie_embeddings):
                continue
            for ours, theirs in rule.tensors or self._weights(rule):
                out[f"{rule.megatron}.{ours}"] = (rule, tuple(f"{hf}.{theirs}" for hf in rule.hf))
        return out

    def _weights(self, rule: Rule) -> tuple[tuple[str, str], ...]:
        """A module's weight, and its bias where megatron gives it one: every linear and the router under
        add_bias_linear (not the output layer), q/k/v under add_qkv_bias."""
        last = rule.megatron.rsplit(".", 1)[-1]
        biased = (rule.join == "qkv" and self.model.add_qkv_bias) or \
            (self.model.add_bias_linear and (last.startswith("linear_") or last == "router"))
        return (("weight", "weight"), ("bias", "bias")) if biased else (("weight", "weight"),)
