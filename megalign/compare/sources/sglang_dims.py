"""sglang's dims annotations, translated into the splits and sums of a plan (compare/plan.py).

A dims string names each dim of a tensor and, in brackets, the axes it is sharded on, outermost
first: `s[cp:zigzag,sp] b h[tp]` is split over CP (in its load-balanced zigzag order) and, within
each CP rank's piece, over SP; h over TP. A qualifier says how: `zigzag` (CP's order), `natural` and
`sharded` (plain), `partial` (not split: each rank holds a part of the sum). After `#` come
declarations, as sglang's comparator reads them (dims_spec/comment_parser.py): `tp:replicated`
(ranks that differ only on axes the dims do not shard hold replicas, declared or not, so this only
has to name a known axis not also sharded), and `dp:=attn_dp`: the axis whose ranks are data
parallel, of which one holds the tensor and the others (idle) an empty one (`dp` when not said).
Any other word there is refused, as sglang refuses it.

A rank's place on an axis is read from its parallel info (`sglang_parallel_info`, or the
`megatron_parallel_info` of a training run) as `{key}_rank` and `{key}_size`, by the axis's row in
AXES; an axis no rank records, or of size 1, splits nothing. Adding an axis is adding a row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from megalign.compare.plan import Split
from megalign.dump.format import RankCoords

# Each axis: the parallel-info keys its rank and size are read under, the first one found.
# sglang's comparator's axes (dims_spec/types.py ParallelAxis), and attn_cp, which its server records.
AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "ep": ("ep",),  # megatron's expert parallelism
    "sp": ("sp", "tp"),  # megatron's sequence parallelism reuses the TP group, and records no sp_rank
    "dp": ("dp",),
    "etp": ("etp",),  # experts' tensor parallelism (parameter gradients named by megatron, sglang.py)
    "edp": ("edp",),
    "attn_tp": ("attn_tp",),
    "attn_cp": ("attn_cp",),
    "attn_dp": ("attn_dp",),
    "moe_ep": ("moe_ep",),  # sglang's expert parallelism
    "moe_tp": ("moe_tp",),
    "moe_dp": ("moe_dp",),
    # The dumper's recompute status, recorded beside the parallel info, not in it: here it splits
    # nothing (a recomputed copy is checked against the original, sources/sglang_identity.py).
    "recompute_pseudo": ("recompute_pseudo",),
}
# Each qualifier: (zigzag order, partial sum).
QUALIFIERS: dict[str, tuple[bool, bool]] = {
    "sharded": (False, False), "natural": (False, False), "zigzag": (True, False), "partial": (False, True)}
_TOKEN = re.compile(r"^(?P<name>[^\[\]]+)(?:\[(?P<mods>[^\]]+)\])?$")
_DP_ALIAS = re.compile(r"^dp:=(\w+)$")
_REPLICATED = re.compile(r"^(\w+):replicated$")


@dataclass(frozen=True)
class Modifier:
    """One axis a dim is sharded on, as the dims say it."""

    dim: int
    axis: str
    zigzag: bool = False
    partial: bool = False


@dataclass(frozen=True)
class Dims:
    """A parsed dims string: how many dims the tensor has, and its modifiers, innermost first (the
    order a plan's splits of one dim are listed in)."""

    ndim: int
    modifiers: tuple[Modifier, ...]
    dp_axis: str = "dp"  # `# dp:=X`: the axis of the data-parallel ranks, one of which holds the tensor
    replicated: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Sharded:
    """A tensor's splits and sums, in plan.py's terms: splits named by their axis in capitals (as
    megalign's are), sums as (axis, size)."""

    splits: tuple[Split, ...]
    summed: tuple[tuple[str, int], ...] = ()

    def at(self, info: dict) -> dict[str, int]:
        """A rank's place on every axis this tensor is split or summed over."""
        axes = [s.axis for s in self.splits] + [axis for axis, _ in self.summed]
        return {axis: place(info, axis.lower())[0] for axis in axes}


def parse_dims(dims: str) -> Dims:
    """ValueError for a token, axis, qualifier or declaration this reader does not know."""
    shape, _, declarations = dims.partition("#")
    tokens = shape.split()
    modifiers = []
    for index, token in enumerate(tokens):
        match = _TOKEN.match(token)
        if match is None:
            raise ValueError(f"bad dim {token!r}")
        axes = []
        for modifier in reversed(match.group("mods").split(",") if match.group("mods") else []):
            axis, _, qualifiers = modifier.strip().partition(":")
            _known(axis, modifier)
            how = [QUALIFIERS.get(q.strip()) for q in qualifiers.split("+") if q.strip()]
            if None in how:
                raise ValueError(f"unknown qualifier in {modifier!r}")
            axes.append(axis)
            modifiers.append(Modifier(dim=index, axis=axis, zigzag=any(z for z, _ in how),
                                      partial=any(p for _, p in how)))
        if len(set(axes)) != len(axes):
            raise ValueError(f"an axis named twice in {token!r}")
    dp_axis, replicated = _declarations(declarations)
    both = replicated & {m.axis for m in modifiers}
    if both:
        raise ValueError(f"axes {', '.join(sorted(both))} declared both sharded and replicated")
    return Dims(ndim=len(tokens), modifiers=tuple(modifiers), dp_axis=dp_axis, replicated=replicated)


def _known(axis: str, where: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r} in {where!r} (sglang's axes: {', '.join(AXES)})")


def _declarations(text: str) -> tuple[str, frozenset[str]]:
    """The `#` section: (the data-parallel axis, the axes declared replicated)."""
    dp_axis, replicated = None, set()
    for word in text.split():
        alias, axis = _DP_ALIAS.match(word), _REPLICATED.match(word)
        if alias and dp_axis is None:
            _known(alias.group(1), word)
            dp_axis = alias.group(1)
        elif axis and axis.group(1) not in replicated:
            _known(axis.group(1), word)
            replicated.add(axis.group(1))
        else:
            raise ValueError(f"{word!r} after '#' is neither 'dp:=<axis>' nor '<axis>:replicated', "
                             "or says it again")
    return dp_axis or "dp", frozenset(replicated)


def non_empty(dims: Dims, infos: list[dict], shapes: list[tuple[int, ...]]) -> list[int]:
    """The ranks (indices) to put the tensor together from: under data parallelism where some DP
    ranks (on the dims' `dp:=` axis) hold an empty tensor, as an idle sglang DP rank does, those of
    the one DP rank that holds it (sglang's dp_utils); every rank otherwise, where DP ranks hold replicas."""
    if axis_size(infos, dims.dp_axis) == 1:
        return list(range(len(infos)))
    held: dict[int, list[int]] = {}
    for index, (info, shape) in enumerate(zip(infos, shapes)):
        held.setdefault(place(info, dims.dp_axis)[0], []).append(index)
    full = [rank for rank, indices in held.items() if any(math.prod(shapes[i]) for i in indices)]
    if len(full) in (0, len(held)):
        return list(range(len(infos)))
    if len(full) != 1:
        raise ValueError(f"{len(full)} of its {dims.dp_axis} ranks hold it and others an empty tensor: "
                         "one should hold it")
    return held[full[0]]


def sharded(dims: Dims, infos: list[dict]) -> Sharded:
    """The splits and sums the dims make over ranks of `infos`; a partial modifier sums, whatever
    its order."""
    splits, summed = [], []
    for modifier in dims.modifiers:
        size = axis_size(infos, modifier.axis)
        if size == 1:
            continue
        if modifier.partial:
            summed.append((modifier.axis.upper(), size))
        else:
            splits.append(Split(modifier.axis.upper(), size, modifier.dim, zigzag=modifier.zigzag))
    return Sharded(splits=tuple(splits), summed=tuple(summed))


def split_on(infos: list[dict], axis: str, dim: Optional[int], parts: int = 1) -> Sharded:
    """A tensor split on one axis along `dim` (none: not split), for tensors dumped without dims
    whose split a naming convention says."""
    size = 1 if dim is None else axis_size(infos, axis)
    return Sharded(splits=() if size == 1 else (Split(axis.upper(), size, dim, parts=parts),))


def axis_size(infos: list[dict], axis: str) -> int:
    """The axis's size, the same on every rank; 1 where no rank records it."""
    found = [place(info, axis) for info in infos]
    if all(f is None for f in found):
        return 1
    if None in found:
        raise ValueError(f"a rank's parallel info has no {axis}_rank / {axis}_size")
    sizes = {size for _, size in found}
    if len(sizes) != 1:
        raise ValueError(f"ranks record {axis} sizes {sorted(sizes)}")
    return sizes.pop()


def place(info: dict, axis: str) -> Optional[tuple[int, int]]:
    """(rank, size) of a rank on an axis, by its row in AXES; None where its info has neither key."""
    for key in AXES[axis]:
        rank, size = info.get(f"{key}_rank"), info.get(f"{key}_size")
        if rank is not None and size is not None:
            if type(rank) is not int or type(size) is not int:
                raise ValueError(f"{key}_rank / {key}_size are {rank!r} / {size!r}, not integers")
            return rank, size
    return None


def parallel_info(meta: dict) -> dict:
    """A rank's parallel info: sglang's and megatron's records together."""
    info = {}
    for key in ("sglang_parallel_info", "megatron_parallel_info"):
        if isinstance(meta.get(key), dict):
            info.update(meta[key])
    return info


def rank_coords(rank: int, info: dict) -> RankCoords:
    """The rank's coordinates as a plan names them (its explanation's text), 0 where not recorded."""
    return RankCoords(rank=rank, **{f"{axis}_rank": info.get(f"{axis}_rank") if type(info.get(f"{axis}_rank")) is int
                                    else 0 for axis in ("tp", "cp", "pp", "dp")})
