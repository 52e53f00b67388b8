"""Megatron distributed checkpoints in and out (--save, --load), on the real SmolLM2 checkpoint.

Saved from its Hugging Face weights at TP=3 and loaded at CP=2 PP=2, resharded by megatron-core: the same
model to the last tensor. A checkpoint converted with two layers swapped is caught at the first of them. A
checkpoint of another model, a folder that is no checkpoint, an index that pickles code, a missing, empty or
truncated .distcp file and a --save onto a user's folder are each one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
from conftest import error_line, invoke
from planted import swap_layers
from smollm2 import compare, smollm2  # noqa: F401 (smollm2: a fixture)

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SWAPPED = (3, 5)
# The twin's loaded run dumps (and compare reads) the layers up to the swap and the outputs.
UP_TO_SWAP = r"^embedding(\.|$)|^decoder\.layers\.[0-5](\.|$)|^logits$|^loss$"


@pytest.fixture(scope="module")
def saved(dump, smollm2, tmp_path_factory):
    """(the checkpoint, the dump of the run that saved it): SmolLM2 from its HF folder at TP=3, --save."""
    folder = tmp_path_factory.mktemp("checkpoint") / "smollm2-tp3"
    return folder, dump("forward", "--hf", smollm2["real"], "--tp", "3", "--save", folder, *short(smollm2))


def short(smollm2) -> tuple:
    """SmolLM2's English tokens, 36 positions: as tests/stacks/smollm2.py's `run`."""
    return "--tokens", smollm2["real"] / "tokens.json", "--seq-len", "36"


def test_saved_at_tp3_and_loaded_at_cp2_pp2_every_tensor_agrees(saved, dump, smollm2, tmp_path):
    folder, from_hf = saved
    written = json.loads((folder / "megalign.json").read_text())
    assert written["model"]["num_layers"] == 30 and written["saved_from"]["layout"] == "tp=3 pp=1 cp=1"
    loaded = dump("forward", "--load", folder, "--cp", "2", "--pp", "2", *short(smollm2))  # no --config: megalign.json
    result, rows, summary = compare(tmp_path, from_hf, loaded)
    assert result.exit_code == 0, result.output
    assert summary["compared"] > 300 and all(r["status"] == "pass" for r in rows if r["metrics"])


def test_a_checkpoint_with_two_layers_swapped_is_caught_at_the_first(saved, dump, smollm2, tmp_path_factory,
                                                                      tmp_path):
    """A converter that mixed up two layers' indices, then --save: loaded, the first swapped layer diverges."""
    root = tmp_path_factory.mktemp("swapped")
    converted = swap_layers(smollm2["real"], root / "hf", *SWAPPED)
    folder = root / "checkpoint"
    dump("forward", "--hf", converted, "--save", folder, "--filter", "^loss$", *short(smollm2))
    loaded = dump("forward", "--load", folder, "--pp", "2", "--filter", UP_TO_SWAP, *short(smollm2))
    result, rows, summary = compare(tmp_path, saved[1], loaded, "--filter", UP_TO_SWAP)
    assert result.exit_code == 1, result.output
    assert summary["first_divergence"].startswith(f"activation decoder.layers.{SWAPPED[0]}."), summary
    before = [r for r in rows if r["name"].startswith(tuple(f"decoder.layers.{i}." for i in range(SWAPPED[0])))]
    assert before and all(r["status"] == "pass" for r in before)


def linked_copy(folder: Path, target: Path, but: str = "") -> Path:
    """The checkpoint's files linked into `target`, all but the one named `but`."""
    target.mkdir()
    for file in folder.iterdir():
        if file.name != but:
            (target / file.name).symlink_to(file)
    return target


