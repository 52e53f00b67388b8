"""What a Dumper's tensors are named and judged as, in a user's loop: a module's calls, names given
twice, and the precision the step computed in.

Each loop is written as a user writes it: megalign.Dumper's public API around a small torch model,
each run's dump compared with the real CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megalign
from megalign.dump.format import MANIFEST
from tests.conftest import error_line, invoke


def micro_batches(out: Path, *, one_backward: bool, second_scaled: float = 1.0) -> None:
    """One step of two micro-batches: one backward of the summed loss, or a backward after each (the
    same gradients); `second_scaled`: the planted bug, the second micro-batch's loss scaled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    batches = torch.randn(2, 3, 4)
    with megalign.Dumper(out) as dumper:
        dumper.watch(model)
        with dumper.step(0):
            losses = (model(x).square().sum() * scale for x, scale in zip(batches, (1.0, second_scaled)))
            if one_backward:
                sum(losses).backward()
            else:
                for loss in losses:
                    loss.backward()


def test_activation_gradients_take_the_name_of_their_forward_call(tmp_path):
    """Backward reaches the second micro-batch's outputs first: named in that order, every activation
    gradient of one backward of the summed loss failed against a backward after each micro-batch."""
    micro_batches(tmp_path / "summed", one_backward=True)
    micro_batches(tmp_path / "each", one_backward=False)
    result = invoke("compare", tmp_path / "summed", tmp_path / "each")
    assert result.exit_code == 0, result.output
    assert "16 compared, 16 passed, 0 failed\n" in result.output
    # The failing twin: the second micro-batch's loss scaled fails at its gradients, the first's pass.
    micro_batches(tmp_path / "scaled", one_backward=False, second_scaled=1.5)
    result = invoke("compare", tmp_path / "summed", tmp_path / "scaled")
    assert result.exit_code == 1, result.output
    assert "first divergence: activation_grad 2@1\n" in result.output
    assert "16 compared, 9 passed, 7 failed\n" in result.output  # the 3 of call @1 and the 4 parameters'


def test_a_module_called_twice_gets_each_call_s_gradient_under_its_name(tmp_path):
    """The second call's gradient comes first in backward: it was recorded as the first call's."""
    torch.manual_seed(0)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.block(torch.tanh(self.block(x)))

    model = Twice()
    with megalign.Dumper(tmp_path / "out") as dumper:
        dumper.watch(model)
        with dumper.step(0):
            out = model(torch.randn(3, 4))
            out.square().sum().backward()
    dump = megalign.open(tmp_path / "out")
    assert torch.equal(dump.tensor("activation", "block@1"), out.detach())
    torch.testing.assert_close(dump.tensor("activation_grad", "block@1"), 2 * out.detach())
    assert not torch.allclose(dump.tensor("activation_grad", "block"), 2 * out.detach())


def test_a_name_that_reads_as_a_repeat_is_refused(tmp_path):
    """`x` added twice is read back as x and x@1: a literal `x@1` beside them fell into the repeat's
    entry, and one of the two was never compared (3 tensors, "2 compared, 2 passed"). The Dumper
    refuses such a name; a dump written before it did is refused whole (exit 2): which tensor is
    which cannot be told."""
    for steps in ("all", [1]):  # refused at once, outside the step chosen too: not first in it
        with pytest.raises(ValueError, match="activation 'x@1' ends as megalign names a name's repeats"):
            with megalign.Dumper(tmp_path / "refused", steps=steps) as dumper:
                dumper.add("activation", "x", torch.ones(2))
                dumper.add("activation", "x@1", torch.zeros(2))
        assert list(tmp_path.iterdir()) == []
    with megalign.Dumper(tmp_path / "older") as dumper:  # as an older megalign wrote it
        for name, value in (("x", 1.0), ("x", 2.0), ("x_1", 3.0)):
            dumper.add("activation", name, torch.full((2,), value))
    manifest = tmp_path / "older" / "rank-00000" / MANIFEST
    manifest.write_text(manifest.read_text().replace('"x_1"', '"x@1"'))
    result = invoke("compare", tmp_path / "older", tmp_path / "older")
    assert result.exit_code == 2, result.output
    assert error_line(result).endswith("tensors[2]: name: 'x@1' ends as megalign names a name's repeats "
                                       "(name@1, name@2, ...): give it another name")
    # Names given twice, and nothing else, are read back as before, against themselves too.
    with megalign.Dumper(tmp_path / "twice") as dumper:
        for value in (1.0, 2.0):
            dumper.add("activation", "x", torch.full((2,), value))
    assert megalign.open(tmp_path / "twice").tensor("activation", "x@1").tolist() == [2.0, 2.0]
    assert invoke("compare", tmp_path / "twice", tmp_path / "twice").exit_code == 0


