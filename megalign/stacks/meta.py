"""dump.json of a megalign run: the spec it ran, in the words of dump/meta.py's dump_meta. Here, on the
run side, because dump/ (the format) knows nothing of RunSpec."""

from __future__ import annotations

from megalign.dump.meta import dump_meta
from megalign.spec import RunSpec


def run_meta(spec: RunSpec, elapsed_s: float, stack: str = "megatron", **extra) -> dict:
    """dump.json of a megalign run: the spec it ran."""
    return dump_meta(stack, spec.mode, spec.layout, {
        "model": spec.model.to_dict(), "dtype": spec.dtype, "device": spec.device,
        "seq_len": spec.seq_len, "num_sequences": len(spec.tokens), "packed": spec.packed, "seed": spec.seed,
        "loss_norm": spec.loss_norm, "attention": spec.attention, "stats_only": spec.stats_only or bool(spec.dump_only),
        **({"dump_only": spec.dump_only} if spec.dump_only else {}),
        **({"recompute": spec.recompute} if spec.recompute != "none" else {}),
        "filter": spec.filter, "hf_checkpoint": spec.hf, "elapsed_s": round(elapsed_s, 3)}, **extra)
