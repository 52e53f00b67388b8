"""What `--routing replay:DUMP` replays: a dump's recorded expert choices, in the replaying run's batch.

The routing records (kind `routing`, `<router>.experts` and `<router>.weights`, [seq, rows, topk])
are put back together from all ranks (dump/token_tensor.py). A run with the same rows replays them
as they are, padding included; a run whose batch is packed or padded otherwise gets the choices of
every real token in its own rows, and padding experts 0..topk-1 with weight 0 (no real token sees
padding). Any layout or precision can so be given exactly the same choices. They reach the workers
as a safetensors file (no pickle) in a temporary folder of ours (stacks/megatron/moe.py).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from megalign.dump.format import Kind, TensorRecord
from megalign.dump.layout import BatchRow, at_real_tokens, token_index
from megalign.dump.reader import DumpFiles, RankManifest
from megalign.dump.token_tensor import Unplaced, read_token_tensor
from megalign.errors import UserError
from megalign.spec import RunSpec
from megalign.stacks.batch import batch_rows

CHOICES = (".experts", ".weights")
# The sizes that make a recorded routing fit a model.
MODEL_KEYS = ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk")
REPLAY_FILE = "routing.safetensors"

Pieces = list[tuple[RankManifest, TensorRecord]]  # a tensor's record on each rank that holds it


@dataclass
class RecordedRouting:
    dump: DumpFiles
    documents: list[list[int]]  # the token ids the recording ran on
    choices: dict[str, Pieces]  # "<router>.experts" / "<router>.weights": [seq, rows, topk]
    model: dict

    def in_rows(self, rows: list[BatchRow]) -> dict[str, torch.Tensor]:
        """Every router's choices laid out in `rows`: [seq, rows, topk]."""
        whole = {name: _read(self.dump, name, pieces) for name, pieces in self.choices.items()}
        if rows == self.dump.rows:
            return whole
        return {name: _place(_real(tensor, self.choices[name], self.dump.rows), rows) for name, tensor in whole.items()}


def routing_replay(spec: RunSpec, stack: str, routing: str) -> Optional[Path]:
    """--routing replay:DUMP: the recorded choices, checked against this run, in a temporary folder that
    the workers read (REPLAY_FILE; the caller removes it); None for --routing record."""
    if routing == "record":
        return None
    kind, _, source = routing.partition(":")
    if kind != "replay" or not source:
        raise UserError(f"--routing {routing!r}: expected record or replay:DUMP")
    if not spec.model.is_moe or stack != "megatron":
        raise UserError("--routing replay needs a megatron run of an MoE model")
    recorded = _recorded_routing(Path(source))
    _check_recording_fits(recorded, Path(source), spec.tokens, spec.model.to_dict())
    folder = Path(tempfile.mkdtemp(prefix="megalign-replay-"))
    choices = recorded.in_rows(batch_rows(spec))
    save_file({name: t.contiguous() for name, t in choices.items()}, str(folder / REPLAY_FILE))
    return folder


def _recorded_routing(path: Path) -> RecordedRouting:
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if not (path.is_dir() and (DumpFiles.is_dump(path) or any(path.glob("rank-*")))):
        raise UserError(f"--routing replay:{path}: not a megalign dump with its batch recorded")
    dump = DumpFiles.open(path)
    if dump.rows is None:
        raise UserError(f"--routing replay:{path}: not a megalign dump with its batch recorded")
    tensors: dict[tuple[str, str], Pieces] = {}
    for rank, record in dump.records():
        tensors.setdefault((record.kind, record.name), []).append((rank, record))
    choices = {name: pieces for (kind, name), pieces in tensors.items()
               if kind == Kind.ROUTING and name.endswith(CHOICES)}
    tokens = tensors.get((Kind.INPUT, "tokens"))
    if not choices or tokens is None:
        raise UserError(f"--routing replay:{path}: the dump has no recorded routing (was it an MoE run, "
                        "without a --filter that left the routing out?)")
    flat = _real(_read(dump, "tokens", tokens), tokens, dump.rows).tolist()
    documents, start = [], 0
    for row in dump.rows:
        for length in row.lengths:
            documents.append(flat[start:start + length])
            start += length
    model = dump.meta.get("model")
    return RecordedRouting(dump=dump, documents=documents, choices=choices, model=model if isinstance(model, dict) else {})


def _read(dump: DumpFiles, name: str, pieces: Pieces) -> torch.Tensor:
    try:
        return read_token_tensor(dump, pieces)
    except Unplaced as e:
        raise UserError(f"cannot replay {name}: {e}") from None


def _real(tensor: torch.Tensor, pieces: Pieces, rows: list[BatchRow]) -> torch.Tensor:
    sharding = pieces[0][1].sharding
    return at_real_tokens(tensor, sharding.dp_dim, sharding.seq_dim, rows)


def _place(choices: torch.Tensor, rows: list[BatchRow]) -> torch.Tensor:
    """[real tokens, topk] -> [seq, rows, topk]: each document's tokens where `rows` put them."""
    topk = choices.shape[-1]
    full = torch.zeros((rows[0].bounds[-1], len(rows), topk), dtype=choices.dtype)
    if not choices.is_floating_point():
        full[:] = torch.arange(topk)
    row_index, position = token_index(rows)
    full[position, row_index] = choices
    return full


def _check_recording_fits(recorded: RecordedRouting, path: Path, tokens: list[list[int]], model: dict) -> None:
    """A recording of another model or of other tokens would force choices that mean nothing: exit 2."""
    differ = [k for k in MODEL_KEYS if recorded.model.get(k) != model.get(k)]
    if differ:
        raise UserError(f"--routing replay:{path} recorded another model: "
                        + ", ".join(f"{k} {recorded.model.get(k)} vs {model.get(k)}" for k in differ))
    if recorded.documents != [list(doc) for doc in tokens]:
        raise UserError(f"--routing replay:{path} recorded other tokens than this run's")
