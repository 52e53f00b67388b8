"""`megalign compare FILE DUMP` (either order): a rollout file against a megalign dump of its tokens.

Both sides are laid out [sequence, position] as the rollout has them: the dump's token tensors are
mapped to their real tokens (lineup.real_tokens, whatever the dump's padding, packing or CP layout)
and placed back one sequence a row. Three tensors are compared: the tokens and the loss mask
(inputs, which must match exactly: the dump was run with --rollout FILE), and the logprobs at the
positions where the file has one (the response, and the prompt where the file has prompt
logprobs), both sides zero elsewhere. The loss mask (the response) is the mask of the RL metrics.
An fp64 dump of the same tokens (--reference) is laid out alike, and judges which side is off: the
engine's logprobs are held to an fp32 run's rounding budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megalign.compare.entries import Entry, Source, Value
from megalign.compare.lineup import real_tokens
from megalign.compare.sources import open_source
from megalign.dump.format import Kind
from megalign.errors import UserError
from megalign.rollouts.read import is_rollout_file, read_rollout
from megalign.rollouts.sample import Rollout


@dataclass
class RolloutPair:
    rollout: Rollout
    dump: Source  # the dump as opened, every tensor
    rollout_first: bool  # the argument order: the rollout is A
    tokens: torch.Tensor  # [sequence, position], as the rollout lays them out
    logprobs: torch.Tensor  # the rollout's, float64, 0 where it has none
    compared: torch.Tensor  # 1 where the rollout has a logprob
    loss_mask: torch.Tensor  # 1 on the response positions that count

    def sources(self) -> tuple[Source, Source]:
        """(A, B) in the order given: the rollout's three tensors and the dump's same three."""
        mine = [_entry(Kind.INPUT, "tokens", 0, self.tokens), _entry(Kind.INPUT, "loss_mask", 1, self.loss_mask),
                _entry(Kind.LOGPROBS, "logprobs", 2, self.logprobs)]
        # The engine's precision is not in the file: its logprobs are judged as an fp32 run's (--reference).
        notes = "".join(f"; {line}" for line in self.rollout.notes())
        rollout = Source(path=self.rollout.path, format="rollout", entries=mine, precision="fp32",
                         description=f"rollout: {self.rollout.format}, {len(self.rollout.samples)} sequences, "
                                     f"{self.rollout.response_tokens()} response tokens{notes}")
        dump = self.view(self.dump)
        return (rollout, dump) if self.rollout_first else (dump, rollout)

    def view(self, dump: Source) -> Source:
        """A dump's tokens, loss mask and logprobs (where the rollout has one) as the rollout lays them out."""
        check_rows(dump, self.rollout)
        shape = list(self.tokens.shape)
        entries = [_entry(Kind.INPUT, "tokens", 0, lambda: self.laid_out(Kind.INPUT, "tokens", dump), shape),
                   _entry(Kind.INPUT, "loss_mask", 1, lambda: self.laid_out(Kind.INPUT, "loss_mask", dump), shape),
                   _entry(Kind.LOGPROBS, "logprobs", 2,
                          lambda: self.laid_out(Kind.LOGPROBS, "logprobs", dump) * self.compared, shape)]
        return Source(path=dump.path, format=dump.format, entries=entries, precision=dump.precision,
                      description=f"{dump.description}, on the rollout's tokens", model=dump.model,
                      weights=dump.weights, stack=dump.stack, kernel=dump.kernel)

    def laid_out(self, kind: str, name: str, dump: Optional[Source] = None) -> Optional[torch.Tensor]:
        """A dump's tensor [rows, seq, ...] (the trainer's by default) as [sequence, position, ...]; None
        when the dump has none."""
        dump = dump or self.dump
        entry = next((e for e in dump.entries if e.kind == kind and e.name == name), None)
        if entry is None:
            return None
        value = real_tokens(entry.load(), entry.batch_dim, entry.seq_dim, dump.rows)
        if value.problem:
            raise UserError(f"{dump.path}: {kind} {name}: {value.problem}")
        flat = value.tensor
        out = flat.new_zeros(*self.tokens.shape, *flat.shape[1:])
        start = 0
        for i, sample in enumerate(self.rollout.samples):
            n = len(sample.tokens)
            out[i, :n] = flat[start:start + n]
            start += n
        return out


