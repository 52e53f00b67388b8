"""Every rule of the judge (compare/judge.py), on tensors made here: each agreement with its failing twin.

The judge reads no file, so its rules run here without a dump; test_false_verdicts.py and test_scale.py
check the same rules end to end, through real dumps and the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from megalign.compare.entries import ReplicaGap, Value
from megalign.compare.judge import Rules, judge_apart, judge_kinds, judge_one_sided, judge_pair
from megalign.compare.metrics import LogprobMetrics, StatsMetrics, pair_sums, tensor_metrics
from megalign.compare.rank_rows import RankRows, unname_after_parameters_differ
from megalign.compare.records import (APART, BY_OP_MAP, FAIL, NOT_REASSEMBLABLE, ONLY_A, ONLY_B, PASS, SHAPE_MISMATCH,
                                      UNVERIFIABLE, Row, Summary, Verdict)
from megalign.compare.thresholds import Thresholds
from megalign.dump.stats import TensorStats, summary_of

FP32 = Rules(Thresholds(), run_a="fp32", run_b="fp32")
BF16 = Rules(Thresholds(), run_a="bf16", run_b="bf16")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def value(tensor: torch.Tensor, **fields) -> Value:
    return Value(shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."), tensor=tensor, **fields)


def judged(kind: str, x: torch.Tensor, y: torch.Tensor, rules: Rules = FP32, **given):
    return judge_pair(kind, "t", value(x), value(y), rules, **given)


def with_values(**at: float) -> torch.Tensor:
    x = torch.arange(1, 9, dtype=torch.float32)
    for index, number in at.items():
        x[int(index.removeprefix("i"))] = number
    return x


def test_a_difference_within_the_threshold_passes_and_one_above_it_fails():
    x = randn(64, 8)
    close = judged("activation", x, x * (1 + 1e-5))
    assert close.status == PASS and close.threshold == 1e-8 and close.metrics.rel_diff < 1e-8
    far = judged("activation", x, x + 1e-3 * randn(64, 8, seed=1))
    assert far.status == FAIL and far.metrics.rel_diff > 1e-8 and not far.scale.off  # the difference alone


def test_inputs_must_match_exactly():
    tokens = torch.arange(16)
    assert judged("input", tokens, tokens.clone()).status == PASS
    changed = tokens.clone()
    changed[5] = 6
    failed = judged("input", tokens, changed)
    assert failed.status == FAIL and failed.threshold == 0.0


@pytest.mark.parametrize("a, b", [
    (with_values(i2=math.nan), with_values()),  # NaN where the other side has a number
    (with_values(i2=math.nan), with_values(i5=math.nan)),  # at different positions
    (with_values(i3=math.inf), with_values(i3=-math.inf)),  # opposite infinities
    (with_values(i3=math.inf), with_values(i3=math.nan)),
])
def test_nonfinite_values_that_do_not_line_up_fail(a, b):
    v = judged("activation", a, b)
    assert v.status == FAIL and "different positions or signs" in v.notes[0] and not v.nonfinite_in_both


@pytest.mark.parametrize("x", [with_values(i2=math.nan), with_values(i3=math.inf, i6=-math.inf)])
def test_nonfinite_values_at_the_same_places_pass_with_a_note_and_fail_when_strict(x):
    v = judged("activation", x, x.clone())
    assert v.status == PASS and v.nonfinite_in_both and "at the same positions on both sides" in v.notes[0]
    strict = judged("activation", x, x.clone(), Rules(Thresholds(), "fp32", "fp32", strict_nonfinite=True))
    assert strict.status == FAIL


def test_other_shapes_are_a_shape_mismatch():
    x = randn(4, 2)
    v = judged("activation", x, x.reshape(8))
    assert v.status == SHAPE_MISMATCH and v.failing and v.metrics is None and (v.shape_a, v.shape_b) == ([4, 2], [8])
    assert judged("activation", x, x.clone()).status == PASS


def test_a_tensor_stored_narrower_than_its_run_is_judged_at_the_run_s_precision():
    """B stored as bf16 by an fp32 run: fp32's threshold fails bf16's rounding, and the row says why;
    the twin, a bf16 run's, passes the same values at bf16's threshold."""
    x = randn(64, 8)
    narrow = judged("activation", x, x.to(torch.bfloat16))
    assert narrow.status == FAIL and narrow.dtype_mismatch and narrow.threshold == 1e-8
    assert narrow.notes == ["B: stored as bfloat16 by a fp32 run; judged at the run's precision"]
    bf16_run = judged("activation", x, x.to(torch.bfloat16), Rules(Thresholds(), run_a="fp32", run_b="bf16"))
    assert bf16_run.status == PASS and bf16_run.dtype_mismatch and bf16_run.threshold == 2e-2 and not bf16_run.notes


def test_an_input_stored_narrower_gets_no_note():
    tokens = torch.arange(16, dtype=torch.float32)
    v = judged("input", tokens, tokens.to(torch.bfloat16))
    assert v.status == PASS and v.dtype_mismatch and not v.notes


def test_plain_files_take_the_precision_of_their_stored_dtypes():
    """No run dtype recorded: bf16 tensors are judged at bf16, float32 ones at fp32."""
    x = randn(64, 8)
    y = x + 1e-3 * randn(64, 8, seed=1)
    assert judged("activation", x.to(torch.bfloat16), y.to(torch.bfloat16), Rules(Thresholds())).status == PASS
    assert judged("activation", x, y, Rules(Thresholds())).status == FAIL


def _gap(x: torch.Tensor, copy: torch.Tensor) -> list[ReplicaGap]:
    return [ReplicaGap(ranks="rank 1 vs rank 0", sums=pair_sums(x, copy))]


def test_replicas_that_disagree_fail_naming_the_ranks_and_those_within_the_threshold_pass():
    x = randn(64, 8)
    disagree = judge_pair("activation", "t", value(x, replicas=_gap(x, x * 1.01)), value(x.clone()), FP32)
    assert disagree.status == FAIL and disagree.replica_diff_a > 1e-8 and disagree.replica_diff_b is None
    assert disagree.notes[0].startswith("A: replicas disagree (rank 1 vs rank 0): rel diff")
    rounded = x.clone()
    rounded[0, 0] = torch.nextafter(rounded[0, 0], torch.tensor(math.inf))
    within = judge_pair("activation", "t", value(x.clone()), value(x, replicas=_gap(x, rounded)), FP32)
    assert within.status == PASS and 0 < within.replica_diff_b <= 1e-8
    assert within.notes[0].startswith("B: replicas differ within the threshold (rank 1 vs rank 0)")


def test_replicas_with_nan_elsewhere_are_infinitely_apart():
    x = randn(8)
    copy = x.clone()
    copy[3] = math.nan
    v = judge_pair("activation", "t", value(x, replicas=_gap(x, copy)), value(x.clone()), FP32)
    assert v.status == FAIL and v.replica_diff_a == math.inf
    assert v.notes == ["A: replicas disagree on where NaN/Inf are (rank 1 vs rank 0)"]


def test_expert_choices_pass_in_another_order_and_fail_when_a_token_s_set_changes():
    x = torch.tensor([[0, 1], [2, 3], [1, 0]])
    reordered = judged("routing", x, torch.tensor([[1, 0], [2, 3], [1, 0]]))
    assert reordered.status == PASS and (reordered.routing.same_set, reordered.routing.same_order) == (3, 2)
    assert reordered.metrics is None and "100.00% of 3 tokens keep their top-k set" in reordered.notes[0]
    flipped = judged("routing", x, torch.tensor([[0, 1], [2, 4], [1, 0]]))
    assert flipped.status == FAIL and flipped.routing.first_flip == [1]
    assert flipped.notes[0].endswith("first flip at token 1")


def test_router_weights_are_compared_as_values():
    """Floating routing tensors (the router's probabilities) have a difference, not a choice."""
    x = randn(6, 4).softmax(-1)
    assert judged("routing", x, x.clone()).routing is None
    assert judged("routing", x, x.flip(-1)).status == FAIL


def test_a_rescaled_tensor_fails_where_its_relative_difference_passes():
    """bf16 gradients times 1.5: rel diff 0.077, under the threshold 0.1; the norm ratio is 1.5."""
    x = randn(64, 64)
    rescaled = judged("param_grad", x, 1.5 * x, BF16)
    assert rescaled.metrics.rel_diff < rescaled.threshold == 0.1
    assert rescaled.status == FAIL and rescaled.scale.off and math.isclose(rescaled.scale.norm_ratio, 1.5)
    assert rescaled.notes[-1].startswith("rescaled: norm ratio B/A 1.5")
    same = judged("param_grad", x, x.clone(), BF16)
    assert same.status == PASS and not same.scale.off


def _label_shift() -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy's gradient at the logits, softmax - one_hot(label), for labels and for labels shifted by one."""
    logits = randn(64, 32)
    labels = torch.randint(0, 32, (65,), generator=torch.Generator().manual_seed(1))
    grad = lambda target: torch.softmax(logits, -1) - torch.nn.functional.one_hot(target, 32)  # noqa: E731
    return grad(labels[:64]), grad(labels[1:])


def _dropout(x: torch.Tensor) -> torch.Tensor:
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) > 0.1
    return x * keep / 0.9


