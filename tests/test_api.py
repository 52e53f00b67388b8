"""The Python API: megalign.open reads what compare reads, megalign.Dumper writes what compare reads.

Dumps come from real runs (the session's `dump` fixture) and from real scripts run as a user runs
them (`python script.py`, and under torchrun with two gloo ranks); they are compared with the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import megalign
from megalign.errors import UserError
from tests.conftest import invoke

REPO = Path(megalign.__file__).parent.parent

# A user's training script: a small model, one backward step, every rank's share of the batch. The
# loss is the whole batch's mean on every rank count (summed here, then the gradients summed over
# the ranks), so one process and two DP ranks compute the same numbers.
SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
import megalign

if "RANK" in os.environ:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
x = torch.randn(6, 8).chunk(world)[rank]
with megalign.Dumper(sys.argv[1]) as dumper:
    dumper.watch(model)
    with dumper.step(0):
        loss = model(x).square().sum() / 24
        loss.backward()
        for param in model.parameters():
            if world > 1:
                dist.all_reduce(param.grad)
if dist.is_initialized():
    dist.destroy_process_group()  # as torch asks of every script; without it gloo can abort at exit
"""


TORCHRUN_2 = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def run_script(tmp_path: Path, out: Path, *launcher: str, ok: bool = True) -> str:
    """SCRIPT dumping into `out`, as a user runs it (under `launcher`); its output. `ok`: it must succeed."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, *launcher, str(script), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_cp2_tensors_equal_cp1(dump):
    cp1, cp2 = megalign.open(dump("backward")), megalign.open(dump("backward", "--cp", "2"))
    names1, names2 = cp1.names("activation"), cp2.names("activation")
    # CP=2 runs megalign's zigzag attention, without the local attention's softmax and dropout modules.
    assert set(names2) <= set(names1)
    assert all(".core_attention." in name for _, name in set(names1) - set(names2))
    assert len(names2) > 20
    for kind, name in names2:
        a, b = cp1.tensor(kind, name), cp2.tensor(kind, name)
        assert a.device.type == "cpu" and a.shape == b.shape, name
        torch.testing.assert_close(b, a, msg=name)  # fp32 rounding: CP=2 sums in another order
    assert cp2.meta["layout"]["cp"] == 2 and cp1.meta["layout"]["cp"] == 1


def test_shards_of_a_cp2_tensor(dump):
    cp2 = megalign.open(dump("backward", "--cp", "2"))
    whole = cp2.tensor("activation", "decoder.layers.0.mlp")
    shards = cp2.shards("activation", "decoder.layers.0.mlp")
    assert [(s.rank, s.cp_rank, s.tp_rank, s.dp_rank, s.pp_rank) for s in shards] == [(0, 0, 0, 0, 0), (1, 1, 0, 0, 0)]
    assert all(s.sharding.seq_dim == 0 for s in shards)
    seq = whole.shape[0]
    pieces = [s.tensor() for s in shards]
    assert [list(p.shape) for p in pieces] == [s.shape for s in shards] == [[seq // 2, *whole.shape[1:]]] * 2
    # Rank 0 holds the first and last quarter of the sequence (megatron's zigzag).
    assert torch.equal(pieces[0], torch.cat([whole[:seq // 4], whole[-seq // 4:]]))


def test_a_dumps_layout_is_typed_and_prints_as_compare_prints_it(dump):
    cp2 = megalign.open(dump("backward", "--cp", "2"))
    assert (cp2.layout.tp, cp2.layout.cp, cp2.layout.dp, cp2.layout.sp) == (1, 2, 1, False)
    assert cp2.layout.describe() == "tp=1 pp=1 cp=2" and cp2.layout.describe() in cp2.description


def test_unknown_names_and_stats_only(dump, tmp_path):
    cp1 = megalign.open(dump("backward"))
    with pytest.raises(KeyError, match="close names: decoder.layers.0.mlp"):
        cp1.tensor("activation", "decoder.layers.0.mpl")
    with pytest.raises(KeyError, match="as kind 'activation'"):
        cp1.tensor("param_grad", "decoder.layers.0.mlp")
    stats = megalign.open(dump("backward", "--stats-only"))
    with pytest.raises(ValueError, match="statistics only"):
        stats.tensor("activation", "decoder.layers.0.mlp")
    assert stats.shards("activation", "decoder.layers.0.mlp")[0].stats["numel"] > 0

    save_file({"a.weight": torch.ones(2, 3)}, str(tmp_path / "plain.safetensors"))
    plain = megalign.open(tmp_path / "plain.safetensors")
    assert plain.names() == [(None, "a.weight")] and plain.meta == {}
    assert torch.equal(plain.tensor(None, "a.weight"), torch.ones(2, 3))
    with pytest.raises(ValueError, match="shards\\(\\) reads megalign dumps"):
        plain.shards(None, "a.weight")


def test_a_dumper_script_compares_with_the_cli(tmp_path):
    out = tmp_path / "mine"
    run_script(tmp_path, out)
    mine = megalign.open(out)
    assert mine.meta["steps"] == [0] and mine.meta["mode"] == "backward"
    assert ("activation", "0") in mine.names() and ("activation_grad", "2") in mine.names()
    assert ("param_grad", "2.weight") in mine.names()
    assert invoke("compare", out, out).exit_code == 0

    changed = tmp_path / "changed"
    subprocess.run(["cp", "-r", str(out), str(changed)], check=True)
    file = changed / "rank-00000" / "tensors-00000.safetensors"
    values = load_file(str(file))
    key = next(iter(values))
    values[key].view(-1)[0] += 1
    save_file(values, str(file))
    result = invoke("compare", out, changed)
    assert result.exit_code == 1, result.output


def test_two_dp_ranks_under_torchrun_equal_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_script(tmp_path, one)
    run_script(tmp_path, two, *TORCHRUN_2)
    assert megalign.open(two).meta["layout"]["dp"] == 2
    assert [s.dp_rank for s in megalign.open(two).shards("activation", "0")] == [0, 1]
    result = invoke("compare", one, two)
    assert result.exit_code == 0, result.output
    assert "10 compared, 10 passed, 0 failed\n" in result.output  # nothing missing on either side


def test_every_rank_stops_with_rank_zeros_refusal(tmp_path):
    """Under torchrun rank 0 claims the folder; where it refuses (a user's folder), rank 1 says why
    too, "rank 0: ...", instead of waiting for a dump that will not come."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    output = run_script(tmp_path, mine, *TORCHRUN_2, ok=False)
    assert "megalign.errors.UserError: rank 0: " in output and "not empty" in output
    assert [p.name for p in mine.iterdir()] == ["todo.txt"]


def test_dumper_refuses_a_folder_that_is_not_a_dump(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    before = sorted(tmp_path.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(UserError, match="not empty|not a megalign dump"):
            megalign.Dumper(mine, overwrite=overwrite)
    assert sorted(tmp_path.rglob("*")) == before and (mine / "todo.txt").read_text() == "keep me"


def test_dumper_leaves_nothing_on_failure_and_refuses_a_second_writer(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="the user's error"):
        with megalign.Dumper(out) as dumper:
            dumper.add("activation", "x", torch.ones(3))
            raise RuntimeError("the user's error")
    assert list(tmp_path.iterdir()) == []

    first = megalign.Dumper(out)
    with pytest.raises(UserError, match="another megalign run"):
        megalign.Dumper(out)
    first.add("loss", "loss", torch.tensor(1.5))
    first.close()
    assert megalign.open(out).tensor("loss", "loss").item() == 1.5
    with pytest.raises(ValueError, match="kind 'weights'"), megalign.Dumper(tmp_path / "other") as dumper:
        dumper.add("weights", "w", torch.ones(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_dumper_dump_is_judged_at_its_widest_float_dtype(tmp_path):
    """A bf16 mask beside fp32 activations: dump.json said bf16 (the narrowest), and every tensor got
    bf16's thresholds, so an activation 10% off passed. The widest float dtype is the run's."""
    h = torch.linspace(-1, 1, 64)
    for name, scale in (("a", 1.0), ("b", 1.1)):
        with megalign.Dumper(tmp_path / name) as dumper:
            dumper.add("activation", "h", h * scale)
            dumper.add("input", "mask", torch.ones(8, dtype=torch.bfloat16))
    assert megalign.open(tmp_path / "a").meta["dtype"] == "fp32"
    result = invoke("compare", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 1, result.output
    assert invoke("compare", tmp_path / "a", tmp_path / "a").exit_code == 0


def test_a_dump_json_that_cannot_be_written_leaves_nothing(tmp_path):
    """Rank 0's last write fails (here a folder sits where dump.json goes): no dump, and no staging
    folder left behind either."""
    out = tmp_path / "out"
    dumper = megalign.Dumper(out)
    dumper.add("loss", "loss", torch.tensor(1.0))
    (tmp_path / "out.partial" / "dump.json" / "in-the-way").mkdir(parents=True)
    with pytest.raises(OSError):
        dumper.close()
    assert list(tmp_path.iterdir()) == []


def test_the_private_torch_api_close_waits_on_still_counts_cpp_references():
    """Dumper.close() waits until gloo's thread has released rank 0's message buffer (a release at
    interpreter exit aborted FSDP2 scripts: dumper.py, _rank_zero_says), reading the buffer's C++
    reference count through torch's private Tensor._use_count: were it gone or meaningless, the wait
    would be too."""
    buffer = torch.zeros(4)
    alone = buffer._use_count()
    view = buffer[1:]  # a C++ reference to the buffer, as a collective's work holds one
    assert buffer._use_count() > alone
    del view
    assert buffer._use_count() == alone


class MaskedModel(torch.nn.Module):
    """A user's model called as `model(ids, mask)`: an embedding and a projection; the mask is for the
    loss (the caller's), as a causal LM's attention mask keeps pad tokens out of real tokens' outputs."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None):
        return self.proj(self.embed(input_ids))


def masked_step(out: Path, pad: int, mask_4d: bool = False, pads_in_loss: bool = False) -> None:
    """One step over two rows of 3 and 4 real tokens, right-padded to `pad`; `mask_4d`: the mask given
    as [batch, 1, seq, seq], as some models take it; `pads_in_loss`: the planted bug, pad tokens in the loss."""
    torch.manual_seed(0)
    model = MaskedModel()
    mask = (torch.arange(pad) < torch.tensor([[3], [4]])).long()
    ids = (torch.arange(1, 13).reshape(2, 6)[:, :pad] % 11).masked_fill(mask == 0, 0)  # the same real tokens
    given = mask[:, None, None, :].expand(2, 1, pad, pad) if mask_4d else mask
    with megalign.Dumper(out) as dumper:
        dumper.watch(model, batch_dim=0, seq_dim=1)
        with dumper.step(0):
            loss = (model(ids, given).sum(-1) * (1 if pads_in_loss else mask)).sum()
            dumper.add("loss", "loss", loss.detach())
            loss.backward()


def test_rows_a_dumper_cannot_read_are_dropped_with_a_warning_and_their_token_tensors_set_apart(tmp_path):
    """A 4D mask: the rows cannot be read from it. The step goes on (raised inside the hook, one
    rank would stop mid-step), the dump lands with `rows_unknown`, and compare sets apart the token
    tensors shaped unlike the other run's (padded to 6 against 4), comparing the rest: exit 0."""
    with pytest.warns(UserWarning, match=r"rows are not recorded \(attention_mask \[2, 1, 6, 6\]"):
        masked_step(tmp_path / "mask4d", pad=6, mask_4d=True)
    masked_step(tmp_path / "pad4", pad=4)
    assert megalign.open(tmp_path / "mask4d").meta["rows_unknown"].startswith("DP rank 0: attention_mask [2, 1, 6, 6]")
    result = invoke("compare", tmp_path / "mask4d", tmp_path / "pad4")
    assert result.exit_code == 0, result.output
    assert "APART   a token tensor of a dump whose rows were not recorded" in result.output
    assert "4 compared, 4 passed, 0 failed, 4 not lined up" in result.output


def test_a_divergence_beside_unrecorded_rows_is_still_caught(tmp_path):
    """Twin: the pad tokens counted in the loss of the run padded to 4: the loss, then the
    parameter gradients, differ; set apart are only the token tensors."""
    with pytest.warns(UserWarning):
        masked_step(tmp_path / "mask4d", pad=6, mask_4d=True)
    masked_step(tmp_path / "pad4_bug", pad=4, pads_in_loss=True)
    result = invoke("compare", tmp_path / "mask4d", tmp_path / "pad4_bug")
    assert result.exit_code == 1, result.output
    assert "first divergence: loss loss\n" in result.output


@pytest.mark.parametrize("keywords", [{}, {"stats_only": True}, {"dump_only": "0:^unused|^used.bias"}], ids=str)
def test_a_parameter_without_a_gradient_is_left_out_and_every_other_dumped(tmp_path, keywords):
    """A frozen layer's `.grad` is None, an unused one's all zeros (what an untouched DDP main_grad
    holds): neither is a gradient to compare; the used layer's are dumped (one read-back for all;
    stats-only, their statistics say which are all zero, at close; zoomed, with values, the unused one
    is left out as a stats-only dump leaves it out: it was kept, a false 'missing' against one)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "frozen": torch.nn.Linear(4, 4),
                                 "unused": torch.nn.Linear(4, 4)})
    model["frozen"].requires_grad_(False)
    with megalign.Dumper(tmp_path / "out", **keywords) as dumper:
        dumper.watch(model, outputs=False)
        with dumper.step(0):
            model["unused"].weight.grad = torch.zeros(4, 4)
            (model["used"](torch.randn(2, 4)) + model["frozen"](torch.randn(2, 4))).sum().backward()
    dump = megalign.open(tmp_path / "out")
    assert sorted(name for kind, name in dump.names() if kind == "param_grad") == ["used.bias", "used.weight"]
