"""What `megalign compare` prints after the table when one side is a rollout file (compare/rollout_findings.py):
with --reference, which side each token's gap is on; the worst sequences (by k3 and by max |Δlogprob|, over the
response); where the mismatch sits; and, when the logprobs diverged, the cause the numbers show."""

from __future__ import annotations


from megalign.cli.render import Cell, Column, console, print_table, resolve_format, shown
from megalign.compare.rollout_findings import RolloutFindings

COLUMNS = (Column("seq", right=True), Column("tokens", right=True), Column("k3 KL", right=True),
           Column("max |Δ| @ pos", right=True), Column("mean |Δ|", right=True))
WHERE = (Column("where"), Column("tokens", right=True), Column("of tokens", right=True),
         Column("of Σ|Δ|", right=True), Column("mean |Δ|", right=True), Column("max |Δ|", right=True),
         Column("over-represented"))


def print_rollout(findings: RolloutFindings, fmt: str) -> None:
    if findings.sides is not None:
        s = findings.sides
        console.print()
        console.print(f"[bold]per token against the reference[/]: the engine is further on {s.engine_further} of "
                      f"{s.tokens} response tokens, the trainer on {s.trainer_further}; |Δ| to the reference max "
                      f"engine {s.max_engine:.3g}, trainer {s.max_trainer:.3g}", highlight=False, soft_wrap=True)
    for title, gaps in (("k3 KL", findings.worst_by_k3), ("max |Δlogprob|", findings.worst_by_max_abs_diff)):
        console.print()
        console.print(f"[bold]worst sequences by {title}[/] (response tokens, Δ = trainer - rollout)",
                      highlight=False, soft_wrap=True)
        print_table(COLUMNS, [[Cell(str(g.sequence)), Cell(str(g.tokens)), Cell(f"{g.k3:.3g}"),
                               Cell(f"{g.max_abs_diff:.3g} @{g.position}"), Cell(f"{g.mean_abs_diff:.3g}")]
                              for g in gaps], resolve_format(fmt))
    console.print()
    console.print("[bold]where the mismatch sits[/] (share of the response tokens against share of Σ|Δ|)",
                  highlight=False, soft_wrap=True)
    print_table(WHERE, [[Cell(r.name), Cell(str(r.tokens)), Cell(f"{r.token_share:.1%}"), Cell(f"{r.mass_share:.1%}"),
                         Cell(f"{r.mean_abs_diff:.3g}"), Cell(f"{r.max_abs_diff:.3g}"),
                         Cell(f"yes, x{r.mass_share / r.token_share:.1f}" if r.over_represented else "no",
                              "bold red" if r.over_represented else None)]
                        for r in findings.where], resolve_format(fmt))
    if not findings.causes_checked:
        return
    console.print()
    for cause in findings.causes:
        console.print(f"[bold red]cause:[/] {shown(cause)}", highlight=False, soft_wrap=True)
    if not findings.causes:
        console.print("cause: none of the known ones (impossible values, a wrong model or ids, a one-position shift, "
                      "temperature, a constant offset, top-p/top-k renormalisation) explains the logprobs' gap", highlight=False, soft_wrap=True)
