"""A stats-only record's sketch: K seeded random projections of the whole tensor (a CountSketch), so
that compare can estimate how far apart two runs' tensors are from a few hundred bytes each.

Every element, at its flat index g in the WHOLE tensor, is hashed (splitmix64's finalizer of g and a
fixed seed) to one of K buckets and a sign; bucket j holds the signed sum of its elements, in float64.
The hash depends on g alone, so each rank sketches its own shard at the positions it has in the
whole (placement.py) and the whole's sketch is the plain sum of its shards' (TP, CP zigzag, SP, DP,
partial sums); every rank and run shares the seed. NaN and Inf are left out: the statistics count them.

For two tensors a and b, ||S(a) - S(b)||^2 estimates ||a - b||^2 without bias, with a relative
standard deviation of at most sqrt(2/K) (CountSketch's second moment: 2/K * (||d||^4 - sum d^4) /
||d||^4), as dense +-1 projections would; one hash an element, not K, so the CPU pass costs the same
for any K.

K = 128: the estimate's relative std is then 12.5% and, for a difference spread over many elements
(chi-square with K degrees of freedom), it is low by a factor of 2 about once in two million tensors
and high by one far more rarely (Wilson-Hilferty); a record's sketch is 1 KiB of float64, stored as
base64 (1.4 KB of manifest). At K = 64 (18%) a factor 2 low comes once in 3,000 tensors: several
times in one stats-only compare of a large model (1,046 records a step of an 8B model's backward).

A difference confined to a few elements can cancel in one bucket: two swapped elements share a
bucket and a sign with probability 1/(2K), and the sketch then sees nothing; so do the statistics
(the norm, mean, min and max stay), so a stats-only PASS is an estimate, not a proof. One element
changed alone never cancels.
"""

from __future__ import annotations

import base64
import math
from typing import Iterable, Optional

import numpy as np
import torch

K = 128  # buckets: a power of 2 (a bucket is the hash's low bits)
SEED = 0x6D6567616C69676E  # "megalign"
# splitmix64's finalizer constants, and as int64 (torch has no uint64 multiply)
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_SIGNED = [c - (1 << 64) if c >= 1 << 63 else c for c in (SEED, M1, M2)]
ROWS_AT_ONCE = 1 << 22  # elements hashed at a time by torch's ops on a device (int64 temporaries of 32 MiB)


def encode(values: np.ndarray) -> str:
    """The manifest's form: the K float64 values, little-endian, base64 (exact, and 20x faster to
    write than JSON's numbers)."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f8").tobytes()).decode("ascii")


def decode(text: str) -> Optional[np.ndarray]:
    """encode's values back; None where `text` is not K float64 values."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        return None
    if len(raw) != K * 8:
        return None
    return np.frombuffer(raw, dtype="<f8").astype(np.float64)


def combine(sketches: Iterable[np.ndarray]) -> Optional[np.ndarray]:
    """The whole's sketch from its pieces' (each at its own positions): their sum, or None (finite)."""
    total = np.zeros(K, dtype=np.float64)
    for sketch in sketches:
        total += sketch
    return finite(total)


def finite(sketch: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """The sketch, or None where a bucket overflowed (an fp64 run's values near 1e308 sum past it): no
    sketch, rather than a record or a dump the reader rejects; the statistics judge it then."""
    return sketch if sketch is not None and bool(np.isfinite(sketch).all()) else None


def rows_and_cols(whole: tuple[int, ...], where: list[torch.Tensor],
                  device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard's elements' flat indexes in the whole, as (base of each of its rows, position of each
    of its columns), int64 on `device`: element (r, c) of the shard (its last dim the columns) is at
    base[r] + cols[c]. `where`: each dim's positions in the whole (placement.positions)."""
    if not where:  # a scalar
        return tuple(queued(torch.zeros(1, dtype=torch.int64), device) for _ in range(2))
    strides = [math.prod(whole[d + 1:]) for d in range(len(whole))]
    base = torch.zeros((), dtype=torch.int64)
    for d in range(len(where) - 1):
        base = base.unsqueeze(-1) + where[d].to(torch.int64) * strides[d]
    return queued(base.reshape(-1), device), queued(where[-1].to(torch.int64), device)


def queued(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, the copy queued behind the step's kernels from page-locked memory: torch
    copies pageable memory to a GPU by waiting for the whole queue first."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def hashes(g: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of g + SEED, as int64 (wrapping), on g's device: host_kernels' hash."""
    seed, m1, m2 = _SIGNED
    x = g + seed
    x = (x ^ _shift(x, 30)) * m1
    x = (x ^ _shift(x, 27)) * m2
    return x ^ _shift(x, 31)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def device_sketch(x: torch.Tensor, base: torch.Tensor, cols: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The sketch of flat `x` (its rows of len(cols), each at base[r] + cols; both on x's device) added
    into `out` ([K] float64 on x's device) with torch's ops, queued without waiting: the device's
    path where its Triton kernel cannot run (device_kernels.py takes it in the statistics' own pass).
    Whole rows at a time, ROWS_AT_ONCE elements or fewer (a longer row, a big 1-D tensor's, in
    pieces), each element's place one broadcast add: about twenty kernels a block, where taking
    each element's row and column by division cost five more."""
    width = cols.numel()
    rows, span = max(1, ROWS_AT_ONCE // max(width, 1)), min(width, ROWS_AT_ONCE)
    matrix = x.view(-1, width) if width else x.view(0, 0)
    for r in range(0, matrix.shape[0], rows):
        for c in range(0, width, span):
            block = matrix[r:r + rows, c:c + span].double().reshape(-1)
            h = hashes((base[r:r + rows, None] + cols[None, c:c + span]).reshape(-1))
            signed = torch.nan_to_num(block, nan=0.0, posinf=0.0, neginf=0.0) * ((h >> 63) | 1)  # NaN, Inf: none
            out.index_add_(0, h & (K - 1), signed)
    return out