@pytest.mark.parametrize("a, b", [
    _label_shift(),
    (randn(64, 32), _dropout(randn(64, 32))),  # dropout left on one side: norm ratio 1.05
    (randn(64, 32), randn(64, 32).roll(1, 0)),  # a permutation: norm ratio 1
    (randn(64, 32), 1.3 * randn(64, 32).roll(1, 0)),  # and times 1.3: a factor, but not all of the difference
])
def test_a_difference_no_factor_explains_fails_without_being_called_rescaled(a, b):
    """Removing the norm ratio from B leaves far more than rounding (1 - cosine over the threshold)."""
    v = judged("activation_grad", a, b)
    assert v.status == FAIL and not v.scale.off and not any("rescaled" in note for note in v.notes)
    assert 1 - v.metrics.cosine > v.threshold


def test_a_factor_that_explains_the_difference_is_called_rescaled():
    """The twin: B is A times 2 up to fp32 rounding, what averaged gradients or a loss over half the tokens give."""
    x = randn(64, 32)
    v = judged("activation_grad", x, (2 * x) * (1 + 1e-7 * randn(64, 32, seed=3)))
    assert v.status == FAIL and v.scale.off and v.notes == [v.scale.note()]
    assert v.notes[0].startswith("rescaled: norm ratio B/A 2, ") and 1 - v.metrics.cosine <= v.threshold


