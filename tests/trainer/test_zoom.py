"""The zoom recipe in a user's loop (tests/trainer/mlp_train.py, megalign's public API only): a stats-only
pass over every step and tensor, compared; then both loops again with MEGALIGN_DUMP_ONLY=STEP:REGEX as
compare proposes it, whose comparison gives the first divergence in full values. The rule's own text
(dump/zoom.py), and which tensors a zoom takes (compare/zoom.py), are tested here too."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

import megalign
from megalign.compare.pipeline import compare_paths
from megalign.compare.thresholds import Thresholds
from megalign.compare.lineup import UNLINED_STATS
from megalign.compare.entries import Entry, Source
from megalign.compare.records import FAIL, NOT_REASSEMBLABLE, PASS, Report, Row, Summary, Verdict
from megalign.compare.zoom import unlined, zoom_around
from megalign.dump.format import Kind
from megalign.dump.zoom import FullValues, full_values
from megalign.errors import UserError
from megalign.sizes import parse_bytes
from tests.conftest import invoke
from tests.trainer import mlp_train

ZOOMED = {"layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "loss", "layers.4.weight", "layers.4.bias"}


def run(monkeypatch, out, bug: bool = False, **env: str) -> None:
    """mlp_train.py as `MEGALIGN_DUMP=out ENV... python mlp_train.py [--bug]` runs it."""
    with monkeypatch.context() as m:
        for variable, value in {"MEGALIGN_DUMP": str(out), **env}.items():
            m.setenv(variable, value)
        mlp_train.main(["--bug"] if bug else [])


def records(report) -> dict[tuple[str, str], dict]:
    rows = map(json.loads, report.read_text().splitlines())
    return {(row["kind"], row["name"]): row for row in rows if row["record"] == "tensor"}


def test_a_loop_zoomed_where_its_stats_diverge_shows_the_divergence_in_full_values(tmp_path, monkeypatch):
    run(monkeypatch, tmp_path / "a", MEGALIGN_STATS_ONLY="1")
    run(monkeypatch, tmp_path / "b", bug=True, MEGALIGN_STATS_ONLY="1")
    stats = invoke("compare", tmp_path / "a", tmp_path / "b")
    assert stats.exit_code == 1, stats.output
    assert "first divergence: activation step1/layers.4\n" in stats.output
    rule = shlex.split(re.search(r"MEGALIGN_DUMP_ONLY=(\S+)", stats.output).group(1))[0]
    assert rule.startswith("1:") and full_values(rule).wants(1, "layers.4.weight")

    for name, bug in (("a-zoom", False), ("b-zoom", True), ("a-zoom-again", False)):
        run(monkeypatch, tmp_path / name, bug=bug, MEGALIGN_DUMP_ONLY=rule)
    dump = megalign.open(tmp_path / "a-zoom")
    full = [name for kind, name in dump.names() if dump.shards(kind, name)[0].stats is None]
    assert set(full) == {f"step1/{name}" for name in ZOOMED}
    assert len(full) == 13  # 5 outputs and their gradients, the loss, layer 4's 2 parameter gradients
    assert len(dump.names()) == 75  # every other tensor is there, as statistics
    zoomed = invoke("compare", tmp_path / "a-zoom", tmp_path / "b-zoom", "--json", tmp_path / "zoom.jsonl")
    assert zoomed.exit_code == 1, zoomed.output
    assert "first divergence: activation step1/layers.4\n" in zoomed.output and "zoom in:" not in zoomed.output
    rows = records(tmp_path / "zoom.jsonl")
    first = rows["activation", "step1/layers.4"]
    assert first["first_divergence"] and first["metrics"]["mode"] == "values" and first["metrics"]["max_abs_diff"] > 0
    assert rows["activation", "step0/layers.4"]["metrics"]["mode"] == "stats"
    # A zoomed dump against a stats-only one: nothing missing, the same first divergence.
    mixed = invoke("compare", tmp_path / "a", tmp_path / "b-zoom")
    assert mixed.exit_code == 1 and "missing" not in mixed.output
    assert "first divergence: activation step1/layers.4\n" in mixed.output
    # The agreeing twin: the loop without the bug, zoomed alike, agrees in full values.
    same = invoke("compare", tmp_path / "a-zoom", tmp_path / "a-zoom-again")
    assert same.exit_code == 0, same.output


def test_the_rule_reads_a_step_and_a_regex_or_a_regex_alone():
    """(A bad regex in MEGALIGN_DUMP_ONLY: test_from_env.py's one-line errors.)"""
    assert full_values("1:^layers\\.4$") == FullValues(1, "^layers\\.4$")
    assert full_values("layers:4") == FullValues(None, "layers:4")
    assert str(full_values("12:a|b")) == "12:a|b" and not full_values("12:a|b").wants(11, "a")
    with pytest.raises(UserError, match=r"^--dump-only: '\(' is not a valid regular expression"):
        full_values("3:(", "--dump-only")


class Net(torch.nn.Module):
    """A head over a block of two layers; `bug` doubles its output, first seen at `net` itself."""

    def __init__(self, bug: bool):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 4)
        self.bug = bug

    def forward(self, x):
        return self.head(self.inner(x)) * (2 if self.bug else 1)