def test_a_watched_name_that_reads_as_a_repeat_is_refused_at_watch(tmp_path):
    """A ModuleDict key `expert@1` names the module's output as a repeat reads: add() refused it from a
    forward hook, in the middle of the run. watch() refuses it, and a parameter named so (its gradient
    is added at each step's end), before anything is hooked; the Dumper is aborted, nothing left."""
    experts = torch.nn.ModuleDict({"expert@1": torch.nn.Linear(2, 2)})
    scaled = torch.nn.Linear(2, 2)
    scaled.register_parameter("scale@2", torch.nn.Parameter(torch.ones(2)))
    for model, outputs, refused in ((experts, True, "module 'expert@1'"), (scaled, False, "parameter 'scale@2'")):
        dumper = megalign.Dumper(tmp_path / "run")
        with pytest.raises(ValueError, match=rf"watch\(\): the {refused} ends as megalign names a name's repeats"):
            dumper.watch(model, outputs=outputs)
        assert list(tmp_path.iterdir()) == [] and not experts["expert@1"]._forward_hooks


class Down(torch.nn.Linear):
    """A linear layer as TP=2 computes it (`parts=2`): each rank's half of the input features
    multiplied, the halves summed; `planted`: the bug, the second half scaled."""

    def __init__(self, *shape: int, parts: int, planted: float = 1.0):
        super().__init__(*shape)
        self.parts, self.planted = parts, planted

    def forward(self, x):
        pieces = zip(x.chunk(self.parts, -1), self.weight.chunk(self.parts, -1), (1.0, self.planted))
        return sum(torch.nn.functional.linear(xk, wk) * scale for xk, wk, scale in pieces) + self.bias


def autocast_step(out: Path, parts: int, planted: float = 1.0) -> None:
    """One bf16 autocast step of a small MLP whose middle linear is computed in `parts`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), Down(64, 64, parts=parts, planted=planted),
                                torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32)
    with megalign.Dumper(out) as dumper:
        dumper.watch(model)
        with dumper.step(0):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            dumper.add("loss", "loss", loss.detach())
            loss.backward()


def test_an_autocast_step_is_judged_at_bf16(tmp_path):
    """Its parameter gradients are fp32, and dump.json said fp32 (the widest dtype recorded): bf16's
    rounding of a matmul split as TP=2 splits it failed at fp32's thresholds (10 of 17 tensors)."""
    autocast_step(tmp_path / "whole", parts=1)
    autocast_step(tmp_path / "halves", parts=2)
    assert megalign.open(tmp_path / "halves").meta["dtype"] == "bf16"
    result = invoke("compare", tmp_path / "whole", tmp_path / "halves")
    assert result.exit_code == 0, result.output
    assert "17 compared, 17 passed, 0 failed\n" in result.output
    # The failing twin: one half scaled is caught where it is computed.
    autocast_step(tmp_path / "planted", parts=2, planted=1.5)
    result = invoke("compare", tmp_path / "whole", tmp_path / "planted")
    assert result.exit_code == 1, result.output
    assert "first divergence: activation 2\n" in result.output


def test_a_dumper_is_told_the_precision_it_cannot_see(tmp_path):
    """Tensors computed in bf16 and upcast before add(): `dtype="bf16"` sets the thresholds of bf16."""
    h = torch.linspace(-1, 1, 64)
    for name, error, dtype in (("a", 1.0, "bf16"), ("b", 1.004, torch.bfloat16), ("fp32", 1.004, None)):
        with megalign.Dumper(tmp_path / name, dtype=dtype) as dumper:
            dumper.add("activation", "h", h * error)
    assert [megalign.open(tmp_path / name).meta["dtype"] for name in ("a", "b", "fp32")] == ["bf16", "bf16", "fp32"]
    assert invoke("compare", tmp_path / "a", tmp_path / "b").exit_code == 0
    assert invoke("compare", tmp_path / "a", tmp_path / "fp32").exit_code == 0  # either side 16-bit: bf16's row
    # The failing twin: 30% off fails bf16's row too.
    with megalign.Dumper(tmp_path / "off", dtype="bf16") as dumper:
        dumper.add("activation", "h", h * 1.3)
    result = invoke("compare", tmp_path / "a", tmp_path / "off")
    assert result.exit_code == 1, result.output
    assert "first divergence: activation h\n" in result.output  # where the planted error is
    with pytest.raises(ValueError, match="dtype: one of fp16, bf16, fp32, fp64 or a torch float dtype, got 'int8'"):
        megalign.Dumper(tmp_path / "refused", dtype="int8")
    assert not (tmp_path / "refused").exists() and not (tmp_path / "refused.partial").exists()