@pytest.mark.parametrize("ratio, rescaled", [(0.979654, False), (1.3, False), (2.0005, True), (0.25, True)])
def test_a_single_number_is_rescaled_only_by_a_whole_factor(ratio, rescaled):
    """One number is some factor of any other: a loss with pad labels kept (0.98x) is no rescaled copy;
    a factor a layout makes, a rank count or its reciprocal (a CP loss over a local count: 2x), is."""
    v = judged("loss", torch.tensor(4.2), torch.tensor(4.2 * ratio))
    assert v.status == FAIL and v.scale.off == rescaled
    assert any(note.startswith("rescaled") for note in v.notes) == rescaled


def test_a_kind_is_rescaled_as_a_whole_only_where_a_factor_explains_its_tensors():
    """Eight bf16 matrices permuted and times 1.1 fail on their own, and their median ratio 1.1 is no
    kind rescaled; the twin, times 1.1 alone, is (test_gradients_rescaled_as_a_whole_fail_together)."""
    tensors = [randn(64, 64, seed=i) for i in range(8)]
    rows = [Row.of(i, "param_grad", f"l.{i}", i, judge_pair("param_grad", f"l.{i}", value(x), value(1.1 * x.roll(1, 0)),
                                                           BF16)) for i, x in enumerate(tensors)]
    assert judge_kinds(rows) == ([], []) and all(r.status == FAIL and not r.notes for r in rows)
    rescaled, _ = judge_kinds(_rows(tensors, 1.1))
    assert [whole.median_ratio for whole in rescaled] == [pytest.approx(1.1, rel=1e-3)]


HALVES = RankRows(side="B", dim=1, blocks=((0, 0, 2), (1, 2, 4)))  # [seq, batch, hidden], 2 rows a DP rank


@pytest.mark.parametrize("ranks, note", [
    ([1], "only B's DP rank 1 rows differ (random state, data sharding?)"),
    ([0], "only B's DP rank 0 rows differ (random state, data sharding?)"),
    ([0, 1], None),  # the twin: every rank's rows differ, the cause is no one rank's
])
def test_a_difference_in_one_dp_rank_s_rows_names_the_rank(ranks, note):
    x = randn(8, 4, 16)
    y = x.clone()
    for rank in ranks:
        y[:, 2 * rank:2 * rank + 2] = _dropout(x[:, 2 * rank:2 * rank + 2])
    v = judge_pair("activation", "t", value(x), value(y), FP32, rows=HALVES)
    assert v.status == FAIL and [n for n in v.notes if "rows differ" in n] == ([note] if note else [])


