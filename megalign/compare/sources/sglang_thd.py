"""THD packed rows of several sequences split over CP: each sequence zigzagged on its own.

A dims string `t[cp:zigzag] ...` names a token dim of sequences packed back to back; megatron's THD
split (TE's thd_get_partitioned_indices) cuts every sequence into 2*CP chunks and gives each CP rank its
two zigzag chunks of each. The sequences' bounds are the step's `cu_seqlens_q`, which megatron's
PackedSeqParams dumps (sglang's comparator reads them so too); the plan undoes the zigzag sequence by
sequence at them (dump/layout.py's cp_positions, as for megalign's own packed rows). `s[cp:zigzag]` is one
sequence: zigzagged over the whole dim. The same bounds are the step's one packed row (Entry.rows, `packed`):
compare lines its token tensors up with another side's by their real tokens (lineup.py), an sglang
server's requests among them.
"""

from __future__ import annotations

from typing import Optional

from megalign.dump.layout import BatchRow

BOUNDS = "cu_seqlens_q"
# megatron's PackedSeqParams, as sglang's dumper writes them: the batch's packing, read as its rows, not
# compared (the tokens they cut are).
PACKING = (BOUNDS, "cu_seqlens_kv", "qkv_format")


def token_dim(dims: str) -> Optional[int]:
    """The index of the dim `dims` names `t` (sequences packed back to back), None where there is none."""
    return next((index for index, token in enumerate(dims.split("#")[0].split()) if token.split("[")[0] == "t"),
                None)


def zigzag_on_tokens(dims: str) -> Optional[int]:
    """The token dim where `dims` zigzags it over CP (`t[cp:zigzag]`), else None."""
    index = token_dim(dims)
    return index if index is not None and "zigzag" in dims.split("#")[0].split()[index] else None


def packed_row(bounds: list[int]) -> list[BatchRow]:
    """The batch of a step whose sequences are packed at `bounds`: one row, every token real."""
    return [BatchRow(bounds=tuple(bounds), lengths=tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])))]


def sequence_bounds(bounds: Optional[list[int]], tokens: int, cp: int) -> tuple[int, ...]:
    """The bounds to undo the zigzag at, for a token dim of `tokens` positions in all; ValueError where
    the step recorded none or they do not cut that dim into sequences CP can split."""
    if bounds is None:
        raise ValueError(f"t[cp:zigzag] packs sequences: the step records no {BOUNDS} to undo each one's zigzag at")
    if bounds[0] != 0 or bounds[-1] != tokens or any(
            (end - start) % (2 * cp) for start, end in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"{BOUNDS} {bounds} do not cut the {tokens} tokens into sequences of multiples of "
                         f"2*CP={2 * cp}")
    return tuple(bounds)
