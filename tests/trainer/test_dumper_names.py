"""What a Dumper's tensors are named and judged as, in a user's loop: a module's calls, names given
twice, and the precision the step computed in.

Each loop is written as a user writes it: megalign.Dumper's public API around a small torch model,
each run's dump compared with the real CLI.
"""

from __future__ import annotations

from pathlib import Path

import torch

import megalign
from tests.conftest import invoke


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