TOKENS = RankRows(side="B", dim=0, blocks=((0, 0, 5), (1, 5, 10)))  # lined up: [tokens, hidden], 5 a DP rank


@pytest.mark.parametrize("repeats", [True, False])
def test_a_dp_rank_holding_another_rank_s_rows_is_named_even_where_the_shapes_differ(repeats):
    """Two ranks fed one shard of uneven rows: B holds rank 0's 5 real tokens twice, A the batch's 7;
    the twin, B's ranks on rows of their own, names no rank."""
    batch = randn(10, 16, seed=1)  # the rows each rank should take
    y = batch.clone()
    y[5:] = batch[:5] if repeats else _dropout(batch[5:])
    v = judge_pair("activation", "t", value(randn(7, 16)), value(y), FP32, rows=TOKENS)
    assert v.status == SHAPE_MISMATCH
    assert v.notes == ([TOKENS.repeat_note(1, 0)] if repeats else [])
    assert TOKENS.repeat_note(1, 0) == "B's DP rank 1 holds the rows of its DP rank 0 (data sharding?)"
    # of one shape, the repeated rows are said instead of only rank 1's differing
    v = judge_pair("activation", "t", value(batch), value(y), FP32, rows=TOKENS)
    assert v.status == FAIL and v.notes == [TOKENS.repeat_note(1, 0) if repeats else TOKENS.note(1)]


@pytest.mark.parametrize("batch_repeats", [True, False])
def test_rows_alike_on_every_rank_by_construction_name_no_rank(batch_repeats):
    """A learned position embedding's output is the same on every DP rank, and on the other side too:
    no shard was repeated (before, B's rank 1 was said to hold rank 0's rows). The twin: A's batch
    holds other rows there, B's ranks repeat one shard. Of one shape and of another (uneven rows)."""
    positions = randn(5, 16, seed=2)
    y = torch.cat([positions, positions])
    off = (positions + 0.1 * randn(5, 16, seed=4)).repeat(2, 1)  # failing, B's ranks alike all the same
    for a in (y.clone(), y[:7].clone()):
        if batch_repeats:
            a[5:] = randn(len(a) - 5, 16, seed=3)
        v = judge_pair("activation", "t", value(a), value(off), FP32, rows=TOKENS)
        assert v.status in (FAIL, SHAPE_MISMATCH)
        assert (TOKENS.repeat_note(1, 0) in v.notes) == batch_repeats, v.notes


@pytest.mark.parametrize("params_differ", [True, False])
def test_one_rank_is_named_at_a_later_step_only_while_the_parameters_agree(params_differ):
    """Dropout on rank 1 fails step 0's reduced gradients, hence step 1's parameters: then every rank's
    rows differ at step 1 for that cause, and naming rank 1 there would mislead. The rows that repeat
    another rank's still do."""
    one_rank, repeated = HALVES.note(1), HALVES.repeat_note(1, 0)
    failed = Verdict(status=FAIL, notes=[one_rank])
    rows = [Row.of(0, "activation", "step0/drop", 0, failed),
            Row.of(1, "param_grad", "step0/w", 0, Verdict(status=FAIL if params_differ else PASS)),
            Row.of(2, "param", "step1/w", 0, Verdict(status=PASS)),
            Row.of(3, "activation", "step1/drop", 0, Verdict(status=FAIL, notes=[one_rank])),
            Row.of(4, "activation", "step1/embed", 0, Verdict(status=SHAPE_MISMATCH, notes=[repeated]))]
    unname_after_parameters_differ(rows)
    assert [row.notes for row in rows] == [[one_rank], [], [], [] if params_differ else [one_rank], [repeated]]


def test_a_threshold_the_user_sets_is_judged_alone_without_the_scale_check():
    x = randn(64, 64)
    for thresholds in (Thresholds(override=0.1), Thresholds.from_cli(None, ["^t$=0.1"])):
        v = judged("param_grad", x, 1.5 * x, Rules(thresholds, "bf16", "bf16"))
        assert v.status == PASS and v.scale is None
    assert judged("param_grad", x, 1.6 * x, Rules(Thresholds(override=0.1), "bf16", "bf16")).status == FAIL


