"""What a comparison reads: a `Source` of lazily loaded `Entry`s, each loading to a `Value`.

Kept apart from sources/ (which build them) and reassemble.py (which fills Values from shards), so
that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from megalign.compare.fused import Sums
from megalign.dump.reader import DumpFiles
from megalign.dump.format import Kind
from megalign.dump.layout import BatchRow
from megalign.dump.stats import TensorStats

# The order of the computation, within a step: the parameters the step's forward uses (a Dumper reads
# them where the step block ends, which comes before the optimizer step: Dumper.step), the forward
# (inputs, activations in the order their modules ran, logits, the loss: every kind not named here,
# and foreign ones: phase 0), then the activation gradients in the order backward produced them (each
# rank's record order: the last layer's first), then the parameter gradients the optimizer step will
# see. Sources build their entries' order from phase() and their own record order; a step's tensors
# all come before the next step's (steps.py).
PHASES = {Kind.PARAM: -1, Kind.ACTIVATION_GRAD: 1, Kind.PARAM_GRAD: 2}


@dataclass
class ReplicaGap:
    """How far one rank's copy of values is from the copy placed (another rank's): the sums of the
    pair (fused.py), judged by judge.py at the tensor's threshold. Bit-identical copies (equal
    content hashes) are never read and have no gap."""

    ranks: str  # "rank 1 vs rank 0": the copy's rank, then the placed one's
    sums: Sums


@dataclass
class Value:
    """A loaded tensor: its values, or only its statistics (--stats-only dumps), or why neither."""

    shape: list[int]
    dtype: str
    tensor: Optional[torch.Tensor] = None
    stats: Optional[TensorStats] = None
    sketch: Optional[np.ndarray] = None  # a stats-only tensor's, where its dump keeps one (dump/sketch.py)
    replicas: list[ReplicaGap] = field(default_factory=list)  # copies that should be equal and were read
    problem: Optional[str] = None  # set when the shards cannot be put back together
    # Set when the values are there but what they stand for is not recorded (per-rank parts of a
    # loss, reduced in a way the dump does not say): nothing to verify them against, and no divergence.
    unverifiable: Optional[str] = None
    parts: Optional[torch.Tensor] = None  # with `unverifiable`: each rank's value, stacked on dim 0

    def add_replicas(self, window: "Value") -> None:
        """Merge the replica gaps of a window of rows into the whole's (execution.Execution._chunk)."""
        mine = {gap.ranks: gap for gap in self.replicas}
        for gap in window.replicas:
            if gap.ranks in mine:
                mine[gap.ranks].sums.add(gap.sums, 0)
            else:
                self.replicas.append(gap)


# (start, stop) of each leading dim of a tensor: the box of it that a streamed pair reads at a time.
Window = tuple[tuple[int, int], ...]


@dataclass
class Entry:
    kind: Optional[str]  # None for plain tensor files, which do not say what a tensor is
    name: str
    order: tuple  # sorts entries of one source in execution order
    layer: Optional[int]
    load: Callable[[], Value]
    # Where the format records them: an only-in-one-side row then needs no load at all.
    shape: Optional[list[int]] = None
    dtype: Optional[str] = None
    # Where the format records them: the dims holding the batch rows and the tokens of each row.
    batch_dim: Optional[int] = None
    seq_dim: Optional[int] = None
    apart: Optional[str] = None  # why this tensor cannot be lined up with the other side's (lineup.py)
    # Where its rows are some of the real tokens only (an sglang server's next-token logits): their
    # indexes, document after document; the other side's same tensor is cut to them (lineup.py).
    tokens: Optional[list[int]] = None
    # The rows of the batch it was made from, where they differ from step to step (a Dumper's
    # step_rows); None: the source's rows.
    rows: Optional[list[BatchRow]] = None
    # Set where `load(buffer=..., window=...)` can place the tensor, or a box of it (a Window), in a
    # caller's buffer (reassemble.py): the tensor's size in bytes.
    nbytes: Optional[int] = None
    # The training step it was dumped in, where the format records steps (a Dumper's; compare/steps.py).
    step: Optional[int] = None
    # megalign dumps: the rank records it is put together from (plan.RankRecord), for the Python API's
    # Dump.shards() (opened.py) and --explain; typed loosely so that this module and plan.py need not import
    # each other.
    shards: Optional[list] = None
    # sglang dumps: the dims string it was dumped with, whose names line it up with the other side's
    # (sources/sglang_dims_lineup.py).
    dims: Optional[str] = None
    # Its seq_dim holds the batch's one packed row, with no batch dim (sglang's THD `t`): lined up as
    # that row (lineup.py).
    packed: bool = False
    # The rows it was mapped to real tokens by (lineup.py): its tensor is then [tokens, ...], their
    # tokens in order, and a DP rank's rows are a run of tokens (rank_rows.py).
    lined_up: Optional[list[BatchRow]] = None


@dataclass
class Source:
    path: Path
    format: str  # megalign | sglang | tensors
    description: str
    entries: list[Entry]
    precision: Optional[str] = None  # the run's dtype where the format records it
    model: Optional[dict] = None  # the model's config where the format records it
    weights: Optional[str] = None  # where the weights came from ("seed 1234", "a checkpoint") where recorded
    rows: Optional[list[BatchRow]] = None  # the batch's documents where the format records them
    dump: Optional[DumpFiles] = None  # the megalign dump read (dump.json, manifests), for the Python API
    # Which stack and attention kernel made it, where the format records them (absent.py: the op map
    # excuses a submodule only between stacks or kernels that differ in it).
    stack: Optional[str] = None
    kernel: Optional[str] = None
    # Its padding holds no values (an sglang server's requests, lined up by position): token tensors are
    # compared by their real tokens even against a run whose rows look the same (lineup.py).
    tokens_only: bool = False
    # Why its rows were not recorded (a Dumper's rows_unknown): its token tensors are set apart
    # where their shapes differ from the other side's (lineup.py).
    rows_unknown: Optional[str] = None
    # The training steps it holds, where the format records them (dump.json's steps: a Dumper's).
    steps: Optional[list[int]] = None


def phase(kind: Optional[str]) -> int:
    return PHASES.get(kind or Kind.ACTIVATION, 0)
