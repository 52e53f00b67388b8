"""A dump may come from anywhere: malformed or hostile ones are one line and exit 2, never a
traceback (which compare would report as exit 1, "diverged"), a hang, or a file read outside the dump.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compare_fixtures import CP1, CP2, copy_dump, perturb
from conftest import error_line, invoke
from safetensors.torch import save_file

SMALL = ("forward", "--filter", r"^decoder\.layers\.1\.mlp$|^logits$")  # a few tensors, quick to copy and read


def exit_2(result, message: str = "") -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and message in result.output, result.output


def edit_json(path: Path, change) -> None:
    raw = json.loads(path.read_text())
    changed = change(raw)
    path.write_text(json.dumps(raw if changed is None else changed))


def first_record(raw: dict) -> dict:
    return next(t for t in raw["tensors"] if t["kind"] != "input")


def swap_keys(a: dict, b: dict) -> None:
    a["key"], b["key"] = b["key"], a["key"]


@pytest.fixture
def victim(dump, tmp_path):
    return copy_dump(dump(*SMALL), tmp_path / "victim")


MANIFEST_EDITS = {
    "tensors a dict": (lambda m: m.update(tensors={"a": 1}), "tensors must be a list"),
    "tensors a string": (lambda m: m.update(tensors="x"), "tensors must be a list"),
    "tensors a list of ints": (lambda m: m.update(tensors=[1, 2]), "must be a JSON object"),
    "a record without name": (lambda m: first_record(m).__delitem__("name"), "name must be a non-empty string"),
    "file null": (lambda m: first_record(m).update(file=None), "needs a file (values) or stats"),
    "file an int": (lambda m: first_record(m).update(file=3), "file must be a non-empty string"),
    "file /etc/passwd": (lambda m: first_record(m).update(file="/etc/passwd"), "is not a file name inside"),
    "file in another dump": (lambda m: first_record(m).update(file="../../other/rank-00000/tensors-00000.safetensors"),
                             "is not a file name inside"),
    "dtype evil": (lambda m: first_record(m).update(dtype="evil"), "unknown dtype 'evil'"),
    "float16 said of fp32 data": (lambda m: first_record(m).update(dtype="float16"), "says float16"),
    "a key of another tensor": (lambda m: swap_keys(m["tensors"][0], first_record(m)), "but the manifest's record"),
    "an unknown kind": (lambda m: first_record(m).update(kind="weights"), "unknown kind 'weights'"),
    "a duplicate record": (lambda m: m["tensors"].append(dict(first_record(m))), "duplicate record"),
    "a manifest that is a list": (lambda m: [m], "must be a JSON object"),
    "a rank outside the layout": (lambda m: m.update(cp_rank=5), "outside the layout"),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS, ids=list(MANIFEST_EDITS))
def test_malformed_manifest_is_exit_2(dump, victim, edit):
    change, message = MANIFEST_EDITS[edit]
    edit_json(victim / "rank-00000" / "manifest.json", change)
    exit_2(invoke("compare", dump(*SMALL), victim), message)


META_EDITS = {
    "a list": (lambda m: [m], "must be a JSON object"),
    "no layout": (lambda m: m.__delitem__("layout"), "layout must be a JSON object"),
    "version 99": (lambda m: m.update(version=99), "version 99 is not supported"),
    "a world size the layout does not give": (lambda m: m.update(world_size=4), "not the product of the layout"),
    "rows a string": (lambda m: m.update(rows="x"), "rows must be a non-empty list"),
    "a row without lengths": (lambda m: m["rows"][0].__delitem__("lengths"), "one length per document"),
    "a document longer than its bounds": (lambda m: m["rows"][0].update(lengths=[10 ** 6]), "each document fit"),
    "bounds that fall": (lambda m: m["rows"][0].update(bounds=[0, 20, 10], lengths=[1, 1]), "bounds must rise"),
    "a negative bound": (lambda m: m["rows"][0].update(bounds=[0, -4]), "must be an integer >= 0"),
    "an unknown cp split": (lambda m: m.update(cp_split="zig"), "cp_split must be document or row"),
    # The run's dtype sets every threshold: without it each tensor's stored dtype did, and a bf16-stored
    # activation 10% off passed an fp32 comparison.
    "no dtype": (lambda m: m.__delitem__("dtype"), "dtype None is not one of fp16, bf16, fp32, fp64"),
    "a dtype that is no precision": (lambda m: m.update(dtype={"a": 1}), "dtype {'a': 1} is not one of"),
}


@pytest.mark.parametrize("edit", META_EDITS, ids=list(META_EDITS))
def test_malformed_dump_json_is_exit_2(dump, victim, edit):
    change, message = META_EDITS[edit]
    edit_json(victim / "dump.json", change)
    exit_2(invoke("compare", dump(*SMALL), victim), message)


@pytest.mark.parametrize("name", ["dump.json", "rank-00000/manifest.json"])
def test_non_utf8_json_is_exit_2(dump, victim, name):
    (victim / name).write_bytes(b"\xff\xfe{not json")
    exit_2(invoke("compare", dump(*SMALL), victim), "unreadable")


def test_a_tensor_file_whose_header_lies_is_exit_2(dump, victim):
    """Offsets past the end of the file, or not the size of the tensor they claim: read nothing, exit 2."""
    tensor_file = next((victim / "rank-00000").glob("*.safetensors"))
    raw = tensor_file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = [0, 10 ** 12]
    text = json.dumps(header).encode()
    tensor_file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])
    exit_2(invoke("compare", dump(*SMALL), victim), "unreadable tensor file")


def test_a_file_cut_short_inside_a_replica_is_exit_2(dump, tmp_path):
    """CP ranks hold every parameter gradient whole, rank 1's with rank 0's hash, so rank 1's bytes are never
    read: a file cut short inside them passed. Every record's bytes must lie in its file, read or not."""
    whole, cut = copy_dump(dump(*CP2), tmp_path / "whole"), copy_dump(dump(*CP2), tmp_path / "cut")
    assert invoke("compare", dump(*CP2), whole).exit_code == 0
    manifests = [json.loads((cut / f"rank-0000{r}" / "manifest.json").read_text()) for r in (0, 1)]
    replica = next(t for t in manifests[1]["tensors"] if t["name"] == "output_layer.weight")
    assert replica["hash"] == next(t for t in manifests[0]["tensors"] if t["name"] == "output_layer.weight")["hash"]
    tensor_file = cut / "rank-00001" / replica["file"]
    raw = tensor_file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + length])[replica["key"]]["data_offsets"]
    tensor_file.write_bytes(raw[:8 + length + (begin + end) // 2])
    exit_2(invoke("compare", dump(*CP2), cut), f"{tensor_file}: unreadable tensor file (tensor {replica['key']!r}: "
                                                f"data_offsets [{begin}, {end}] end past the file's")


def test_an_outside_tensor_is_never_read(dump, victim, tmp_path):
    """The outside file holds exactly the tensor the record names: reading it would pass."""
    manifest = json.loads((victim / "rank-00000" / "manifest.json").read_text())
    record = first_record(manifest)
    outside = tmp_path / "outside.safetensors"
    from megalign.dump.reader import DumpFiles

    dump_b = DumpFiles.open(victim)
    rank = dump_b.ranks[0]
    real = next(r for r in rank.records if r.order == record["order"])
    save_file({real.key: dump_b.load(rank, real)}, str(outside))
    record["file"] = "../../outside.safetensors"
    (victim / "rank-00000" / "manifest.json").write_text(json.dumps(manifest))
    exit_2(invoke("compare", dump(*SMALL), victim), "not a file name inside")
    # A link inside the rank folder that leads out is refused too.
    link = victim / "rank-00000" / "link.safetensors"
    link.symlink_to(outside)
    record["file"] = "link.safetensors"
    (victim / "rank-00000" / "manifest.json").write_text(json.dumps(manifest))
    exit_2(invoke("compare", dump(*SMALL), victim), "is not a regular file")


def test_a_rank_folder_linked_out_of_the_dump_is_refused(dump, victim, tmp_path):
    """A rank folder that is a link to another dump's: the other dump's tensors would be compared as this
    one's (the same run's here: it would pass). A link that stays inside the dump is followed."""
    rank = victim / "rank-00000"
    (victim / "ranks").mkdir()
    rank.rename(victim / "ranks" / "rank-00000")
    rank.symlink_to(Path("ranks") / "rank-00000")
    assert invoke("compare", dump(*SMALL), victim).exit_code == 0
    rank.unlink()
    rank.symlink_to(dump(*SMALL) / "rank-00000")
    exit_2(invoke("compare", dump(*SMALL), victim), f"{rank}: a link out of the dump (to {dump(*SMALL).resolve()}")
    rank.unlink()
    rank.symlink_to(rank.name)  # a link to itself
    exit_2(invoke("compare", dump(*SMALL), victim), f"{rank}: unreadable (")


# Clears the screen, turns the text red, then fakes the summary of a passing comparison on a line of its own.
HOSTILE_NAME = "decoder.layers.1.mlp\x1b[2J\x1b[31m\nall compared tensors within threshold [bold]"
HOSTILE_SHOWN = r"decoder.layers.1.mlp\x1b[2J\x1b[31m\nall compared tensors within threshold [bold]"


def test_a_name_from_a_dump_reaches_the_terminal_escaped(dump, tmp_path):
    """In the table's row (each format), the first-divergence line and an error line, the name is shown
    with its control characters written out (and rich's markup as text): it restyles nothing, adds no
    line of its own (a terminal's lines wrap between words, which may fold it)."""
    a, b = (copy_dump(dump(*SMALL), tmp_path / side) for side in "ab")
    kind = first_record(json.loads((a / "rank-00000" / "manifest.json").read_text()))["kind"]
    for side in (a, b):
        edit_json(side / "rank-00000" / "manifest.json", lambda m: first_record(m).update(name=HOSTILE_NAME))
    perturb(b, kind, HOSTILE_NAME, rank=0, scale=1.0)
    for fmt in ("table", "plain", "markdown"):
        result = invoke("compare", a, b, "--format", fmt)
        assert result.exit_code == 1, result.output
        lines = result.output.splitlines()
        assert "\x1b" not in result.output and not any(line.startswith("all compared") for line in lines), lines
        first = f"first divergence: {kind} {HOSTILE_SHOWN}"
        # a terminal's (the table's) lines wrap between words: there the line is read joined
        assert first in " ".join(" ".join(lines).split()) if fmt == "table" else first in lines, lines
        assert fmt == "table" or any(HOSTILE_SHOWN in line and "FAIL" in line for line in lines), lines
    edit_json(b / "rank-00000" / "manifest.json", lambda m: first_record(m).update(dtype="float16"))
    result = invoke("compare", a, b)
    assert HOSTILE_SHOWN in error_line(result) and result.output.count("\n") == 1, result.output


def test_a_fifo_named_as_the_tensor_file_does_not_hang(dump, victim):
    manifest = json.loads((victim / "rank-00000" / "manifest.json").read_text())
    os.mkfifo(victim / "rank-00000" / "fifo.safetensors")
    first_record(manifest)["file"] = "fifo.safetensors"
    (victim / "rank-00000" / "manifest.json").write_text(json.dumps(manifest))
    result = subprocess.run([sys.executable, "-m", "megalign", "compare", str(dump(*SMALL)), str(victim)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "is not a regular file" in result.stderr, result.stderr


def test_a_fifo_among_plain_files_is_skipped(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    save_file({"x": torch.ones(3)}, str(folder / "a.safetensors"))
    os.mkfifo(folder / "b.pt")
    result = subprocess.run([sys.executable, "-m", "megalign", "compare", str(folder), str(folder)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_plot_with_an_unknown_suffix_is_exit_2_before_comparing(dump, tmp_path):
    exit_2(invoke("compare", dump(*CP1), dump(*CP2), "--plot", tmp_path / "x.txt"), "must end in")
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("target", ["a_meta", "a_file", "b_rank"])
def test_outputs_inside_an_input_are_refused(dump, tmp_path, target):
    a, b = copy_dump(dump(*SMALL), tmp_path / "a"), copy_dump(dump(*SMALL), tmp_path / "b")
    path = {"a_meta": a / "dump.json", "a_file": a / "new.jsonl", "b_rank": b / "rank-00000" / "r.png"}[target]
    before = {p: p.read_bytes() for p in (a / "dump.json",)}
    option = "--plot" if path.suffix == ".png" else "--json"
    exit_2(invoke("compare", a, b, option, path), "is inside the input")
    assert {p: p.read_bytes() for p in before} == before
    assert not path.exists() or path.name == "dump.json"


@pytest.mark.parametrize("option", ["--json", "--export-worst"])
@pytest.mark.parametrize("target", ["manifest", "dump.json", "notes"])
def test_an_output_never_replaces_a_file_megalign_did_not_write(dump, tmp_path, option, target):
    """Another dump's files (not an input) and a user's notes are kept; the run is refused before comparing."""
    other = copy_dump(dump(*SMALL), tmp_path / "other")
    (tmp_path / "notes.txt").write_text("mine")
    path = {"manifest": other / "rank-00000" / "manifest.json", "dump.json": other / "dump.json",
            "notes": tmp_path / "notes.txt"}[target]
    before = path.read_bytes()
    args = ("--json", path) if option == "--json" else ("--export-worst", "1", path)
    kind = "report" if option == "--json" else "worst-sequences file"
    exit_2(invoke("compare", dump(*SMALL), dump(*SMALL), *args), f"{path} exists and is not a megalign {kind}")
    assert path.read_bytes() == before


def test_json_replaces_its_own_report_and_an_empty_file(dump, tmp_path):
    report, empty = tmp_path / "report.jsonl", tmp_path / "empty.jsonl"
    empty.touch()  # as `mktemp` leaves it
    for path in (report, report, empty):
        result = invoke("compare", dump(*SMALL), dump(*SMALL), "--json", path)
        assert result.exit_code == 0, result.output
        assert json.loads(path.read_text().splitlines()[-1])["record"] == "summary"


@pytest.mark.parametrize("shape", [[2 ** 31, 2 ** 31], [2 ** 59]])
def test_a_shape_larger_than_its_file_is_refused_before_allocating(dump, tmp_path, shape):
    """Claimed sizes past int64 (a torch overflow today) and past any machine's memory."""
    bad = copy_dump(dump(*CP1), tmp_path / "bad")
    edit_json(bad / "rank-00000" / "manifest.json", lambda raw: first_record(raw).update(shape=shape))
    exit_2(invoke("compare", dump(*CP1), bad), "more than the file holds")


def claim_a_huge_tensor(dump_dir: Path, name: str, shape: list[int], digest: str) -> None:
    """Point `name`'s record at a file of its own holding a float32 tensor of `shape`, sparse: every
    byte the manifest claims is there, none of it on the disk."""
    rank = dump_dir / "rank-00000"
    elements = math.prod(shape)
    header = json.dumps({"0": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * elements]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(rank / "huge.safetensors", "wb") as file:
        file.write(len(header).to_bytes(8, "little") + header)
        file.truncate(8 + len(header) + 4 * elements)

    def point(raw):
        record = next(t for t in raw["tensors"] if t["name"] == name)
        record.update(shape=shape, file="huge.safetensors", key="0", hash=digest)

    edit_json(rank / "manifest.json", point)


def test_a_tensor_larger_than_the_machines_memory_is_one_line(dump, tmp_path):
    """8e9 float32 elements (32 GB, more than the 24 GiB of these machines), shaped [1, 8e9] on one side
    and [2, 4e9] on the other: a pair of two shapes is not streamed window by window, so comparing it
    would need 64 GB at once. Exit 2 before allocating, and megalign.open's tensor() raises
    MemoryError (TooLarge) instead of being OOM-killed."""
    import megalign

    a, b = (copy_dump(dump(*CP1), tmp_path / side) for side in "ab")
    for side, digest, shape in ((a, "0" * 32, [1, 8_000_000_000]), (b, "1" * 32, [2, 4_000_000_000])):
        claim_a_huge_tensor(side, "output_layer.weight", shape, digest)
    exit_2(invoke("compare", a, b), "comparing param_grad output_layer.weight needs 59.6 GiB of memory at once")
    with pytest.raises(MemoryError, match="GiB of memory at once, more than the"):
        megalign.open(a).tensor("param_grad", "output_layer.weight")
