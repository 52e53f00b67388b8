"""A user's loop under torch's activation checkpoint, through the Dumper: each output and its gradient
recorded once, as without it (capture/recompute.py), for the reentrant checkpoint (its first forward
under no_grad, as megatron-core's) and the non-reentrant one (its first forward with grad enabled)."""

from __future__ import annotations

import pytest
import torch
from conftest import invoke
from torch.utils.checkpoint import checkpoint

import megalign
from megalign.compare.sources import open_source


class Net(torch.nn.Module):
    """Three layers with dropout, each checkpointed (`reentrant`: True, False; None: none)."""

    def __init__(self, reentrant, preserve_rng_state=True):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                                              torch.nn.Dropout(0.5)) for _ in range(3))
        self.reentrant, self.preserve = reentrant, preserve_rng_state

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) if self.reentrant is None else checkpoint(
                layer, x, use_reentrant=self.reentrant, preserve_rng_state=self.preserve)
        return x


def dumped(out, reentrant, preserve_rng_state=True):
    torch.manual_seed(0)
    net, x = Net(reentrant, preserve_rng_state), torch.randn(4, 16, requires_grad=True)
    with megalign.Dumper(out) as dumper:
        dumper.watch(net)
        with dumper.step(0):
            net(x).square().sum().backward()
    return out


def records(path) -> list[tuple[str, str]]:
    return sorted((entry.kind, entry.name) for entry in open_source(path).entries)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return dumped(tmp_path_factory.mktemp("recompute") / "plain", None)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_loop_records_each_tensor_once_and_agrees_with_the_plain_one(plain, tmp_path, reentrant):
    out = dumped(tmp_path / "checkpointed", reentrant)
    assert records(out) == records(plain)
    result = invoke("compare", plain, out)
    assert result.exit_code == 0 and "30 compared, 30 passed, 0 failed\n" in result.output, result.output


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recomputation_that_draws_other_dropout_masks_fails_at_the_first_gradient(plain, tmp_path, reentrant):
    """The twin: preserve_rng_state=False, the classic: the recomputed forward draws its dropout masks
    anew. The activations, recorded in the first forward, agree; the gradients do not."""
    out = dumped(tmp_path / "checkpointed", reentrant, preserve_rng_state=False)
    assert records(out) == records(plain)
    result = invoke("compare", plain, out)
    assert result.exit_code == 1, result.output
    assert "first divergence: activation_grad layers.2.1\n" in result.output, result.output