def test_float64_runs_have_no_scale_check():
    x = randn(64, 64).double()
    v = judged("param_grad", x, x * (1 + 1e-9), Rules(Thresholds(), "fp64", "fp64"))
    assert v.scale is None and v.threshold == 1e-16 and v.status == PASS
    assert judged("param_grad", x, x * (1 + 1e-7), Rules(Thresholds(), "fp64", "fp64")).status == FAIL


def test_a_small_tensor_s_scale_is_unverified_alone():
    """A 64-element bf16 gradient: its tolerance (27/8) and its threshold (24/8) let a factor 1.5 through;
    the twin, a matrix of 4096 elements, fails it (test above)."""
    x = randn(64)
    v = judged("param_grad", x, 1.5 * x, BF16)
    assert v.status == PASS and v.scale.unverified and not v.scale.off


def test_a_vector_s_threshold_is_sized_by_its_elements():
    """bf16 parameter gradients: max(0.1, 24/sqrt(n)) for a vector, 0.1 for a matrix of as many elements."""
    x = randn(64)
    y = x + 0.5 * randn(64, seed=1)
    vector = judged("param_grad", x, y, BF16)
    assert vector.threshold == 3.0 and vector.metrics.rel_diff > 0.1 and vector.status == PASS
    matrix = judged("param_grad", x.reshape(8, 8), y.reshape(8, 8), BF16)
    assert matrix.threshold == 0.1 and matrix.status == FAIL


def test_a_reference_judges_each_side_s_distance_to_it_instead_of_the_threshold():
    """A and B 15% either side of R: 0.044 apart, over bf16's activation threshold (0.02), each within its
    rounding budget (0.03) of R. The twin moves B 40% off R: B off."""
    truth = randn(64, 64).double()
    x, y = (truth * 1.15).float(), (truth * 0.85).float()
    assert judged("activation", x, y, BF16).status == FAIL
    v = judged("activation", x, y, BF16, truth=value(truth))
    assert v.status == PASS and v.reference.off is None and v.threshold is None and v.scale is None
    assert v.reference.rel_a < 0.03 and v.reference.rel_b < 0.03
    b_off = judged("activation", x, (truth * 0.6).float(), BF16, truth=value(truth))
    assert b_off.status == FAIL and b_off.reference.off == "B"
    both = judged("activation", (truth * 1.6).float(), (truth * 0.6).float(), BF16, truth=value(truth))
    assert both.reference.off == "both"


def sketched(x: torch.Tensor) -> Value:
    """`x` as a stats-only dump holds it: its statistics and its sketch."""
    stats, sketch = summary_of(x)
    return Value(shape=list(x.shape), dtype=str(x.dtype).removeprefix("torch."), stats=stats, sketch=sketch)


def test_stats_only_sides_are_judged_against_the_reference_by_their_sketches():
    """A zoom's tensors outside it: the same case as above, every side stats-only, each side's distance
    to R estimated from the sketches (12.5%). The twin: B 40% off R is B off; sides without a sketch
    (norm, mean and std alone) are judged by the threshold."""
    truth = randn(64, 64).double()
    x, y = (truth * 1.15).float(), (truth * 0.85).float()
    v = judge_pair("activation", "t", sketched(x), sketched(y), BF16, truth=sketched(truth))
    assert v.status == PASS and v.reference.off is None and v.threshold is None
    assert v.reference.rel_a == pytest.approx(0.0098, rel=0.5) and "estimated by sketches" in "; ".join(v.notes)
    b_off = judge_pair("activation", "t", sketched(x), sketched((truth * 0.6).float()), BF16, truth=sketched(truth))
    assert b_off.status == FAIL and b_off.reference.off == "B"
    mixed = judge_pair("activation", "t", value(x), sketched(y), BF16, truth=value(truth))
    assert mixed.status == PASS and mixed.reference.off is None
    bare = Value(shape=[64, 64], dtype="float32", stats=TensorStats.of(y))
    unsketched = judge_pair("activation", "t", sketched(x), bare, BF16, truth=sketched(truth))
    assert unsketched.reference is None and unsketched.threshold == 2e-2


