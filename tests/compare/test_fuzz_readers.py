"""Property-based fuzzing of the dump readers (hypothesis): whatever is changed in a valid dump,
compare gives a verdict (exit 0 or 1) or a one-line error (exit 2), never a traceback or a hang, and
never reads a file outside the dump.

The inputs are real: a megalign dump from the CLI, an sglang dump written by sglang's own dumper,
and plain tensor files. Each example mutates a fresh copy.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from compare_fixtures import CP2, sglang_dump  # noqa: F401  (a fixture)
from conftest import invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

SMALL = ("forward", "--cp", "2", "--filter", r"^decoder\.layers\.1\.mlp$|^logits$")
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

HOSTILE_STRINGS = st.sampled_from(["", ".", "..", "/etc/passwd", "../../outside.safetensors", "rank-00000",
                                   "tensors-00000.safetensors", "0", "float16", "activation", "param_grad", "\x00",
                                   "é", "s[cp:zigzag] b h[tp]", "x" * 300])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-(2 ** 63), 2 ** 63)
    | st.floats(allow_nan=True, allow_infinity=True) | HOSTILE_STRINGS | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5) | HOSTILE_STRINGS,
                                                                      children, max_size=3),
    max_leaves=6)


def places(value, path=()):
    """Every (path) to a value inside a JSON document."""
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from places(child, path + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from places(child, path + (index,))


def mutate(document, data):
    """Replace, delete or duplicate one value somewhere in `document`; return the new document."""
    path = data.draw(st.sampled_from(list(places(document))))
    if not path:
        return data.draw(JSON_VALUES)
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    action = data.draw(st.sampled_from(["replace", "delete", "duplicate"]))
    if action == "replace":
        parent[path[-1]] = data.draw(JSON_VALUES)
    elif action == "delete":
        del parent[path[-1]]
    elif isinstance(parent, list):
        parent.append(json.loads(json.dumps(parent[path[-1]])))
    else:
        parent[path[-1]] = [parent[path[-1]], parent[path[-1]]]
    return document


def escapes(folder: Path, name) -> bool:
    return isinstance(name, str) and not (folder / name).resolve().is_relative_to(folder.resolve())


def assert_verdict_or_one_line(result) -> None:
    assert result.exit_code in (0, 1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output


@pytest.fixture(scope="module")
def small(dump):
    return dump(*SMALL)


@SETTINGS
@given(data=st.data(), target=st.sampled_from(["dump.json", "rank-00000/manifest.json", "rank-00001/manifest.json"]))
def test_any_mutation_of_a_megalign_dumps_json(small, data, target):
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(shutil.copytree(small, Path(scratch) / "dump"))
        # An outside file that holds valid tensors: reading it instead of refusing would go unnoticed.
        shutil.copy(next((small / "rank-00000").glob("*.safetensors")), Path(scratch) / "outside.safetensors")
        document = mutate(json.loads((copy / target).read_text()), data)
        (copy / target).write_text(json.dumps(document))
        result = invoke("compare", small, copy)
        assert_verdict_or_one_line(result)
        if result.exit_code != 2 and target != "dump.json" and isinstance(document, dict):
            records = document.get("tensors") if isinstance(document.get("tensors"), list) else []
            rank_dir = copy / target.split("/")[0]
            assert not any(escapes(rank_dir, r.get("file")) for r in records if isinstance(r, dict)), result.output


@SETTINGS
@given(data=st.data())
def test_any_mutation_of_an_sglang_dumps_names_and_metadata(dump, sglang_dump, data):
    source = sglang_dump(dump(*CP2))
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(shutil.copytree(source, Path(scratch) / "sglang"))
        files = sorted(copy.rglob("*.pt"))
        victim = data.draw(st.sampled_from(files))
        if data.draw(st.booleans()):
            parts = victim.stem.split("___")
            index = data.draw(st.integers(0, len(parts) - 1))
            parts[index] = data.draw(st.sampled_from(["", "step=x", "rank=-1", "dump_index=0", "name=",
                                                      "name=grad__param__", "rank=99", parts[index] * 2]))
            victim.rename(victim.with_name("___".join(parts) + ".pt"))
        else:
            content = torch.load(victim, weights_only=True)
            meta = json.loads(json.dumps(content.get("meta", {}), default=str))
            content["meta"] = mutate(meta, data)
            torch.save(content, victim)
        assert_verdict_or_one_line(invoke("compare", dump(*CP2), copy))


@SETTINGS
@given(data=st.data())
def test_any_damage_to_plain_tensor_files(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("plain")
    save_file({"a": torch.randn(4, 3), "b": torch.arange(5)}, str(folder / "x.safetensors"))
    torch.save({"c": torch.ones(2), "d": {"e": torch.zeros(3)}}, folder / "y.pt")
    victim = folder / data.draw(st.sampled_from(["x.safetensors", "y.pt"]))
    raw = bytearray(victim.read_bytes())
    cut = data.draw(st.integers(0, len(raw)))
    action = data.draw(st.sampled_from(["truncate", "flip", "garbage"]))
    if action == "truncate":
        raw = raw[:cut]
    elif action == "flip" and raw:
        raw[min(cut, len(raw) - 1)] ^= data.draw(st.integers(1, 255))
    else:
        raw = data.draw(st.binary(max_size=64))
    victim.write_bytes(bytes(raw))
    reference = tmp_path_factory.mktemp("ref")
    save_file({"a": torch.randn(4, 3), "b": torch.arange(5)}, str(reference / "x.safetensors"))
    assert_verdict_or_one_line(invoke("compare", reference, folder))
