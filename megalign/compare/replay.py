"""What `--routing replay:DUMP` replays: a dump's recorded expert choices, in the replaying run's batch.

The routing records (kind `routing`, `<router>.experts` and `<router>.weights`, [seq, rows, topk])
are reassembled from all ranks like any tensor. A run with the same rows replays them as they are,
padding included; a run whose batch is packed or padded otherwise gets the choices of every real
token (lineup.py) in its own rows, and padding experts 0..topk-1 with weight 0 (no real token sees
padding). Any layout or precision can so be given exactly the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megalign.compare.entries import Entry, Value
from megalign.compare.lineup import real_tokens, token_index
from megalign.compare.sources import open_source
from megalign.dump.layout import BatchRow
from megalign.errors import UserError

CHOICES = (".experts", ".weights")
# The sizes that make a recorded routing fit a model.
MODEL_KEYS = ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk")


@dataclass
class RecordedRouting:
    documents: list[list[int]]  # the token ids the recording ran on
    rows: list[BatchRow]
    choices: dict[str, Entry]  # "<router>.experts" / "<router>.weights": [seq, rows, topk]
    model: dict

    def in_rows(self, rows: list[BatchRow]) -> dict[str, torch.Tensor]:
        """Every router's choices laid out in `rows`: [seq, rows, topk]."""
        if rows == self.rows:
            return {name: _values(entry.load(), name) for name, entry in self.choices.items()}
        return {name: _place(_real(entry, self.rows), rows) for name, entry in self.choices.items()}


def recorded_routing(path: Path) -> RecordedRouting:
    source = open_source(path)
    if source.format != "megalign" or source.rows is None:
        raise UserError(f"--routing replay:{path}: not a megalign dump with its batch recorded")
    entries = {e.name: e for e in source.entries if e.kind == "routing" and e.name.endswith(CHOICES)}
    tokens = next((e for e in source.entries if (e.kind, e.name) == ("input", "tokens")), None)
    if not entries or tokens is None:
        raise UserError(f"--routing replay:{path}: the dump has no recorded routing (was it an MoE run, "
                        "without a --filter that left the routing out?)")
    flat = _real(tokens, source.rows).tolist()
    documents, start = [], 0
    for row in source.rows:
        for length in row.lengths:
            documents.append(flat[start:start + length])
            start += length
    return RecordedRouting(documents=documents, rows=source.rows, choices=entries, model=source.model or {})


def _real(entry: Entry, rows: list[BatchRow]) -> torch.Tensor:
    return _values(real_tokens(entry.load(), entry.batch_dim, entry.seq_dim, rows), entry.name)


def _values(value: Value, name: str) -> torch.Tensor:
    if value.problem or value.tensor is None:
        raise UserError(f"cannot replay {name}: {value.problem or 'no values (a --stats-only dump)'}")
    return value.tensor


def _place(choices: torch.Tensor, rows: list[BatchRow]) -> torch.Tensor:
    """[real tokens, topk] -> [seq, rows, topk]: each document's tokens where `rows` put them."""
    topk = choices.shape[-1]
    full = torch.zeros((rows[0].bounds[-1], len(rows), topk), dtype=choices.dtype)
    if not choices.is_floating_point():
        full[:] = torch.arange(topk)
    row_index, position = token_index(rows)
    full[position, row_index] = choices
    return full


def check_fits(recorded: RecordedRouting, path: Path, tokens: list[list[int]], model: dict) -> None:
    """A recording of another model or of other tokens would force choices that mean nothing: exit 2."""
    differ = [k for k in MODEL_KEYS if recorded.model.get(k) != model.get(k)]
    if differ:
        raise UserError(f"--routing replay:{path} recorded another model: "
                        + ", ".join(f"{k} {recorded.model.get(k)} vs {model.get(k)}" for k in differ))
    if recorded.documents != [list(doc) for doc in tokens]:
        raise UserError(f"--routing replay:{path} recorded other tokens than this run's")
