"""dump.json: what produced a dump. Dumper.close writes it last, on rank 0, once every rank's manifest is on disk.
A megalign run's fields (its spec) are added on the run side, by stacks/meta.py: the format knows no RunSpec."""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict
from importlib import metadata

from megalign.dump.format import FORMAT, VERSION
from megalign.dump.layout import Layout


# dump.json's key for megatron-core's moe_router_bias_update_rate, where the dumped run's routers moved their
# expert_bias after every step (capture/megatron_router.py): said beside the dump in compare's report.
EXPERT_BIAS_UPDATE = "expert_bias_update_rate"


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def dump_meta(stack: str, mode: str, layout: Layout, fields: dict, **extra) -> dict:
    """dump.json for any writer (a run, or megalign.Dumper): what every dump says, the writer's
    `fields`, when and with what it was made, then `extra`."""
    return {
        "format": FORMAT, "version": VERSION, "stack": stack, "mode": mode, "layout": asdict(layout),
        "world_size": layout.world_size, **fields,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"megalign": package_version("megalign"), "torch": package_version("torch"),
                     "megatron-core": package_version("megatron-core"), "python": platform.python_version()},
        **extra,
    }
