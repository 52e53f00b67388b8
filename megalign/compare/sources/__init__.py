"""The three kinds of input `megalign compare` reads, behind one interface.

A `Source` is a list of `Entry`s, one per logical tensor, each with a loader that returns the
whole tensor (reassembled from its rank shards where the format says how) as a `Value`. Nothing is
loaded until a loader is called, so a comparison holds only the tensors it is working on.

    megalign dump   a folder with dump.json and rank-*/manifest.json        (sources/megalign.py)
    sglang dump     `.pt` files written by sglang's dumper, one per tensor   (sources/sglang.py)
                    of a server: passes of batched requests   (sources/sglang_server_source.py)
    plain tensors   a `.safetensors` / `.pt` file or a folder of them        (sources/plain.py)
"""

from __future__ import annotations

from pathlib import Path

from megalign.compare.entries import Source
from megalign.errors import UserError


def open_source(path: Path) -> Source:
    """Detect what `path` is and open it; UserError (exit 2) when it is none of the three."""
    from megalign.compare.sources import megalign, plain, sglang, sglang_server_source
    from megalign.dump.reader import DumpFiles

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_file():
        return plain.open_plain(path)
    if not path.is_dir():
        raise UserError(f"{path}: neither a regular file nor a folder")
    if DumpFiles.is_dump(path) or any(path.glob("rank-*")):
        return megalign.open_megalign(path)
    sglang_dir = sglang.find_sglang_dir(path)
    if sglang_dir is not None and sglang_server_source.is_server_dump(sglang_dir):
        return sglang_server_source.open_server(path, sglang_dir)
    if sglang_dir is not None:
        return sglang.open_sglang(path, sglang_dir)
    if plain.tensor_files(path):
        return plain.open_plain(path)
    raise UserError(f"{path}: not a megalign dump, an sglang dump, or a folder of .safetensors/.pt tensors")
