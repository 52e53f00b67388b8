"""An MoE layer's routing decisions as records of kind routing: per megatron-core router, the experts
chosen for each token and their weights and, where asked (megalign's megatron worker), the router
logits. The router's own outputs are [tokens, experts] with no sequence layout
(megatron_outputs.without_layout); these are laid out as the tokens, [s, b, ...]. The one tracer,
for the worker and `Dumper.watch` alike: duck-typed, it imports megatron-core only to read a
router's replay, which only a program that imported megatron-core sets.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megalign.capture.adapter import Sink
from megalign.capture.hooks import Hooks
from megalign.capture.megatron_outputs import LocalShape, is_router, routing_choices
from megalign.dump.format import Kind


def _replayed(router: torch.nn.Module) -> Optional[torch.Tensor]:
    """The expert ids megatron's router replay forced on this router, if any."""
    replay = getattr(router, "router_replay", None)
    if replay is None:
        return None
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return replay.target_topk_idx if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD else None


def expert_bias_update(model: torch.nn.Module) -> Optional[float]:
    """The rate at which megatron-core's finalize_model_grads moves the routers' expert_bias after every step
    (moe_router_bias_update_rate), where a router of `model` has one and the rate is not 0; else None. A stack
    that keeps the bias (transformers never moves e_score_correction_bias) routes otherwise from the next step."""
    rates = {float(getattr(router.config, "moe_router_bias_update_rate", 0.0)) for router in model.modules()
             if is_router(router) and getattr(router, "enable_expert_bias", False)}
    return max(rates, default=0.0) or None


def router_tracer(hooks: Hooks, sink: Sink, local: Callable[[], LocalShape],
                  logits: bool) -> Callable[[torch.nn.Module, str], bool]:
    """`trace(module, name)` hooks a router (True) or leaves any other module (False): per MoE layer,
    the experts chosen for each token with their weights, [s, b, topk], highest weight first, and,
    with `logits`, the router logits [s, b, experts] (what its gating returns: wrapped, since no hook
    reaches it; hooks.remove() gives the router its own gating back)."""
    def record(key: str, module: str, tensor: torch.Tensor) -> None:
        if sink.live() and sink.wants(Kind.ROUTING, key):
            sink.add(Kind.ROUTING, key, tensor.detach(), local().seq_sharding(tensor, 0, 1), module=module)

    def trace(router: torch.nn.Module, name: str) -> bool:
        if not is_router(router):
            return False
        if logits:
            def traced(gating):
                def gate(hidden):
                    values = gating(hidden)
                    record(f"{name}.logits", name, values)
                    return values

                return gate

            hooks.around(router, "gating", traced)

        def choices(module, inputs, output):
            if not sink.live():
                return
            for what, tensor in routing_choices(module, inputs, output, _replayed(module)).items():
                record(f"{name}.{what}", name, tensor)

        hooks.after_call(router, choices)
        return True

    return trace