def test_a_reference_of_another_shape_judges_nothing():
    truth = randn(8, 64).double()
    x = randn(64, 64)
    v = judged("activation", x, x.clone(), BF16, truth=value(truth))
    assert v.reference is None and v.threshold == 2e-2 and v.status == PASS


def test_stats_only_sides_are_judged_on_their_summaries():
    x = randn(64, 8)
    stats = judge_pair("activation", "t", Value([64, 8], "float32", stats=TensorStats.of(x)), value(x.clone()), FP32)
    assert isinstance(stats.metrics, StatsMetrics) and stats.status == PASS
    off = judge_pair("activation", "t", Value([64, 8], "float32", stats=TensorStats.of(x)),
                     Value([64, 8], "float32", stats=TensorStats.of(x * 1.001)), FP32)
    assert off.status == FAIL and off.metrics.rel_diff > 1e-8


def test_a_partial_sum_s_sketch_is_judged_without_a_scale_check():
    """A stats-only partial sum keeps only its sketch, whose norm is about sqrt(2/K) off the true one:
    no scale check on it (it called an identical gradient rescaled, norm ratio 1.15); a real difference
    still fails on the sketch's estimate."""
    x = randn(64, 256)
    partial = Value([64, 256], "float32", sketch=summary_of(x)[1])
    same = judge_pair("param_grad", "t", partial, value(x.clone()), FP32)
    assert same.status == PASS and same.scale is None and math.isnan(same.metrics.norm_a)
    off = judge_pair("param_grad", "t", partial, value(x + 0.05 * randn(64, 256, seed=1)), FP32)
    assert off.status == FAIL and off.metrics.rel_diff > 1e-4 and off.scale is None


def test_stats_only_infinities_are_counted_alike_whatever_their_signs():
    """A summary counts Inf without a sign: +Inf against -Inf is said to be unchecked, failed only when strict."""
    sides = [Value([8], "float32", stats=TensorStats.of(with_values(i3=sign * math.inf))) for sign in (1, -1)]
    v = judge_pair("activation", "t", *sides, FP32)
    assert v.status == PASS and "statistics only: their positions and signs are not recorded" in v.notes[0]
    assert judge_pair("activation", "t", *sides, Rules(Thresholds(), "fp32", "fp32", strict_nonfinite=True)).status \
        == FAIL


def test_a_pair_read_in_windows_is_judged_on_its_merged_metrics():
    x = randn(64, 8)
    sides = [Value([64, 8], "float32"), Value([64, 8], "float32")]  # no tensor: the windows held them
    assert judge_pair("activation", "t", *sides, FP32, metrics=tensor_metrics(x, x.clone())).status == PASS
    assert judge_pair("activation", "t", *sides, FP32, metrics=tensor_metrics(x, x * 1.01)).status == FAIL


def test_a_side_that_could_not_be_put_together_is_not_reassemblable():
    x = randn(8)
    v = judge_pair("param_grad", "t", value(x), Value([8], "float32", problem="rank 1's shard is missing"), FP32)
    assert v.status == NOT_REASSEMBLABLE and v.failing and v.notes == ["B: rank 1's shard is missing"]
    assert judge_pair("param_grad", "t", value(x), value(x.clone()), FP32).status == PASS


@pytest.mark.parametrize("other, status", [(4.0, UNVERIFIABLE),  # their sum: each rank's share
                                           (2.0, UNVERIFIABLE),  # strictly between them: a weighted mean
                                           (5.0, FAIL), (1.0, FAIL)])  # neither: no reduction gives it
def test_per_rank_parts_fail_only_where_no_reduction_gives_the_other_side(other, status):
    parts = Value([], "float32", unverifiable="a loss per rank, reduced in a way not recorded",
                  parts=torch.tensor([1.0, 3.0]))
    v = judge_pair("loss", "loss", parts, value(torch.tensor(other)), FP32)
    assert v.status == status and v.failing == (status == FAIL)
    assert ("neither sum to the other side's" in v.notes[0]) == (status == FAIL)


