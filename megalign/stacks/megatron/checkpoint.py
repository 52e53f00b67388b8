"""--load and --save in a megatron worker: the model's weights from and to a Megatron distributed checkpoint
(torch_dist), through megatron-core's dist_checkpointing and the model's own sharded_state_dict(), so that
megatron-core itself reshards a checkpoint of any layout to this run's.

Nothing in a checkpoint is unpickled by the full unpickler: the folder may come from anyone. torch_dist's
load reaches pickle in four places (megatron-core 0.19.2, torch 2.13), and each is held back here:
- `.metadata`, torch DCP's index: FileSystemReader.read_metadata calls pickle.load. It is read by
  dist_checkpoint.load_index, which builds only DCP's own metadata dataclasses and enums, torch.Size,
  dtypes and layouts; anything else in it (a reduce to os.system) is refused with one line.
- the common state (Megatron-LM's args, iteration, ...: common.pt, or the `common_state` object, which
  DCP's DefaultLoadPlanner.load_bytes reads with torch.load(weights_only=False)): never read, megalign
  takes only the model's tensors from a checkpoint.
- ShardedObjects (a module's extra state): never asked for.
- any other torch.load on the way: held to weights_only=True.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pickle
import types
from pathlib import Path
from typing import Iterator

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.models.gpt import GPTModel

from megalign.errors import UserError
from megalign.spec import ModelConfig, RunSpec
from megalign.stacks.dist_checkpoint import load_index, write_model

# The pickle-reaching names replaced while a checkpoint is read ("module:attribute").
HELD_BACK = ("torch.distributed.checkpoint.filesystem:pickle",
             "megatron.core.dist_checkpointing.serialization:load_common_state_dict",
             "torch:load")
# GPTModel's modules: a checkpoint's other keys (Megatron-LM's optimizer state, ...) are not the model's.
_MODEL_ROOTS = ("embedding", "decoder", "output_layer")
_PADDING_ROWS = 128 * 64


def load_checkpoint(model: GPTModel, folder: Path, model_config: ModelConfig) -> None:
    """Set every parameter of this rank from the checkpoint in `folder`; a missing tensor, one of another
    shape or one this model has no place for is a UserError (all ranks find the same)."""
    with _held_back(folder):
        _check_tensors(model, folder, model_config, dist_checkpointing.load_tensors_metadata(str(folder)))
        tensors_only = {k: v for k, v in model.sharded_state_dict().items() if not isinstance(v, ShardedObject)}
        state = dist_checkpointing.load(tensors_only, str(folder))
    result = model.load_state_dict(state, strict=False)
    unset = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if unset or result.unexpected_keys:
        raise RuntimeError(f"checkpoint load left {unset[:3]} unset and {result.unexpected_keys[:3]} unused")


def save_checkpoint(model: GPTModel, folder: Path, spec: RunSpec) -> None:
    """Every rank writes its shards into `folder` (the launcher's staging folder); rank 0 adds megalign.json."""
    dist_checkpointing.save(model.sharded_state_dict(), str(folder))
    if torch.distributed.get_rank() == 0:
        weights = {"load": spec.load} if spec.load else {"hf": spec.hf} if spec.hf else {"seed": spec.seed}
        write_model(folder, spec.model, {**weights, "dtype": spec.dtype, "layout": spec.layout.describe()})


def _check_tensors(model: GPTModel, folder: Path, model_config: ModelConfig, stored: dict) -> None:
    """This rank's tensors against the checkpoint's index: of the same global shape (the vocabulary's rows may
    differ by padding, which megatron-core fills), present, and no model tensor in it that this model lacks."""
    name, vocab_size = model_config.name, model_config.vocab_size
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    wanted = {t.key: t for t in nested_values(sharded) if isinstance(t, ShardedTensor)}
    for key, tensor in wanted.items():
        if key not in stored:
            continue
        have, want = tuple(stored[key].global_shape), tuple(tensor.global_shape)
        if have != want and not (tensor.allow_shape_mismatch and _vocab_padding(have, want, vocab_size)):
            raise UserError(f"--load {folder}: {key} is {list(have)} in the checkpoint and {list(want)} in model "
                            f"{name!r}: another model's checkpoint")
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise UserError(f"--load {folder}: {len(missing)} tensor(s) of model {name!r} missing, e.g. {missing[0]}")
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, sorted(wanted))  # a stage builds only its part of the model
    alien = sorted(set(k for k in stored if k.split(".")[0] in _MODEL_ROOTS) - set().union(*everyone))
    if alien:
        raise UserError(f"--load {folder}: {len(alien)} tensor(s) model {name!r} has no place for, e.g. "
                        f"{alien[0]}: another model's checkpoint")


def _vocab_padding(have: tuple, want: tuple, vocab_size: int) -> bool:
    """The vocabulary's rows (the tensors megatron-core loads with allow_shape_mismatch) may differ by padding
    alone: megatron-core copies the rows both have and zeroes the model's others. The checkpoint's must cover
    the real vocabulary, with fewer padding rows than Megatron-LM adds (make_vocab_size_divisible_by 128 times
    TP, up to 64): more would be another tokenizer's vocabulary."""
    return have[1:] == want[1:] and vocab_size <= have[0] < vocab_size + _PADDING_ROWS


@contextlib.contextmanager
def _held_back(folder: Path) -> Iterator[None]:
    """While megatron-core reads `folder`: the index through dist_checkpoint.load_index (its unpickler builds only
    DCP's metadata classes), no common state, torch.load weights_only."""
    owners = [(importlib.import_module(target.split(":")[0]), target.split(":")[1]) for target in HELD_BACK]
    saved = [getattr(owner, name) for owner, name in owners]  # an AttributeError names a target that moved
    replacements = [types.SimpleNamespace(load=functools.partial(load_index, folder), dump=pickle.dump),
                    lambda checkpoint_dir: {}, functools.partial(_weights_only, saved[2])]
    for (owner, name), replacement in zip(owners, replacements):
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for (owner, name), original in zip(owners, saved):
            setattr(owner, name, original)


def _weights_only(load, *args, **kwargs):
    return load(*args, **{**kwargs, "weights_only": True})
