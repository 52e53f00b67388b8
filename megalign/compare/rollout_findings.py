"""What a comparison of a rollout with the trainer found beyond the logprobs row, worked out once for
the printed report, the --json report and --export-worst: the worst sequences, where the mismatch
sits (rollout_where.py), the causes the numbers show when the row failed (rollout_causes.py), and with
--reference, per token, which side is further from it. Δ = trainer - rollout, over the response."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megalign.compare.entries import Source
from megalign.compare.metrics import logprob_gap
from megalign.compare.rollout_causes import SequenceGap, causes, sequence_gaps, worst
from megalign.compare.rollout_pair import RolloutPair
from megalign.compare.rollout_where import Region, regions
from megalign.compare.records import Report
from megalign.dump.format import Kind
from megalign.errors import UserError, read_user_text


@dataclass
class ReferenceDistances:
    """Per response token, which side is further from the fp64 reference."""

    tokens: int
    engine_further: int
    trainer_further: int
    max_engine: float  # the largest |Δ| to the reference, engine and trainer
    max_trainer: float


@dataclass
class RolloutFindings:
    gaps: list[SequenceGap]  # every sequence with a response token compared
    worst_by_k3: list[SequenceGap]
    worst_by_max_abs_diff: list[SequenceGap]
    where: list[Region]
    causes_checked: bool  # the logprobs row failed, so causes were looked for
    causes: list[str] = field(default_factory=list)
    sides: Optional[ReferenceDistances] = None  # each side's distance to the reference (JSON: "sides")


def find(pair: RolloutPair, report: Report, reference: Optional[Source] = None) -> Optional[RolloutFindings]:
    """None when the logprobs were not compared (filtered out, or not in the dump)."""
    row = next((r for r in report.rows if r.kind == Kind.LOGPROBS), None)
    if row is None or row.metrics is None:
        return None
    trainer = pair.laid_out(Kind.LOGPROBS, "logprobs")
    mask = pair.loss_mask * pair.compared
    gaps = sequence_gaps(pair.logprobs, trainer, mask)
    dump = pair.dump.dump
    layout_cp = dump.layout.cp if dump is not None else 1
    cp_split = dump.meta.get("cp_split") if dump is not None else None
    found = RolloutFindings(gaps=gaps, worst_by_k3=worst(gaps, lambda g: g.k3),
                            worst_by_max_abs_diff=worst(gaps, lambda g: g.max_abs_diff),
                            where=regions(logprob_gap(pair.logprobs, trainer), mask > 0, pair.loss_mask, pair.dump.rows,
                                          layout_cp, cp_split),
                            causes_checked=row.failing)
    if reference is not None:
        found.sides = _to_reference(pair.logprobs, trainer, pair.laid_out(Kind.LOGPROBS, "logprobs", reference),
                                           mask > 0)
    if row.failing:
        valid = torch.zeros_like(pair.loss_mask, dtype=torch.bool)
        for i, sample in enumerate(pair.rollout.samples):
            valid[i, :len(sample.tokens) - 1] = True
        found.causes = causes(pair.logprobs, trainer, mask, pair.tokens, valid,
                              lambda: pair.laid_out(Kind.LOGITS, "logits"),
                              dump.meta.get("hf_checkpoint") if dump is not None else None)
    return found


def _to_reference(engine: torch.Tensor, trainer: torch.Tensor, truth: torch.Tensor,
                  keep: torch.Tensor) -> ReferenceDistances:
    off_engine = (engine.double() - truth.double()).abs()[keep]
    off_trainer = (trainer.double() - truth.double()).abs()[keep]
    further = int((off_engine > off_trainer).sum())
    return ReferenceDistances(tokens=int(keep.sum()), engine_further=further, trainer_further=int(keep.sum()) - further,
                 max_engine=float(off_engine.max()), max_trainer=float(off_trainer.max()))


def worst_sequences(findings: RolloutFindings, n: int) -> list[int]:
    """The sequences among the n worst by k3 or by max |Δ|, in the rollout's order."""
    chosen = {g.sequence for key in (lambda g: g.k3, lambda g: g.max_abs_diff) for g in worst(findings.gaps, key, n)}
    return sorted(chosen)


# What write_worst says beside the tokens: where they came from (and what tells its file from a user's).
WORST_SOURCE = ("sequences", "prompt_lengths", "rollout", "worst_by_k3", "worst_by_max_abs_diff")


def write_worst(path: Path, pair: RolloutPair, findings: RolloutFindings, n: int) -> None:
    """A tokens file of the worst sequences (prompt + response), which `megalign forward --tokens` reads
    (its "tokens"); the rest says where they came from."""
    sequences = worst_sequences(findings, n)
    samples = pair.rollout.samples
    content = {"tokens": [samples[i].tokens for i in sequences],
               "sequences": sequences,
               "prompt_lengths": [len(samples[i].prompt) for i in sequences],
               "rollout": str(pair.rollout.path),
               "worst_by_k3": [g.sequence for g in worst(findings.gaps, lambda g: g.k3, n)],
               "worst_by_max_abs_diff": [g.sequence for g in worst(findings.gaps, lambda g: g.max_abs_diff, n)]}
    with open(path, "w") as out:
        json.dump(content, out)
        out.write("\n")


def is_worst_file(path: Path) -> bool:
    """Whether `path` holds what write_worst writes."""
    try:
        content = json.loads(read_user_text(path, "--export-worst file"))
    except (UserError, ValueError):
        return False
    return isinstance(content, dict) and {"tokens", *WORST_SOURCE} <= content.keys()
