"""dump.json's grad_reduction read back (a malformed one is bad input), the user's statement checked,
and partial values refused beside a split, in every step."""

from __future__ import annotations

import pytest
import torch

import megalign
from megalign.capture.reducers import check_stated
from megalign.dump.grad_convention import GradReduction
from megalign.dump.validate import Malformed


def test_a_recorded_reduction_reads_back_and_old_dumps_have_none():
    assert GradReduction.from_meta({}, "dump.json") is None
    record = GradReduction(2.0, "torch DDP, mean of 2 ranks")
    assert GradReduction.from_meta({"grad_reduction": record.to_dict()}, "dump.json") == record
    assert GradReduction.from_meta({"grad_reduction": {"divide_by": None, "by": "hook"}}, "x").divide_by is None


@pytest.mark.parametrize("raw", [{"divide_by": 0, "by": "x"}, {"divide_by": True, "by": "x"}, {"divide_by": 2},
                                 [2], {"divide_by": float("nan"), "by": "x"}])
def test_a_malformed_reduction_is_bad_input(raw):
    with pytest.raises(Malformed, match="grad_reduction must be"):
        GradReduction.from_meta({"grad_reduction": raw}, "dump.json")


def test_a_statement_is_sum_mean_or_a_positive_divisor():
    assert [check_stated(s) for s in ("sum", "mean", 4, "2", None)] == ["sum", "mean", 4, 2.0, None]
    for bad in ("avg", 0, -1, True):
        with pytest.raises(ValueError, match="sum"):
            check_stated(bad, "MEGALIGN_GRAD_REDUCTION")


def test_partial_values_beside_a_split_are_refused_in_any_step(tmp_path):
    with megalign.Dumper(tmp_path / "d", steps=[5]) as dumper:
        with pytest.raises(ValueError, match="give no dims beside it"):
            dumper.add("loss", "loss", torch.ones(()), megalign.Sharding(partial="sum", dp_dim=0))
        with pytest.raises(ValueError, match="is \"sum\" or \"mean\""):
            dumper.add("loss", "loss", torch.ones(()), megalign.Sharding(partial="max"))
        with dumper.step(5):
            dumper.add("loss", "loss", torch.ones(()), megalign.Sharding(partial="mean"))
    assert megalign.open(tmp_path / "d").tensor("loss", "loss").item() == 1.0


def test_a_divisor_a_step_reads_back_and_a_malformed_one_is_bad_input():
    """megatron's per-token loss: the step's token count, each step its own."""
    record = GradReduction(1.0, "megatron DDP, per-token loss", ((0, 19.0), (1, 23.0)))
    back = GradReduction.from_meta({"grad_reduction": record.to_dict()}, "dump.json")
    assert back == record and (back.divisor(1), back.divisor(None)) == (23.0, 1.0)
    with pytest.raises(Malformed, match="per_step must map steps"):
        GradReduction.from_meta({"grad_reduction": {"divide_by": 1, "by": "x", "per_step": {"a": 2}}}, "dump.json")
