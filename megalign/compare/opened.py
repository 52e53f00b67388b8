"""`megalign.open` (re-exported by `megalign`): a dump, read the way `megalign compare` reads it.

A thin view over compare's sources (compare/sources/): the same detection of what a path is, the
same names, and the same reassembly of each tensor from its rank files, so that a tensor seen here is
exactly the one compare compared. Opening reads only dump.json and the manifests (megalign dumps),
or the files' headers; a tensor is read when it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megalign.compare.buffers import check_fits
from megalign.compare.entries import Entry, Source
from megalign.compare.explain import near_names
from megalign.compare.sources import open_source
from megalign.dump.format import TensorRecord
from megalign.dump.layout import Layout
from megalign.dump.reader import DumpFiles, RankManifest
from megalign.dump.sharding import Sharding


@dataclass
class RankPiece:
    """One rank's piece of a tensor in a megalign dump, where it sits in the layout, and how the dump
    says it is split (`sharding`). The piece is read by `tensor()`, not before. Expert-parallel ranks
    are not recorded: experts are dumped under their global names (`mlp.experts.<e>`)."""

    rank: int
    tp_rank: int
    cp_rank: int
    pp_rank: int
    dp_rank: int
    shape: list[int]
    dtype: str
    sharding: Sharding
    stats: Optional[dict] = None  # --stats-only dumps: the piece's statistics instead of its values
    _dump: DumpFiles = field(default=None, repr=False)
    _rank: RankManifest = field(default=None, repr=False)
    _record: TensorRecord = field(default=None, repr=False)

    def tensor(self) -> torch.Tensor:
        """This rank's piece as it was dumped (a CPU tensor); ValueError for a stats-only record."""
        if self._record.file is None:
            raise ValueError(f"{self._record.name} on rank {self.rank} was dumped with --stats-only: it has "
                             "statistics (.stats), no values")
        return self._dump.load(self._rank, self._record)


class UnknownTensor(KeyError):
    """A (kind, name) the dump does not hold. Printed as its message (KeyError alone prints its repr)."""

    def __str__(self) -> str:
        return str(self.args[0])


class Dump:
    """A dump opened with `megalign.open`: its tensors by (kind, name), in execution order.

    Kinds are those of compare's report (megalign.dump.format.Kind): input, activation,
    activation_grad, param_grad, logits, logprobs, loss, routing, param. Plain tensor files do not say
    what a tensor is: their kind is None.
    """

    def __init__(self, source: Source):
        self._source = source
        self._entries = {(e.kind, e.name): e for e in sorted(source.entries, key=lambda e: e.order)}

    def __repr__(self) -> str:
        return f"<megalign.Dump {self.path}: {self.description}, {len(self._entries)} tensors>"

    @property
    def path(self) -> Path:
        return self._source.path

    @property
    def format(self) -> str:
        """`megalign`, `sglang` or `tensors` (plain .safetensors/.pt files)."""
        return self._source.format

    @property
    def description(self) -> str:
        """The line compare prints for this input, e.g. `megalign dump: megatron backward, tp=1 pp=1 cp=2, fp32`."""
        return self._source.description

    @property
    def meta(self) -> dict:
        """What ran: dump.json of a megalign dump (stack, mode, layout, model, dtype, ...); {} otherwise."""
        return self._source.dump.meta if self._source.dump is not None else {}

    @property
    def layout(self) -> Optional[Layout]:
        """How a megalign dump's ranks split the work: tp, pp, cp, dp, sp, ep, etp (`describe()` prints
        it as compare does); None for other formats."""
        return self._source.dump.layout if self._source.dump is not None else None

    def names(self, kind: Optional[str] = None) -> list[tuple[Optional[str], str]]:
        """(kind, name) of every tensor in execution order (forward, activation gradients, parameter
        gradients), or of one kind. For plain tensor files every pair is (None, name), in file order."""
        return [key for key in self._entries if kind is None or key[0] == kind]

    def tensor(self, kind: Optional[str], name: str) -> torch.Tensor:
        """The whole tensor, put back together from every rank that holds a piece of it (TP, CP, PP,
        DP, SP, EP), exactly as compare sees it: a CPU tensor. KeyError for a name the dump does not
        hold; ValueError for a --stats-only dump or shards that do not make up the tensor."""
        entry = self._entry(kind, name)
        check_fits(entry.nbytes or 0, f"{kind} {name} of {self.path}")
        value = entry.load()
        if value.problem:
            raise ValueError(f"{self.path}: {kind} {name} cannot be put back together: it {value.problem}")
        if value.tensor is None:
            raise ValueError(f"{self.path}: {kind} {name} has statistics only (a --stats-only dump), no values")
        return value.tensor

    def shards(self, kind: str, name: str) -> list[RankPiece]:
        """The per-rank pieces of a megalign dump's tensor with their coordinates, in rank order;
        ValueError for other formats, which have no rank records."""
        entry = self._entry(kind, name)
        if entry.shards is None:
            raise ValueError(f"{self.path}: shards() reads megalign dumps; this is a {self.format} input")
        return [RankPiece(rank=s.rank.coords.rank, tp_rank=s.rank.coords.tp_rank, cp_rank=s.rank.coords.cp_rank,
                      pp_rank=s.rank.coords.pp_rank, dp_rank=s.rank.coords.dp_rank, shape=list(s.record.shape),
                      dtype=s.record.dtype, sharding=s.record.sharding,
                      stats=s.record.stats.to_dict() if s.record.stats else None,
                      _dump=self._source.dump, _rank=s.rank, _record=s.record)
                for s in sorted(entry.shards, key=lambda s: s.rank.coords.rank)]

    def _entry(self, kind: Optional[str], name: str) -> Entry:
        entry = self._entries.get((kind, name))
        if entry is not None:
            return entry
        kinds = sorted({k for k, n in self._entries if n == name}, key=str)
        if kinds:
            raise UnknownTensor(f"{self.path} has no {kind} {name!r}; it has {name!r} as kind "
                           f"{', '.join(map(repr, kinds))}")
        close = near_names(name, [n for k, n in self._entries if k == kind])
        hint = f"; close names: {', '.join(close)}" if close else f"; names() lists its {len(self._entries)} tensors"
        raise UnknownTensor(f"{self.path} has no {kind} {name!r}{hint}")


def open(path) -> Dump:  # noqa: A001 - the public name, as the issue asks: megalign.open(path)
    """Open a megalign dump, an sglang dumper folder, or a `.safetensors`/`.pt` file or folder of them,
    as `megalign compare` would. Raises UserError (the message compare prints) for anything else."""
    return Dump(open_source(Path(path)))