def check_rows(dump: Source, rollout: Rollout) -> None:
    """A megalign dump whose documents are the rollout's sequences, in order."""
    if dump.format != "megalign" or dump.rows is None:
        raise UserError(f"{dump.path}: a rollout is compared with megalign dumps of its tokens (megalign forward "
                        f"--rollout {rollout.path}), not {dump.description}")
    lengths = [n for row in dump.rows for n in row.lengths]
    if lengths != [len(s.tokens) for s in rollout.samples]:
        raise UserError(f"{dump.path} holds {len(lengths)} sequences of {sum(lengths)} tokens, the rollout "
                        f"{len(rollout.samples)} of {sum(len(s.tokens) for s in rollout.samples)}: run megalign "
                        f"forward --rollout {rollout.path}")


def _entry(kind: str, name: str, order: int, tensor, shape: Optional[list[int]] = None) -> Entry:
    def load() -> Value:
        t = tensor() if callable(tensor) else tensor
        return Value(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), tensor=t)

    return Entry(kind=kind, name=name, order=(0, 0, order), layer=None, load=load,
                 shape=shape or (None if callable(tensor) else list(tensor.shape)), batch_dim=0, seq_dim=1)


def open_pair(a: Path, b: Path) -> Optional[RolloutPair]:
    """The pair when one of `a`, `b` is a rollout file (.json, .jsonl), else None."""
    a, b = Path(a), Path(b)
    if not (is_rollout_file(a) or is_rollout_file(b)):
        return None
    if is_rollout_file(a) and is_rollout_file(b):
        raise UserError(f"{a} and {b} are both rollout files: compare a rollout with a megalign dump of its tokens "
                        "(megalign forward --rollout FILE)")
    rollout_path, dump_path = (a, b) if is_rollout_file(a) else (b, a)
    dump = open_source(dump_path)
    hf = dump.dump.meta.get("hf_checkpoint") if dump.dump is not None else None
    rollout = read_rollout(rollout_path, Path(hf) if hf else None)
    check_rows(dump, rollout)
    if len(rollout.recompute_only()) == len(rollout.samples):
        raise UserError(f"{rollout_path}: no sequence has the engine's logprobs (rollout_log_probs null: the trainer "
                        "recomputes them), so there is nothing to compare; megalign forward --rollout runs its tokens")
    tokens, logprobs, compared, loss_mask = rollout_grid(rollout)
    return RolloutPair(rollout=rollout, dump=dump, rollout_first=rollout_path == a, tokens=tokens, logprobs=logprobs,
                       compared=compared, loss_mask=loss_mask)


def rollout_grid(rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rollout as compare lines it up with a dump: [sequence, position] tensors, right-padded:
    tokens, logprobs (float64), the positions compared (the file has a logprob), and the response
    positions that count (the loss mask)."""
    width = max(len(s.tokens) for s in rollout.samples)
    tokens = torch.zeros(len(rollout.samples), width, dtype=torch.long)
    logprobs = torch.zeros(len(rollout.samples), width, dtype=torch.float64)
    compared = torch.zeros(len(rollout.samples), width)
    loss_mask = torch.zeros(len(rollout.samples), width)
    for i, sample in enumerate(rollout.samples):
        values, keep = sample.at_positions()
        n = len(sample.tokens)
        tokens[i, :n] = torch.tensor(sample.tokens)
        logprobs[i, :n] = torch.tensor(values, dtype=torch.float64)
        compared[i, :n] = torch.tensor(keep, dtype=torch.float32)
        loss_mask[i, :n] = torch.tensor(sample.label_mask(), dtype=torch.float32)
    return tokens, logprobs, compared, loss_mask