def without_model_file(folder: Path, target: Path) -> Path:
    """The checkpoint as Megatron-LM leaves it: its files (linked), no megalign.json."""
    return linked_copy(folder, target, but="megalign.json")


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_a_damaged_distcp_file_is_one_line_before_the_run(saved, tmp_path, damage):
    """A copy cut short: the index names bytes its .distcp file does not hold (megatron-core's error was 80 lines)."""
    original = sorted(saved[0].glob("*.distcp"))[0]
    damaged = linked_copy(saved[0], tmp_path / "copy", but=original.name)
    kept = {"truncated": original.stat().st_size // 2, "empty": 0}.get(damage)
    if kept is not None:
        with open(original, "rb") as whole:
            (damaged / original.name).write_bytes(whole.read(kept))
    result = invoke("forward", "--load", damaged, "--out", tmp_path / "out")
    assert result.exit_code == 2
    expected = f"{original.name} is missing (its .metadata names it)" if kept is None else \
        f"{original.name} holds {kept} bytes of the"
    assert f"--load {damaged}: {expected}" in error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_a_wrong_config_for_a_checkpoint_is_exit_2(saved, tmp_path):
    folder = saved[0]
    result = invoke("forward", "--load", folder, "--config", TINY, "--out", tmp_path / "a")
    assert result.exit_code == 2
    assert f"--config {TINY} describes another model than the checkpoint" in error_line(result)
    bare = without_model_file(folder, tmp_path / "megatron-lm")
    result = invoke("forward", "--load", bare, "--out", tmp_path / "b")
    assert result.exit_code == 2 and "pass --config or --hf to describe its model" in error_line(result)
    # Without megalign.json, --config describes the model, and the checkpoint's index refutes it in the worker.
    result = invoke("forward", "--load", bare, "--config", TINY, "--out", tmp_path / "c")
    assert result.exit_code == 2, result.output
    assert "is [49152, 576] in the checkpoint and [128, 64] in model 'tiny': another model's checkpoint" \
        in error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron-lm"]


def test_an_index_that_pickles_code_is_refused_unrun(saved, tmp_path):
    """torch DCP's .metadata is a pickle: one that calls a function is refused before it can run."""
    planted = without_model_file(saved[0], tmp_path / "planted")
    (planted / ".metadata").unlink()
    ran = tmp_path / "ran"
    (planted / ".metadata").write_bytes(pickle.dumps(_Payload(str(ran))))
    result = invoke("forward", "--load", planted, "--config", TINY, "--out", tmp_path / "d")  # the index is read first
    assert result.exit_code == 2, result.output
    assert f"its .metadata holds {os.system.__module__}.system, which megalign does not unpickle" in error_line(result)
    assert not ran.exists() and not (tmp_path / "d").exists()


class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("what", ["hf", "dump", "empty"])
def test_load_of_a_folder_that_is_no_checkpoint_is_exit_2(saved, smollm2, tmp_path, what):
    folder = {"hf": smollm2["real"], "dump": saved[1], "empty": tmp_path / "empty"}[what]
    folder.mkdir(exist_ok=True)
    result = invoke("forward", "--load", folder, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"--load {folder} is not a Megatron distributed checkpoint" in error_line(result)


def megatron_lm_folder(root: Path, tracker: str, backend: str = "torch_dist") -> Path:
    """Megatron-LM's layout: the checkpoint in iter_0000100, named by latest_checkpointed_iteration.txt."""
    iteration = root / "iter_0000100"
    iteration.mkdir(parents=True)
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": backend, "sharded_backend_version": 1}))
    (iteration / ".metadata").write_bytes(b"")
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return root


@pytest.mark.parametrize("tracker, backend, expected", [
    ("100\n", "torch_dist", "iter_0000100"),
    ("last", "torch_dist", "expected an iteration number or 'release'"),
    ("100", "zarr", "a 'zarr' checkpoint; megatron-core reads torch_dist only"),
    ("7", "torch_dist", "is not a Megatron distributed checkpoint"),
])
def test_load_takes_megatron_lm_s_folder_to_its_latest_iteration(tmp_path, tracker, backend, expected):
    from megalign.errors import UserError
    from megalign.stacks.dist_checkpoint import checkpoint_folder

    root = megatron_lm_folder(tmp_path / "run", tracker, backend)
    if expected.startswith("iter_"):
        assert checkpoint_folder(root) == root / expected
        return
    with pytest.raises(UserError, match=re.escape(expected)):
        checkpoint_folder(root)


def test_save_onto_a_users_folder_is_exit_2_and_touches_nothing(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    result = invoke("forward", "--save", mine, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert f"--save {mine} exists and is not empty" in error_line(result)
    result = invoke("forward", "--save", tmp_path / "out", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "one inside the other" in error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "my notes"


def test_every_held_back_unpickling_target_still_exists():
    """What checkpoint.py replaces while a checkpoint is read: a megatron-core or torch upgrade that moves one
    fails here, not silently in a user's load."""
    from megalign.stacks.megatron.cpu_patches import install_import_stubs

    install_import_stubs()
    from megalign.stacks.megatron.checkpoint import HELD_BACK

    for target in HELD_BACK:
        module, name = target.split(":")
        assert hasattr(importlib.import_module(module), name), target


def small_checkpoint(folder: Path) -> Path:
    """A real torch DCP index and .distcp file, written in this process (world 1): what check_data_files reads."""
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # no process group: DCP says it saves as one process, as meant here
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=folder)
    return folder


def edit_index(folder: Path, **fields) -> None:
    """Every byte range of the checkpoint's .metadata given `fields` (relative_path, offset, length)."""
    index = pickle.loads((folder / ".metadata").read_bytes())
    index.storage_meta = None  # torch's own writer pickles its path (a PosixPath) there; megatron-core's, nothing
    index.storage_data = {key: dataclasses.replace(stored, **fields) for key, stored in index.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(index))


@pytest.mark.parametrize("fields, said", [
    ({"relative_path": "../outside.distcp"}, "names '../outside.distcp', not a file of the checkpoint's folder"),
    ({"relative_path": "OUTSIDE"}, "not a file of the checkpoint's folder"),  # the absolute path, made below
    ({"relative_path": "inner/__0_0.distcp"}, "names 'inner/__0_0.distcp', not a file of the checkpoint's folder"),
    ({"relative_path": ".."}, "names '..', not a file of the checkpoint's folder"),
    ({"relative_path": 7}, "names 7, not a file of the checkpoint's folder"),
    ({"offset": -1}, "gives '__0_0.distcp' offset -1 length"),
    ({"offset": "0"}, "gives '__0_0.distcp' offset '0' length"),
    ({"length": 1.5}, "gives '__0_0.distcp' offset 0 length 1.5, not byte counts"),
    ({"length": True}, "gives '__0_0.distcp' offset 0 length True, not byte counts"),
])
def test_an_index_naming_a_file_outside_load_or_no_byte_count_is_one_line(tmp_path, fields, said):
    """The index's file names were followed (`..`, an absolute path: files outside --load were read), and its
    fields of another type gave a traceback. Each is one line before the run."""
    from megalign.errors import UserError
    from megalign.stacks.dist_checkpoint import check_data_files

    folder = small_checkpoint(tmp_path / "checkpoint")
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(b"\0" * (1 << 16))  # a file outside that holds every byte: only its place is wrong
    if fields.get("relative_path") == "OUTSIDE":
        fields = {"relative_path": str(outside)}
    (folder / "inner").mkdir()
    (folder / "inner" / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    edit_index(folder)
    check_data_files(folder)  # as written: every byte it names is there
    edit_index(folder, **fields)
    with pytest.raises(UserError) as refused:
        check_data_files(folder)
    assert str(refused.value).startswith(f"--load {folder}: its .metadata ") and "\n" not in str(refused.value)
    assert said in str(refused.value), str(refused.value)