def test_logprobs_name_the_worst_position_and_its_token():
    x = -randn(2, 4).abs()
    tokens = torch.arange(8).reshape(2, 4)
    rules = Rules(Thresholds(), "fp32", "fp32", tokens=tokens)
    y = x.clone()
    y[1, 2] += 0.5
    v = judge_pair("logprobs", "logprobs", value(x), value(y), rules)
    assert v.status == FAIL and isinstance(v.logprobs, LogprobMetrics)
    assert (v.logprobs.worst_sequence, v.logprobs.worst_position, v.logprobs.worst_token) == (1, 2, 6)
    same = judge_pair("logprobs", "logprobs", value(x), value(x.clone()), rules)
    assert same.status == PASS and same.logprobs.max_abs_diff == 0


def test_a_tensor_on_one_side_fails_unless_allowed():
    missing = judge_one_sided(True, [4], "float32", None, None)
    assert missing.status == ONLY_A and missing.failing and (missing.shape_a, missing.shape_b) == ([4], None)
    allowed = judge_one_sided(False, [4], "float32", "CP=1 has no such op", BY_OP_MAP)
    assert allowed.status == ONLY_B and not allowed.failing and allowed.notes == ["CP=1 has no such op"]


def test_a_tensor_set_apart_is_counted_not_failed():
    v = judge_apart([32, 16], [52, 16], "a sequence dim without a batch dim")
    assert v.status == APART and not v.failing and v.notes == ["a sequence dim without a batch dim"]


def _rows(tensors: list[torch.Tensor], factor: float, rules: Rules = BF16) -> list[Row]:
    return [Row.of(i, "param_grad", f"layers.{i}.weight", i, judge_pair("param_grad", f"layers.{i}.weight",
                                                                         value(x), value(factor * x), rules))
            for i, x in enumerate(tensors)]


def test_gradients_rescaled_as_a_whole_fail_together():
    """Eight bf16 matrices times 1.1: each within its own tolerance (0.42), their median 1.1 over 0.065."""
    tensors = [randn(64, 64, seed=i) for i in range(8)]
    rows = _rows(tensors, 1.1)
    assert all(row.status == PASS for row in rows)
    rescaled, small = judge_kinds(rows)
    assert [(whole.kind, whole.tensors) for whole in rescaled] == [("param_grad", 8)] and small == []
    assert all(row.status == FAIL and row.notes[-1].startswith("rescaled as a whole") for row in rows)
    same = _rows(tensors, 1.0)
    assert judge_kinds(same) == ([], []) and all(row.status == PASS for row in same)


def test_small_tensors_rescaled_fail_as_a_pool():
    """24 bf16 vectors of 576 elements times 1.5: each allows ±1.1, the pool ±0.23."""
    tensors = [randn(576, seed=i) for i in range(24)]
    rows = _rows(tensors, 1.5)
    assert all(row.status == PASS and row.scale.unverified for row in rows)
    _, (pool,) = judge_kinds(rows)
    assert pool.off and pool.tensors == 24 and all(row.status == FAIL for row in rows)
    assert rows[0].notes[-1].startswith("rescaled with the small tensors: pooled norm ratio B/A 1.5")
    same = _rows(tensors, 1.0)
    assert judge_kinds(same) == ([], []) and all(row.status == PASS and not row.notes for row in same)


def test_a_pool_too_small_to_verify_says_so():
    """Five vectors of 64 elements pooled still allow a factor 1.5: their scale is said to be unverified."""
    rows = _rows([randn(64, seed=i) for i in range(5)], 1.5)
    _, (pool,) = judge_kinds(rows)
    assert pool.unverified and not pool.off and all(row.status == PASS for row in rows)
    assert rows[0].notes == ["scale unverified alone at bf16: tolerance ±3.4"]


def test_the_summary_counts_what_fails_and_names_the_first():
    x = randn(8)
    rows = [Row.of(0, "activation", "a", 0, judge_pair("activation", "a", value(x), value(x.clone()), FP32)),
            Row.of(1, "activation", "b", 1, judge_pair("activation", "b", value(x), value(x * 2), FP32)),
            Row.of(2, "activation", "c", 2, judge_one_sided(True, [8], "float32", None, BY_OP_MAP))]
    summary = Summary.of(rows, 1, [], [])
    assert (summary.compared, summary.passed, summary.failed, summary.only_a, summary.missing_a) == (2, 1, 1, 1, 0)
    assert summary.first_divergence == "activation b" and not summary.ok
    assert Summary.of(rows[:1] + rows[2:], None, [], []).ok
