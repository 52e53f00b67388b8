"""Write an sglang dump with sglang's own dumper at emulated ranks, as sglang's comparator tests
emulate them (test_e2e_demo.py's `_dump_rank`): the dumper's `_get_rank` patched to the rank, its
static meta given that rank's parallel info; a recompute status patched in where its megatron plugin
would detect one inside megatron's checkpointing.

`python sglang_ranks_writer.py SPEC.json`: SPEC is a list of runs, each with `out` (its folder),
`world_size` and `dumps`, each a dict of rank, name, tensor (a .pt file holding it), info
({"sglang": {...}} or {"megatron": {...}}: the parallel info under its plugin's name), and optionally
dims, recompute (original|recompute) and tags (keywords of dumper.dump, such as layer_id), in the
order they are dumped. Several runs are written by one process: sglang's import is slow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from sglang_writer import load_sglang_dumper


def main(spec_path: str) -> None:
    module = load_sglang_dumper()
    for run in json.loads(Path(spec_path).read_text()):
        write(module, run)


def write(module, spec: dict) -> None:
    out, dumpers = spec["out"], {}
    for item in spec["dumps"]:
        rank = item["rank"]
        if rank not in dumpers:
            dumpers[rank] = module._Dumper(config=module.DumperConfig(enable=True, dir=out, exp_name="exp"))
        dumpers[rank].__dict__["_static_meta"] = {
            "world_rank": rank, "world_size": spec["world_size"],
            **{f"{plugin}_parallel_info": info for plugin, info in item.get("info", {}).items()}}
        status = module._RecomputeStatus(item.get("recompute", "disabled"))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "_get_rank", lambda: rank)
            patch.setattr(module, "_detect_recompute_status", lambda: status)
            dumpers[rank].dump(item["name"], torch.load(item["tensor"], weights_only=True), dims=item.get("dims"),
                               **item.get("tags", {}))


if __name__ == "__main__":
    main(*sys.argv[1:])
