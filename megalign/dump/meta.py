"""dump.json: what produced a dump. Written last, by rank 0, once every rank's manifest is on disk."""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from megalign import __version__
from megalign.dump.format import DUMP_META, FORMAT, VERSION, write_json_atomic
from megalign.spec import RunSpec


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def write_dump_meta(spec: RunSpec, elapsed_s: float, stack: str = "megatron", **extra) -> None:
    write_meta(Path(spec.out), stack, spec.mode, asdict(spec.layout), spec.layout.world_size, {
        "model": spec.model.to_dict(), "dtype": spec.dtype, "device": spec.device,
        "seq_len": spec.seq_len, "num_sequences": len(spec.tokens), "packed": spec.packed, "seed": spec.seed,
        "loss_norm": spec.loss_norm, "attention": spec.attention, "stats_only": spec.stats_only,
        "filter": spec.filter, "hf_checkpoint": spec.hf, "elapsed_s": round(elapsed_s, 3)}, **extra)


def write_meta(out: Path, stack: str, mode: str, layout: dict, world_size: int, fields: dict, **extra) -> None:
    """dump.json for any writer (a run, or megalign.Dumper): what every dump says, the writer's
    `fields`, when and with what it was made, then `extra`."""
    write_json_atomic(out / DUMP_META, {
        "format": FORMAT, "version": VERSION, "stack": stack, "mode": mode, "layout": layout,
        "world_size": world_size, **fields,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"megalign": __version__, "torch": package_version("torch"),
                     "megatron-core": package_version("megatron-core"), "python": platform.python_version()},
        **extra,
    })
