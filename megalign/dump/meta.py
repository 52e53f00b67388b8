"""dump.json: what produced a dump. Dumper.close writes it last, on rank 0, once every rank's manifest is on disk."""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict
from importlib import metadata

from megalign import __version__
from megalign.dump.format import FORMAT, VERSION
from megalign.dump.layout import Layout
from megalign.spec import RunSpec


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_meta(spec: RunSpec, elapsed_s: float, stack: str = "megatron", **extra) -> dict:
    """dump.json of a megalign run: the spec it ran."""
    return dump_meta(stack, spec.mode, spec.layout, {
        "model": spec.model.to_dict(), "dtype": spec.dtype, "device": spec.device,
        "seq_len": spec.seq_len, "num_sequences": len(spec.tokens), "packed": spec.packed, "seed": spec.seed,
        "loss_norm": spec.loss_norm, "attention": spec.attention, "stats_only": spec.stats_only,
        "filter": spec.filter, "hf_checkpoint": spec.hf, "elapsed_s": round(elapsed_s, 3)}, **extra)


def dump_meta(stack: str, mode: str, layout: Layout, fields: dict, **extra) -> dict:
    """dump.json for any writer (a run, or megalign.Dumper): what every dump says, the writer's
    `fields`, when and with what it was made, then `extra`."""
    return {
        "format": FORMAT, "version": VERSION, "stack": stack, "mode": mode, "layout": asdict(layout),
        "world_size": layout.world_size, **fields,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"megalign": __version__, "torch": package_version("torch"),
                     "megatron-core": package_version("megatron-core"), "python": platform.python_version()},
        **extra,
    }
