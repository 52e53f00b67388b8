"""Parameter gradients read at the reduction and as the optimizer steps (capture/grad_reads.py), in
one process: a clip inside the step block and one after it write the same records; a loop that does
not clip writes each gradient once; a step of two backwards keeps the last one's."""

from __future__ import annotations

import pytest
import torch

import megalign


def run(out, clip: str, backwards: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def clipped():
        if clip != "none":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    with megalign.Dumper(out) as dumper:
        dumper.watch(model, outputs=False)
        for step in range(2):
            with dumper.step(step):
                for micro in range(backwards):
                    model(torch.ones(2, 4) * (step + micro + 1)).square().sum().backward()
                if clip == "inside":
                    clipped()
            if clip == "after":
                clipped()
            optimizer.step()
            optimizer.zero_grad()
    return megalign.open(out)


def grads(dump) -> dict[str, torch.Tensor]:
    return {name: dump.tensor("param_grad", name) for kind, name in dump.names() if kind == "param_grad"}


def test_a_clip_is_read_apart_from_the_reduced_gradients_wherever_it_stands(tmp_path):
    unclipped = grads(run(tmp_path / "none", "none"))
    inside, after = grads(run(tmp_path / "inside", "inside")), grads(run(tmp_path / "after", "after"))
    assert sorted(inside) == sorted(after) == sorted([*unclipped, *(f"{name}#stepped" for name in unclipped)])
    for name, grad in inside.items():
        torch.testing.assert_close(after[name], grad)
    step0 = [name for name in unclipped if name.startswith("step0/")]
    for name in step0:  # step 1 starts from parameters the clip moved
        torch.testing.assert_close(inside[name], unclipped[name])
    stepped = torch.stack([inside[f"{name}#stepped"].norm() for name in step0]).norm()
    assert stepped == pytest.approx(0.01, rel=1e-4)


def test_a_step_of_two_backwards_keeps_the_last_ones_reduced_gradients(tmp_path):
    found = grads(run(tmp_path / "accumulated", "none", backwards=2))
    assert sorted(found) == sorted(f"step{s}/{n}" for s in (0, 1) for n in ("0.weight", "0.bias", "1.weight", "1.bias"))
