"""transformers' models as megalign's HF worker captures them (stacks/hf/worker.py), in megatron's
names and layout, behind capture/adapter.py's Adapter (TransformersAdapter): what a module's output
is laid out as, which modules of transformers 5's MoE block are the router and the experts, and the
router's decisions as megatron's routing records. The map of the remaining module and parameter
names to megatron's, family by family, is the stack's (stacks/hf/namemap.py: the same map loads the
checkpoint's weights), handed to the adapter as a MegatronNames.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Protocol

import torch

from megalign.capture.adapter import Sink
from megalign.capture.hooks import Hooks
from megalign.capture.torch_adapter import TorchParams
from megalign.dump.format import Kind
from megalign.dump.sharding import Sharding

SEQ_FIRST = Sharding(seq_dim=0, dp_dim=1)  # megatron's layout of module outputs
BATCH_FIRST = Sharding(seq_dim=1, dp_dim=0)  # transformers' outputs, inputs, logits, logprobs

# transformers 5's MoE block, in memory in every family: `mlp.gate` (the router; GPT-OSS's `mlp.router`)
# and `mlp.experts`.
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|router)$")
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts(\.|$)")


def router_layer(name: str) -> Optional[int]:
    """The layer of the MoE router module `name`; None where it is none."""
    match = _ROUTER.match(name)
    return int(match.group(1)) if match else None


def is_experts(name: str) -> bool:
    """The experts, fused in one module: their tokens are permuted, as in megatron's (not dumped)."""
    return bool(_EXPERTS.match(name))


def megatron_router(layer: int) -> str:
    return f"decoder.layers.{layer}.mlp.router"


def routing_records(layer: int, output: tuple, seq_len: int) -> dict[str, torch.Tensor]:
    """A router's (logits, weights, experts) over [b*s] tokens as megatron's routing records, by
    name: [s, b, ...], laid out as SEQ_FIRST. The experts highest weight first, as megatron's records:
    DeepSeek-V3's and GLM-4.5's routers pick them with topk(sorted=False)."""
    logits, weights, experts = output
    weights, order = weights.sort(dim=-1, descending=True, stable=True)
    experts = experts.gather(-1, order)
    return {f"{megatron_router(layer)}.{what}": tensor.detach().view(-1, seq_len, tensor.shape[-1]).transpose(0, 1)
            for what, tensor in (("logits", logits), ("experts", experts), ("weights", weights))}


def output_sharding(tensor: torch.Tensor, seq_len: int) -> Sharding:
    """A transformers module's output with no megatron counterpart, as it is: batch-first, its
    sequence dim where it has the batch's tokens."""
    seq_dim = 1 if tensor.ndim > 1 and tensor.shape[1] == seq_len else None
    return Sharding(seq_dim=seq_dim, dp_dim=0 if seq_dim is not None else None)


