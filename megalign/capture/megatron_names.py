"""What a megatron-core model's modules and parameters are named in a dump, on every PP stage and EP
rank: megalign's megatron worker (stacks/megatron) and `Dumper.watch` on a user's megatron-core model
name them by these rules alike.

Every PP stage counts its layers from 0 (`decoder.layers.0` is the first layer of each stage) and
every EP rank its experts (`local_experts.0`): the dump gives each its global index, so that the
stages' and ranks' names do not collide and match a run without PP or EP. Read from the model's
attributes and parallel_state where the program initialised it, so that the Dumper imports no megatron.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from megalign.capture.ddp_grads import megatron_state

_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=\.|$)")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)(?=\.|$)")
_GLOBAL_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")  # as global_name writes it


def global_name(model: torch.nn.Module, local_name: str) -> str:
    """`decoder.layers.<i>` counts from 0 on every PP stage, and `local_experts.<j>` from 0 on every
    EP rank: give both their global index (experts as `experts.<e>`). A layer's own number
    (`layer_number`, from 1) is global."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    layer = model.decoder.layers[int(match.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}" + local_name[match.end():]
    expert = _LOCAL_EXPERT.search(name)
    if expert:
        state = megatron_state()
        local_experts = model.config.num_moe_experts // state.get_expert_model_parallel_world_size()
        index = state.get_expert_model_parallel_rank() * local_experts + int(expert.group(1))
        name = f"{name[:expert.start()]}.mlp.experts.{index}{name[expert.end():]}"
    return name


def expert_of(name: str) -> Optional[tuple[int, int]]:
    """(layer, expert) of a decoder layer's expert parameter named by global_name; None for any other."""
    match = _GLOBAL_EXPERT.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_duplicate_embedding(name: str, param: torch.nn.Parameter) -> bool:
    """With tied embeddings under PP, the last stage holds a copy of the word embeddings: the first
    stage's is the one dumped."""
    state = megatron_state()
    return name == "output_layer.weight" and getattr(param, "shared_embedding", False) and \
        state is not None and not state.is_pipeline_first_stage()


def another_stage_dumps(path: str) -> bool:
    """An output that another PP stage dumps under the same name: the block's (`decoder`) on stages
    before the last is only its last layer's output (the final norm is the last stage's), and every
    stage computes the same rotary table (`rotary_pos_emb`), which the first one dumps."""
    state = megatron_state()
    if state is None:
        return False
    return (path == "decoder" and not state.is_pipeline_last_stage()) or \
        (path == "rotary_pos_emb" and not state.is_pipeline_first_stage())
