"""Parameter gradients read at the reduction and as the optimizer steps (capture/grad_reads.py), in
one process: a clip inside the step block and one after it write the same records; a loop that does
not clip writes each gradient once; a step of two backwards keeps the last one's."""

from __future__ import annotations

import pytest
import torch

import megalign


def run(out, clip: str, backwards: int = 1, stats_only: bool = False, deferred: bool = False):
    """Two steps of a two-layer loop; `deferred`: stats-only's comparisons left as a device leaves them
    (flags resolved at close), here on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def clipped():
        if clip != "none":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    with megalign.Dumper(out, stats_only=stats_only) as dumper:
        if deferred:
            dumper._reads._deferred = lambda now: True
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


@pytest.mark.parametrize("clip", ["none", "inside", "after"])
def test_stats_only_decided_at_close_writes_what_is_decided_at_once(tmp_path, clip):
    """The device's way (each #stepped read written, kept where its flag stays true at close) keeps
    the records and statistics the CPU's way (compared at once) keeps: a clip inside the block or after
    it, or none; and, two backwards in a step, the last one's."""
    for backwards in (1, 2):
        at_once, later = (run(tmp_path / f"{clip}-{backwards}-{deferred}", clip, backwards, stats_only=True,
                              deferred=deferred) for deferred in (False, True))
        assert sorted(later.names()) == sorted(at_once.names()) and len(at_once.names()) > 0
        for kind, name in at_once.names():
            assert later.shards(kind, name)[0].stats == at_once.shards(kind, name)[0].stats
