"""Which tensor an sglang dumper file holds: its name, the tags dumped beside it, and whether it is
a recomputed copy.

sglang's dumper writes every keyword of `dumper.dump(name, t, layer_id=3)` (and of its `set_ctx`)
into the file name; its comparator matches files on all of them but the rank and dump_index
(bundle_matcher.py), so the same name on two pipeline stages, tagged `layer_id=0` and `layer_id=1`,
is two tensors, not two replicas. A tag becomes part of the name megalign reports (`x[layer_id=1]`)
where the name takes more than one value of it in the dump: a name every file of which has one
layer_id (hook mode's `decoder.layers.1.mlp`, layer_id=1) keeps its name, which other formats share.

Under activation recompute (megatron's checkpointing), the dumper tags each file
`recompute_status=original` or `=recompute` (`disabled` outside it), and records the pseudo axis
`recompute_pseudo_rank` of size 2 beside the parallel info: sglang's comparator treats that axis as
replicated. Here too the recomputed copy is not a tensor of its own: it is checked against the
original, as a replica is, so that one side recomputed still meets the other side's tensor, and a
recompute that differs fails.
"""

from __future__ import annotations

from collections import defaultdict

from megalign.compare.entries import ReplicaGap, Value
from megalign.compare.metrics import pair_sums

# File-name fields that say where a file lies (its step, rank, order), not what it holds: the
# dumper's own, sglang's earlier dumper's step, and the parallel ranks it adds with
# include_parallel_rank_in_filename (dumper._PARALLEL_RANK_KEYS).
_PLACING = frozenset({"step", "forward_pass_id", "rank", "dump_index", "name", "recompute_status",
                      "pp_rank", "tp_rank", "cp_rank", "ep_rank", "etp_rank"})
_RECOMPUTED = "recompute"

Tags = tuple[tuple[str, str], ...]


def tags_of(fields: dict) -> Tags:
    """The file's tags beside its name, in name order."""
    return tuple(sorted((key, str(value)) for key, value in fields.items() if key not in _PLACING))


def recomputed(fields: dict) -> bool:
    """Whether the file holds the copy a recompute (megatron's checkpointing) dumped again."""
    return fields.get("recompute_status") == _RECOMPUTED


def naming_tags(files: list[tuple[str, Tags]]) -> dict[str, frozenset[str]]:
    """For each dumped name, the tags that tell its tensors apart: those it takes several values of
    (absent counts as a value) among `files` ((name, tags) of every file)."""
    by_name: dict[str, list[dict[str, str]]] = defaultdict(list)
    for name, tags in files:
        by_name[name].append(dict(tags))
    return {name: frozenset(key for key in set().union(*found) if len({tags.get(key) for tags in found}) > 1)
            for name, found in by_name.items()}


def tagged(name: str, tags: Tags, naming: frozenset[str]) -> str:
    """The name with the tags that tell its tensors apart: `x[layer_id=1]`."""
    shown = [f"{key}={value}" for key, value in tags if key in naming]
    return f"{name}[{','.join(shown)}]" if shown else name


def checked_against_recompute(original: Value, copy: Value) -> Value:
    """The original's value, with its recomputed copy measured against it as a replica is."""
    if copy.problem or copy.tensor is None:
        original.problem = original.problem or f"its recomputed copy: {copy.problem or 'no values'}"
    elif original.tensor is not None and list(copy.tensor.shape) != list(original.tensor.shape):
        original.problem = (f"its recomputed copy has shape {list(copy.tensor.shape)}, the original "
                            f"{list(original.tensor.shape)}")
    elif original.tensor is not None:
        original.replicas.append(ReplicaGap(ranks="recomputed copy vs original",
                                            sums=pair_sums(copy.tensor, original.tensor)))
    return original
