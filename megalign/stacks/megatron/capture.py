"""Forward hooks that dump every module's output and its gradient, through megalign.Dumper's
`add_output` with the sharding that capture/megatron_outputs.py infers (the same rules, and the same
recording, as `Dumper.watch` on a user's megatron-core model). What only megalign's runs add: global
names under PP and EP, the logits as their own kind, and the MoE routers' decisions (kind routing).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megalign.capture.dumper import Dumper
from megalign.capture.megatron_names import another_stage_dumps, global_name
from megalign.capture.megatron_outputs import INPUT_CAPTURED, LocalShape, View, input_sharding, output_sharding, \
    without_layout
from megalign.dump.sharding import Sharding
from megalign.spec import ModelConfig
from megalign.stacks.megatron.model import logits_layout

LOGITS_MODULE = "output_layer"  # its first output is the logits, [s, b, vocab/tp]


def _replayed(router: TopKRouter) -> Optional[torch.Tensor]:
    """The expert ids megatron's router replay forced on this router, if any."""
    replay = getattr(router, "router_replay", None)
    if replay is None or replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
        return None
    return replay.target_topk_idx


class ActivationCapture:
    """Registers hooks on every submodule of `model`; `remove()` takes them off again."""

    def __init__(self, model: torch.nn.Module, dumper: Dumper, model_config: ModelConfig, local: LocalShape,
                 grads: bool):
        self.dumper, self.model_config, self.local, self.grads = dumper, model_config, local, grads
        self.handles, self.routers = [], []
        for local, module in model.named_modules():
            if not local:
                continue  # the root's output is the loss (dumped by the loss function)
            if another_stage_dumps(local):
                continue
            name = global_name(model, local)
            if isinstance(module, TopKRouter):
                self._trace_router(module, name)
                continue
            if without_layout(name, module):
                continue
            self.handles.append(module.register_forward_hook(self._hook(name)))
            if local.endswith(INPUT_CAPTURED):
                self.handles.append(module.register_forward_pre_hook(self._input_hook(name)))

    def _hook(self, name: str):
        def record(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for index, tensor in enumerate(outputs):
                if not isinstance(tensor, torch.Tensor):
                    continue
                kind, key = "activation", name if index == 0 else f"{name}#{index}"
                sharding, view = output_sharding(module, name, tensor, self.local)
                if key == LOGITS_MODULE:
                    # Logits are dumped batch-first, [b, s, vocab], the way every stack can write them.
                    kind, key = "logits", "logits"
                    sharding, view = logits_layout(self.model_config, sharding)
                self._record(kind, key, name, tensor, sharding, view)

        return record

    def _trace_router(self, router: TopKRouter, name: str) -> None:
        """Per MoE layer: the router logits [s, b, experts] (what megatron's gating returns), and the
        experts chosen for each token with their weights, [s, b, topk], highest weight first."""
        gating = router.gating

        def traced_gating(hidden):
            logits = gating(hidden)
            self._record_routing(f"{name}.logits", name, logits)
            return logits

        def record(module, inputs, output):
            probs, chosen = output  # [tokens, experts], tokens in [s, b] order; zero where not chosen
            tokens = inputs[0].shape[:2]
            forced = _replayed(module)
            if forced is not None:  # replayed choices in their recorded order: bf16 weights may tie
                experts = forced.to(probs.device)
                weights = probs.detach().gather(1, experts)
            else:
                weights, experts = probs.detach().masked_fill(~chosen, float("-inf")).topk(module.topk, dim=-1)
            self._record_routing(f"{name}.experts", name, experts.view(*tokens, -1))
            self._record_routing(f"{name}.weights", name, weights.view(*tokens, -1))

        router.gating = traced_gating  # an instance attribute, taken off again by remove()
        self.routers.append(router)
        self.handles.append(router.register_forward_hook(record))

    def _record_routing(self, key: str, module: str, tensor: torch.Tensor) -> None:
        if self.dumper.wants("routing", key):
            self.dumper.add("routing", key, tensor.detach(), self.local.seq_sharding(tensor, 0, 1), module=module)

    def _input_hook(self, name: str):
        """The down projection's input: SwiGLU's output, a bare function with no module of its own."""
        def record(module, inputs):
            self._record("activation", f"{name}#input", name, inputs[0], input_sharding(inputs[0], self.local))

        return record

    def _record(self, kind: str, key: str, name: str, tensor: torch.Tensor, sharding: Sharding,
                view: View = None) -> None:
        self.dumper.add_output(kind, key, tensor, sharding, view=view, module=name, grad=self.grads)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for router in self.routers:
            del router.gating
