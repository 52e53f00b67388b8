"""An MoE layer's routing decisions as records of kind routing: per megatron-core TopKRouter, the
router logits, the experts chosen for each token and their weights. The router's own outputs are
[tokens, experts] with no sequence layout (megatron_outputs.without_layout); these are laid out as
the tokens, [s, b, ...]. Imports megatron-core: megalign's megatron worker's, never the Dumper's.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megalign.capture.dumper import Dumper
from megalign.capture.hooks import Hooks
from megalign.capture.megatron_outputs import LocalShape, routing_choices


def _replayed(router: TopKRouter) -> Optional[torch.Tensor]:
    """The expert ids megatron's router replay forced on this router, if any."""
    replay = getattr(router, "router_replay", None)
    if replay is None or replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
        return None
    return replay.target_topk_idx


class RouterTrace:
    """`trace(module, name)` hooks a TopKRouter (True) or leaves any other module (False); `remove()`
    gives the routers back their own gating (the hooks come off with `hooks`)."""

    def __init__(self, hooks: Hooks, dumper: Dumper, local: LocalShape):
        self.hooks, self.dumper, self.local = hooks, dumper, local
        self.routers: list[TopKRouter] = []

    def trace(self, router: torch.nn.Module, name: str) -> bool:
        """Per MoE layer: the router logits [s, b, experts] (what megatron's gating returns), and the
        experts chosen for each token with their weights, [s, b, topk], highest weight first."""
        if not isinstance(router, TopKRouter):
            return False
        gating = router.gating

        def traced_gating(hidden):
            logits = gating(hidden)
            self._record(f"{name}.logits", name, logits)
            return logits

        def record(module, inputs, output):
            for what, tensor in routing_choices(module, inputs, output, _replayed(module)).items():
                self._record(f"{name}.{what}", name, tensor)

        router.gating = traced_gating  # an instance attribute, taken off again by remove()
        self.routers.append(router)
        self.hooks.after_call(router, record)
        return True

    def _record(self, key: str, module: str, tensor: torch.Tensor) -> None:
        if self.dumper.wants("routing", key):
            self.dumper.add("routing", key, tensor.detach(), self.local.seq_sharding(tensor, 0, 1), module=module)

    def remove(self) -> None:
        for router in self.routers:
            del router.gating
