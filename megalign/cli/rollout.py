"""What `megalign compare` prints after the table when one side is a rollout file: the worst sequences
(by k3 and by max |Δlogprob|, over the response) and, when the logprobs diverged, the cause the
numbers show (compare/rollout_causes.py)."""

from __future__ import annotations

from typing import Optional

import torch
from rich.markup import escape

from megalign.cli.render import Cell, Column, console, print_table, resolve_format
from megalign.compare.rollout_causes import causes, sequence_gaps, worst
from megalign.compare.rollout_pair import RolloutPair
from megalign.compare.entries import Source
from megalign.compare.verdict import Report

COLUMNS = (Column("seq", right=True), Column("tokens", right=True), Column("k3 KL", right=True),
           Column("max |Δ| @ pos", right=True), Column("mean |Δ|", right=True))


def print_rollout(pair: RolloutPair, report: Report, fmt: str, reference: Optional[Source] = None) -> None:
    row = next((r for r in report.rows if r.kind == "logprobs"), None)
    if row is None or row.metrics is None:
        return
    trainer = pair.laid_out("logprobs", "logprobs")
    mask = pair.loss_mask * pair.compared
    if reference is not None:
        _print_sides(pair.logprobs, trainer, pair.laid_out("logprobs", "logprobs", reference), mask > 0)
    gaps = sequence_gaps(pair.logprobs, trainer, mask)
    for title, key in (("k3 KL", lambda g: g.k3), ("max |Δlogprob|", lambda g: g.max_abs_diff)):
        console.print()
        console.print(f"[bold]worst sequences by {title}[/] (response tokens, Δ = trainer - rollout)",
                      highlight=False, soft_wrap=True)
        print_table(COLUMNS, [[Cell(str(g.sequence)), Cell(str(g.tokens)), Cell(f"{g.k3:.3g}"),
                               Cell(f"{g.max_abs_diff:.3g} @{g.position}"), Cell(f"{g.mean_abs_diff:.3g}")]
                              for g in worst(gaps, key)], resolve_format(fmt))
    if not row.failing:
        return
    valid = torch.zeros_like(pair.loss_mask, dtype=torch.bool)
    for i, sample in enumerate(pair.rollout.samples):
        valid[i, :len(sample.tokens) - 1] = True
    found = causes(pair.logprobs, trainer, mask, pair.tokens, valid, lambda: pair.laid_out("logits", "logits"))
    console.print()
    for cause in found:
        console.print(f"[bold red]cause:[/] {escape(cause)}", highlight=False, soft_wrap=True)
    if not found:
        console.print("cause: none of the known ones (temperature, top-p/top-k renormalisation, a one-position "
                      "shift) explains the logprobs' gap", highlight=False, soft_wrap=True)


def _print_sides(engine: torch.Tensor, trainer: torch.Tensor, truth: torch.Tensor, keep: torch.Tensor) -> None:
    """Per response token, which side is further from the fp64 reference."""
    off_engine = (engine.double() - truth.double()).abs()[keep]
    off_trainer = (trainer.double() - truth.double()).abs()[keep]
    further = int((off_engine > off_trainer).sum())
    console.print()
    console.print(f"[bold]per token against the reference[/]: the engine is further on {further} of {int(keep.sum())} "
                  f"response tokens, the trainer on {int(keep.sum()) - further}; |Δ| to the reference max engine "
                  f"{float(off_engine.max()):.3g}, trainer {float(off_trainer.max()):.3g}", highlight=False,
                  soft_wrap=True)
