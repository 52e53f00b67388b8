"""Routing replay: a run of an MoE model forced to the expert choices another run recorded.

The recorded choices come in this run's batch layout ([seq, rows, topk], as the router sees its
input; run/replay.py) and are cut to this rank's tokens: its DP rows, its CP chunks (per
document in a packed row), its SP piece. The expert ids
go to megatron's own router replay (moe_enable_routing_replay, REPLAY_FORWARD); the weights are
forced too, with the router's probabilities still carrying the gradient (replaying ids alone leaves
most of a mismatch in the weights).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from safetensors.torch import load_file

from megalign.dump.format import RankCoords
from megalign.capture.megatron_names import global_name
from megalign.dump.layout import BatchRow, rank_tokens
from megalign.spec import RunSpec


def replay_routing(model: torch.nn.Module, spec: RunSpec, rows: list[BatchRow], coords: RankCoords) -> list:
    """Force every router of `model` to the recorded choices; returns the hook handles."""
    recorded = load_file(spec.routing_replay)
    handles = []
    for local, router in model.named_modules():
        if not isinstance(router, TopKRouter):
            continue
        name = global_name(model, local)
        experts = _local_tokens(recorded[f"{name}.experts"], spec, rows, coords)
        weights = _local_tokens(recorded[f"{name}.weights"], spec, rows, coords)
        router.router_replay.set_target_indices(experts)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        handles.append(router.register_forward_hook(_force_weights(experts, weights)))
    return handles


def _force_weights(experts: torch.Tensor, weights: torch.Tensor):
    def hook(module, inputs, output):
        probs, routing_map = output
        forced = torch.zeros_like(probs).scatter(1, experts.to(probs.device), weights.to(probs))
        return probs + (forced - probs).detach(), routing_map

    return hook


def _local_tokens(choices: torch.Tensor, spec: RunSpec, rows: list[BatchRow], coords: RankCoords) -> torch.Tensor:
    """[seq, rows, topk] -> this rank's router tokens, [local tokens, topk] in [s, b] order."""
    share, positions = rank_tokens(rows, spec.layout, spec.cp_split, coords.tp_rank, coords.cp_rank, coords.dp_rank,
                                   spec.layout.sp)
    return choices[positions][:, share].reshape(-1, choices.shape[-1]).contiguous()