def test_a_divergence_at_a_whole_model_zooms_its_own_and_its_direct_submodules_parameters(tmp_path):
    """Not every layer's below them: a model's output first off would zoom the whole model's gradients."""
    for name, bug in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"net": Net(bug)})
        with megalign.Dumper(tmp_path / name) as dumper:
            dumper.watch(model)
            with dumper.step(0):
                model["net"](torch.ones(2, 4)).sum().backward()
    report = compare_paths(tmp_path / "a", tmp_path / "b", None, Thresholds.from_cli(None, [])).report
    zoom = zoom_around(report)
    assert report.rows[report.first_divergence].name == "net"
    assert zoom.step == 0 and "net" in zoom.names and zoom.names[-2:] == ("net.head.weight", "net.head.bias")
    assert not any(name.startswith("net.inner.") and name.endswith(("weight", "bias")) for name in zoom.names)


def test_token_tensors_a_stats_only_pass_could_not_line_up_are_counted_and_others_are_not():
    """check --zoom refuses runs whose rows differ (packed against padded): their token tensors are
    NOT_REASSEMBLABLE in its stats-only pass, and would be again outside any zoom."""
    def row(index: int, status: str, *notes: str) -> Row:
        return Row.of(index, Kind.ACTIVATION, f"t{index}", None, Verdict(status=status, notes=list(notes)))

    rows = [row(0, PASS), row(1, NOT_REASSEMBLABLE, f"A: {UNLINED_STATS}", f"B: {UNLINED_STATS}"),
            row(2, NOT_REASSEMBLABLE, "A: shard 1 missing"), row(3, FAIL)]
    assert unlined(rows) == 1
    assert unlined([row(0, PASS), row(2, NOT_REASSEMBLABLE, "A: shard 1 missing")]) == 0


def window(*rows: tuple[str, str, list[int], str], first: int):
    """A stats-only report of one step's `rows` (kind, name, shape, dtype), diverging first at row `first`."""
    entries = [Entry(kind, name, (i,), None, load=None, step=None) for i, (kind, name, _, _) in enumerate(rows)]
    made = [Row.of(i, kind, name, None, Verdict(status=FAIL if i >= first else PASS, shape_a=shape, shape_b=shape,
                                                 dtype_a=dtype, dtype_b="float32"))
            for i, (kind, name, shape, dtype) in enumerate(rows)]
    source = Source(Path("a"), "megalign", "", entries)
    return Report(source, source, made, Summary.of(made, first, [], []), first)