class MegatronNames(Protocol):
    """The stack's map of a model's HF modules to megatron's (stacks/hf/namemap.py's NameMap). A rule
    has `megatron` (its module's name), `hf` (the HF modules it is joined from, in order) and
    `written_as` (the name its output is written under; None: written some other way) and `bias_apart`
    (the submodule whose bias megatron returns apart; None: none). `model` is the megatron model's
    config (its `add_bias_linear`)."""

    def rule_for_hf_module(self, hf_module: str, on: str = "output"):
        """The rule that writes `hf_module`'s output (or, on="input", its first input); None: none does."""

    def join(self, rule, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The HF parts as megatron's tensor, joined on `dim`."""


class TransformersAdapter(TorchParams):
    """A transformers model as the HF worker writes it: every module's output, one with a megatron
    counterpart written once all of its parts are in (q, k and v for linear_qkv), joined and made
    sequence-first, under the megatron name; the rest as they are, under their HF names. Its
    parameters are a torch model's (TorchParams): the worker joins their gradients itself."""

    def __init__(self, model: torch.nn.Module, names: MegatronNames, seq_len: int, moe: bool):
        self.model, self.names, self.seq_len, self.moe = model, names, seq_len, moe
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        # Outputs that come while a join waits for its parts (Qwen3's q_norm runs before k_proj) are
        # written after it, in megatron's order: the fused linear_qkv runs before the q/k norms.
        self._deferred: list[tuple] = []

    def hook(self, hooks: Hooks, sink: Sink, named: Callable[[str], str], seq_dim: Optional[int]) -> None:
        if seq_dim is not None:
            raise ValueError("seq_dim names the token dim of a model whose layout is not known; a transformers "
                             "model's is known")
        for path, module in self.model.named_modules():
            layer = router_layer(path) if self.moe else None
            if layer is not None:
                hooks.after_call(module, self._routing_hook(sink, layer))
                continue
            if self.moe and is_experts(path):
                continue
            rule = self.names.rule_for_hf_module(path)
            if not path or (rule is not None and rule.written_as is None):
                continue  # the root's output is the loss; lm_head's are the logits, written from the output
            hooks.on_outputs(module, named(path), self._output_hook(sink, path, rule))
            takes = self.names.rule_for_hf_module(path, on="input")
            if takes is not None:
                hooks.on_input(module, named(path), self._input_hook(sink, path, takes))

    def _output_hook(self, sink: Sink, path: str, rule) -> Callable:
        def record(module, key, tensor, index):
            if rule is not None and index == 0:
                bias = self._bias_apart(module, rule)
                self._part(sink, rule, path, tensor if bias is None else tensor - bias)
                if bias is not None:  # megatron returns linear_proj's bias apart, as its output #1
                    self._write(sink, f"{rule.megatron}#1", bias.detach(), Sharding(), rule.megatron)
            else:
                self._write(sink, key, tensor, output_sharding(tensor, self.seq_len), key.split("#")[0])

        return record

    def _bias_apart(self, module: torch.nn.Module, rule) -> Optional[torch.Tensor]:
        if rule.bias_apart is None or not self.names.model.add_bias_linear:
            return None
        return module.get_submodule(rule.bias_apart).bias

    def _input_hook(self, sink: Sink, path: str, rule) -> Callable:
        def record(module, key, tensor):
            self._part(sink, rule, path, tensor)

        return record

    def _routing_hook(self, sink: Sink, layer: int) -> Callable:
        """The router's (logits, weights, experts) over [b*s] tokens, written as megatron's routing records."""
        def record(module, inputs, output):
            for key, tokens in routing_records(layer, output, self.seq_len).items():
                self._write(sink, key, tokens, SEQ_FIRST, megatron_router(layer), kind=Kind.ROUTING)

        return record

    def _part(self, sink: Sink, rule, path: str, tensor: torch.Tensor) -> None:
        parts = self._pending.setdefault(rule.megatron, {})
        if tensor.ndim == 4 and tensor.shape[1] == 1:
            tensor = tensor.squeeze(1)  # MLA's kv latent, viewed as one head [b, 1, s, r]: kv_b_proj's output too
        parts[path] = tensor.detach().transpose(0, 1)  # HF's [b, s, ...] -> megatron's [s, b, ...]
        if len(parts) < len(rule.hf):
            return
        del self._pending[rule.megatron]
        value = self.names.join(rule, [parts[hf] for hf in rule.hf], dim=-1)
        self._write(sink, rule.written_as, value, SEQ_FIRST, rule.megatron, joined=True)

    def _write(self, sink: Sink, key: str, tensor: torch.Tensor, sharding: Sharding, module: str,
               joined: bool = False, kind: Kind = Kind.ACTIVATION) -> None:
        # Everything deferred came after the join's first part: the join goes first.
        self._deferred.insert(0 if joined else len(self._deferred), (kind, key, tensor, sharding, module))
        if self._pending:
            return
        for kind, key, tensor, sharding, module in self._deferred:
            sink.add(kind, key, tensor, sharding, module=module)
        self._deferred = []