GIB = 1 << 30
ATTENTION = [  # a layer at an 8B model's shape in bf16 (the target fp32), forward then backward
    (Kind.ACTIVATION, "l.qkv", [2, 4096, 6144], "bfloat16"),
    (Kind.ACTIVATION, "l.core_attention.softmax", [2, 32, 4096, 4096], "bfloat16"),
    (Kind.ACTIVATION, "l.core_attention", [2, 4096, 4096], "bfloat16"),
    (Kind.ACTIVATION, "l.proj", [2, 4096, 4096], "bfloat16"),
    (Kind.ACTIVATION_GRAD, "l.proj", [2, 4096, 4096], "bfloat16"),
    (Kind.ACTIVATION_GRAD, "l.core_attention", [2, 4096, 4096], "bfloat16"),
    (Kind.ACTIVATION_GRAD, "l.core_attention.softmax", [2, 32, 4096, 4096], "bfloat16"),
    (Kind.ACTIVATION_GRAD, "l.qkv", [2, 4096, 6144], "bfloat16"),
]


def test_a_window_tensor_past_the_budget_stays_stats_only_and_the_zoom_names_it():
    """The attention probabilities (4 GiB each in fp32, twice: their gradient bears their name) filled
    26 of the first 8B zoom's 27 GB; every other name of the window fits 2 GiB a run."""
    zoom = zoom_around(window(*ATTENTION, first=7))
    assert zoom.names == ("l.qkv", "l.core_attention", "l.proj")
    assert zoom.nbytes == 2 * 4 * 2 * 4096 * (6144 + 4096 + 4096) == 7 * GIB // 8
    assert [(left.name, left.nbytes) for left in zoom.left_out] == [("l.core_attention.softmax", 8 * GIB)]
    assert zoom.line() == ("zoomed: tensors l.qkv..l.proj (3 names), full values (896.0 MiB a run); the rest "
                           "stats-only; past the zoom's 2.0 GiB budget, stats-only: l.core_attention.softmax (8.0 GiB)")
    assert not zoom.rule.wants(None, "l.core_attention.softmax") and zoom.rule.wants(None, "l.core_attention")
    assert zoom.past_budget() == "; past the zoom's 2.0 GiB budget, stats-only: l.core_attention.softmax (8.0 GiB)"


def test_the_budget_keeps_the_nearest_first_and_the_first_divergence_whatever_its_size():
    # Nearest by record: core_attention's gradient lies 2 records from the first, proj's 3.
    nearest = zoom_around(window(*ATTENTION, first=7), budget=700 << 20)
    assert nearest.names == ("l.qkv", "l.core_attention")
    assert [left.name for left in nearest.left_out] == ["l.core_attention.softmax", "l.proj"]
    # The divergence at the probabilities themselves: zoomed past any budget, and nothing else is.
    alone = zoom_around(window(*ATTENTION, first=6), budget=0)
    assert alone.names == ("l.core_attention.softmax",) and alone.nbytes == 8 * GIB
    assert {left.name for left in alone.left_out} == {"l.qkv", "l.core_attention", "l.proj"}
    # An fp64 reference run costs 8 bytes an element: the widest run is what a budget bounds.
    assert len(zoom_around(window(*ATTENTION, first=7), budget=GIB).names) == 3
    assert zoom_around(window(*ATTENTION, first=7), budget=GIB, itemsize=8).names == ("l.qkv",)
    assert "past the zoom's" not in zoom_around(window(*ATTENTION, first=7), budget=100 * GIB).line()


def test_a_size_reads_in_bytes_and_binary_or_decimal_units():
    assert [parse_bytes(text, "--zoom-budget") for text in ("2GiB", "500MB", "1e9", "0", "1.5 kib")] == \
        [2 * GIB, 500 * 10**6, 10**9, 0, 1536]
    for bad in ("", "2 parsecs", "-1GiB", "nan", "1.2.3GB"):
        with pytest.raises(UserError, match=r"^--zoom-budget: expected a size such as 2GiB"):
            parse_bytes(bad, "--zoom-budget")
