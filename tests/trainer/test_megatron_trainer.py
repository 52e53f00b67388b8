"""A user's megatron-core training loop (megatron_train.py: its own GPTModel, DDP with the
distributed optimizer, Adam, its own loss, three steps) dumped with `megalign.Dumper.from_env()` and
`watch(model)` under torchrun on gloo, compared with the CLI: CP=2 agrees with CP=1, and TP=2 with
sequence parallelism with TP=1, at every dumped step, activations included, with nothing declared;
the classic CP bug (each rank's loss divided by its own token count) is caught at its first tensor,
and a gradient clip after the step block whose norm is computed on the rank's own TP shard at its own
step's gradients as the optimizer takes them (`#stepped`).
Tokens from half the vocabulary at TP=2 (a vocabulary shard no token reaches) and at PP=2 (megatron-core's
pipeline schedule) agree with one process; its MoE model at EP=2 agrees with EP=1. With megatron's own
loss convention (the schedule and finalize_model_grads divide by the step's token count) CP=2 and
DP=2 agree with one process, and the classic CP bug in that form fails at its first gradient.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import megalign
from tests.conftest import assert_whole, at_80_columns, invoke
from tests.trainer.torchruns import dump_all, finish, start

SCRIPT = Path(__file__).with_name("megatron_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """The script's own steps (1 and 2) at CP=1 and CP=2; steps 0 and 1 (MEGALIGN_DUMP_STEPS) at CP=1
    and at CP=2 with the bug. Two torchruns at a time."""
    root = tmp_path_factory.mktemp("trainer")
    made = {name: root / name for name in ("cp1", "cp2", "cp1_early", "cp2_bug")}
    finish(start(made["cp1"], "--cp", "1", script=SCRIPT), start(made["cp2"], "--cp", "2", script=SCRIPT))
    finish(start(made["cp1_early"], "--cp", "1", steps="0,1", script=SCRIPT),
           start(made["cp2_bug"], "--cp", "2", "--bug", "local-tokens", steps="0,1", script=SCRIPT))
    return made


def test_cp2_equals_cp1_at_every_dumped_step(dumps):
    cp2 = megalign.open(dumps["cp2"])
    assert cp2.meta["steps"] == [1, 2] and cp2.meta["layout"]["cp"] == 2
    result = invoke("compare", dumps["cp1"], dumps["cp2"])
    assert result.exit_code == 0, result.output
    for step in (1, 2):  # every step both dumps hold, its parameters and their gradients included
        assert f"param       step{step}/output_layer.weight" in result.output
        assert f"param_grad  step{step}/output_layer.weight" in result.output
        assert f"loss        step{step}/loss" in result.output
    assert "198 compared, 198 passed, 0 failed\n" in result.output
    assert "expert_bias" not in result.output  # no router moves one: nothing said


def test_a_loss_divided_by_the_ranks_own_token_count_is_caught_at_the_loss(dumps):
    assert megalign.open(dumps["cp2_bug"]).meta["steps"] == [0, 1]
    result = invoke("compare", dumps["cp1_early"], dumps["cp2_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step0/loss\n" in result.output


def test_dumps_of_other_steps_are_compared_on_the_step_both_hold(dumps):
    """Steps 1 and 2 against steps 0 and 1: step 1 is compared, the others set aside and said."""
    result = invoke("compare", dumps["cp1"], dumps["cp1_early"])
    assert result.exit_code == 0, result.output
    assert "step 2 set aside (not in B)" in result.output and "step 0 set aside (not in A)" in result.output
    assert "loss        step1/loss" in result.output and "step2/" not in result.output
    # The failing twin: the CP=2 run with the loss bug, compared on the same shared step: step 0's
    # wrong gradients have moved step 1's parameters already, and step 1's loss is off again.
    result = invoke("compare", dumps["cp1"], dumps["cp2_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: param step1/" in result.output and "loss step1/loss;" in result.output


@pytest.fixture(scope="module")
def megatron_loss_dumps(tmp_path_factory) -> dict[str, Path]:
    """Steps 0 and 1 with megatron's own loss convention (--loss megatron): one process, CP=2, DP=2
    under full activation recomputation (each layer's forward again in backward: recorded once), and
    CP=2 with calculate_per_token_loss left at megatron's default (cp-local-mean). Three at once."""
    root = tmp_path_factory.mktemp("megatron_loss")
    made = {name: root / name for name in ("one", "cp2", "dp2", "cp2_local_mean")}
    loss = ("--loss", "megatron")
    finish(start(made["one"], *loss, script=SCRIPT, steps="0,1", ranks=1),
           start(made["cp2"], "--cp", "2", *loss, script=SCRIPT, steps="0,1"),
           start(made["dp2"], "--cp", "1", *loss, "--recompute", script=SCRIPT, steps="0,1"))
    finish(start(made["cp2_local_mean"], "--cp", "2", *loss, "--bug", "cp-local-mean", script=SCRIPT, steps="0,1"))
    return made


@pytest.mark.parametrize("run", ["cp2", "dp2"])
def test_megatrons_own_loss_convention_agrees_with_one_process(megatron_loss_dumps, run):
    """The loss function returns the rank's token-loss sum and count; finalize_model_grads divides the
    summed gradients by the step's token count, which the Dumper records (grad_reduction.per_step), and
    compare divides the activation gradients by it. DP=2 recomputes every layer: the same 198 records,
    none again as `name@1`."""
    reduction = megalign.open(megatron_loss_dumps[run]).meta["grad_reduction"]
    assert reduction == {"divide_by": 1.0, "by": "megatron DDP, per-token loss", "per_step": {"0": 19.0, "1": 19.0}}
    result = invoke("compare", megatron_loss_dumps["one"], megatron_loss_dumps[run])
    assert result.exit_code == 0, result.output
    assert "grads /tokens a step (megatron DDP, per-token loss): act grads /19, /19" in result.output
    assert "198 compared, 198 passed, 0 failed\n" in result.output


def test_each_cp_ranks_own_token_count_fails_at_the_first_gradient(megatron_loss_dumps):
    """The classic CP bug in a user's loop: megatron's schedule divides each rank's sum by its own
    count (calculate_per_token_loss off), DDP averages (recorded: mean of 2 ranks). The reported loss
    is the whole batch's mean, right; the first gradient is off."""
    assert megalign.open(megatron_loss_dumps["cp2_local_mean"]).meta["grad_reduction"] == {
        "divide_by": 2.0, "by": "megatron DDP, mean of 2 ranks"}
    result = invoke("compare", megatron_loss_dumps["one"], megatron_loss_dumps["cp2_local_mean"])
    assert result.exit_code == 1, result.output
    assert "first divergence: activation_grad step0/output_layer\n" in result.output


@pytest.mark.parametrize("run", ["cp2", "dp2", "cp2_local_mean"])
def test_each_megatron_loss_compare_reads_whole_at_80_columns(megatron_loss_dumps, run, tmp_path):
    """The sides' lines say each step's divisor (act grads /19, /19): wrapped between words."""
    assert_whole(*at_80_columns(megatron_loss_dumps["one"], megatron_loss_dumps[run], tmp_path / "report.jsonl"))


CLIP = ("--clip", "1.5")  # the script's own clip: at both dumped steps some of the norms it sees exceed it


@pytest.fixture(scope="module")
def tp_dumps(tmp_path_factory) -> dict[str, Path]:
    """Steps 1 and 2 at TP=1 (DP=2), at TP=2 with sequence parallelism, and at TP=2+SP with the clip's
    norm computed on each rank's own shard. Three torchruns at once."""
    root = tmp_path_factory.mktemp("trainer_tp")
    made = {name: root / name for name in ("tp1", "tp2_sp", "tp2_sp_local_clip")}
    finish(start(made["tp1"], "--tp", "1", *CLIP, script=SCRIPT),
           start(made["tp2_sp"], "--tp", "2", "--sp", *CLIP, script=SCRIPT),
           start(made["tp2_sp_local_clip"], "--tp", "2", "--sp", *CLIP, "--bug", "local-clip", script=SCRIPT))
    return made


def test_tp2_with_sequence_parallelism_equals_tp1_activations_included(tp_dumps):
    tp2 = megalign.open(tp_dumps["tp2_sp"])
    assert tp2.meta["layout"]["tp"] == 2 and tp2.meta["steps"] == [1, 2]
    # watch() inferred the SP split of a norm's output and the TP split of a column-parallel linear's
    shards = tp2.shards("activation", "step1/decoder.layers.0.input_layernorm")
    assert [s.sharding.sp for s in shards] == [True, True]
    shards = tp2.shards("activation", "step1/decoder.layers.0.mlp.linear_fc1")
    assert [s.sharding.tp_dim for s in shards] == [2, 2]
    result = invoke("compare", tp_dumps["tp1"], tp_dumps["tp2_sp"])
    assert result.exit_code == 0, result.output
    for step in (1, 2):
        assert f"act         step{step}/decoder.layers.1.mlp.linear_fc2#input" in result.output
        assert f"act_grad    step{step}/embedding.word_embeddings" in result.output
        assert f"param_grad  step{step}/output_layer.weight" in result.output
        assert f"param_grad  step{step}/output_layer.weight#stepped" in result.output  # as the clip left it
    # 20 parameters' gradients a step as reduced and again as the optimizer stepped on them, clipped
    assert "238 compared, 238 passed, 0 failed\n" in result.output


def test_a_clip_by_the_local_shards_norm_after_the_step_block_is_caught_at_its_own_steps_gradients(tp_dumps):
    """Before, megatron-core's gradients were read at the block's end alone: the clip after it showed
    at step 2's parameters. Now the reduced gradients agree, and those megatron's optimizer steps on
    fail at step 1. Each TP rank clips by its own norm, so one rank's gradients may change and not
    the other's: the ranks decide together whether to write them again, or the TP collectives of
    the read would not match (gloo aborted)."""
    result = invoke("compare", tp_dumps["tp1"], tp_dumps["tp2_sp_local_clip"])
    assert result.exit_code == 1, result.output
    assert re.search(r"param_grad +step1/embedding.word_embeddings.weight +64x32 .* PASS", result.output)
    assert "first divergence: param_grad step1/embedding.word_embeddings.weight#stepped\n" in result.output


@pytest.fixture(scope="module")
def packed_dumps(tmp_path_factory) -> dict[str, Path]:
    """--packed (four documents of uneven lengths, one packed row a DP rank, PackedSeqParams), steps 0
    and 1: at CP=1 (DP=2, two rows), at CP=2 (one row, each document split over the CP ranks by
    get_batch_on_this_cp_rank given cu_seqlens), and at CP=2 with the row split as one sequence while
    the attention is told the documents. Three torchruns at once."""
    root = tmp_path_factory.mktemp("trainer_packed")
    made = {name: root / name for name in ("cp1", "cp2", "cp2_row_split")}
    finish(start(made["cp1"], "--packed", "--cp", "1", steps="0,1", script=SCRIPT),
           start(made["cp2"], "--packed", "--cp", "2", steps="0,1", script=SCRIPT),
           start(made["cp2_row_split"], "--packed", "--cp", "2", "--bug", "row-split", steps="0,1", script=SCRIPT))
    return made


def test_packed_rows_at_cp2_equal_cp1_with_the_documents_read_from_packed_seq_params(packed_dumps):
    cp2 = megalign.open(packed_dumps["cp2"])
    assert cp2.meta["rows"] == [{"bounds": [0, 8, 20, 28, 40], "lengths": [5, 11, 7, 9]}]
    assert cp2.meta["cp_split"] == "document" and cp2.meta["num_sequences"] == 4
    assert megalign.open(packed_dumps["cp1"]).meta["rows"] == [{"bounds": [0, 6, 18], "lengths": [5, 11]},
                                                                {"bounds": [0, 8, 18], "lengths": [7, 9]}]
    result = invoke("compare", packed_dumps["cp1"], packed_dumps["cp2"])
    assert result.exit_code == 0, result.output
    # two packings of the same documents, lined up token by token: 32 real tokens
    assert "act         step1/decoder.layers.1.self_attention.core_attention      32x32" in result.output
    assert "196 compared, 196 passed, 0 failed\n" in result.output


def test_a_packed_row_split_as_one_sequence_is_caught_at_the_embeddings(packed_dumps):
    result = invoke("compare", packed_dumps["cp1"], packed_dumps["cp2_row_split"])
    assert result.exit_code == 1, result.output
    assert "first divergence: activation step0/embedding.word_embeddings\n" in result.output


@pytest.fixture(scope="module")
def half_vocab_dumps(tmp_path_factory) -> dict[str, Path]:
    """--half-vocab (token ids under 32 of the 64) and --draw-weights (the same weights at any TP and PP),
    steps 0 and 1: on one process; at TP=2 (TP rank 1's shard of the embedding's gradient all zero: no
    token reaches its rows), stats-only too, and with TP rank 0's shard, the one the tokens reach,
    zeroed; at PP=2, and with each stage's weights drawn from its own layer names. Six torchruns at once."""
    common = ("--half-vocab", "--draw-weights")
    return dump_all(tmp_path_factory.mktemp("trainer_half_vocab"), SCRIPT, {
        "one": (1, common), "tp2": (2, (*common, "--tp", "2")),
        "tp2_stats": (2, (*common, "--tp", "2", "--stats-only")),
        "tp2_zeroed": (2, (*common, "--tp", "2", "--bug", "zero-embedding-grad")),
        "pp2": (2, (*common, "--pp", "2")), "pp2_local_names": (2, (*common, "--pp", "2", "--bug", "local-names"))},
        steps="0,1")


def test_a_vocabulary_shard_no_token_reaches_still_has_a_gradient(half_vocab_dumps):
    """The Dumper decides whether a rank holds a gradient over its TP group, as megalign's worker does
    (ddp_grads.held_gradients): rank 1's all-zero shard is dumped, and the embedding's gradient is whole."""
    tp2 = megalign.open(half_vocab_dumps["tp2"])
    shards = tp2.shards("param_grad", "step0/embedding.word_embeddings.weight")
    assert [s.sharding.tp_dim for s in shards] == [0, 0] and not shards[1].tensor().any()
    result = invoke("compare", half_vocab_dumps["one"], half_vocab_dumps["tp2"])
    assert result.exit_code == 0, result.output
    assert "param_grad  step0/embedding.word_embeddings.weight" in result.output


def test_stats_only_the_tp_ranks_decide_together_at_the_step(half_vocab_dumps):
    """Stats-only, an all-zero gradient is otherwise left out at close by each rank's own statistics."""
    shards = megalign.open(half_vocab_dumps["tp2_stats"]).shards("param_grad", "step0/embedding.word_embeddings.weight")
    assert [s.tp_rank for s in shards] == [0, 1] and shards[1].stats["abs_sum"] == 0
    result = invoke("compare", half_vocab_dumps["one"], half_vocab_dumps["tp2_stats"])
    assert result.exit_code == 0, result.output
    assert "198 compared, 198 passed, 0 failed\n" in result.output


def test_a_zeroed_vocabulary_shard_where_tokens_reach_it_is_caught_at_the_embeddings_gradient(half_vocab_dumps):
    result = invoke("compare", half_vocab_dumps["one"], half_vocab_dumps["tp2_zeroed"])
    assert result.exit_code == 1, result.output
    assert "first divergence: param_grad step0/embedding.word_embeddings.weight\n" in result.output


def test_pp2_equals_one_process_with_each_stages_layers_named_globally(half_vocab_dumps):
    pp2 = megalign.open(half_vocab_dumps["pp2"])
    assert pp2.meta["layout"]["pp"] == 2
    # stage 1's first layer, decoder.layers.0 on its stage, is dumped as the model's layer 1
    shards = pp2.shards("activation", "step0/decoder.layers.1.self_attention.linear_qkv")
    assert [s.pp_rank for s in shards] == [1]
    result = invoke("compare", half_vocab_dumps["one"], half_vocab_dumps["pp2"])
    assert result.exit_code == 0, result.output
    assert "act_grad    step1/decoder.layers.0.mlp.linear_fc2#input" in result.output
    assert "198 compared, 198 passed, 0 failed\n" in result.output


def test_stages_that_draw_their_weights_by_their_own_layer_names_are_caught_at_stage_1s_first_weight(
        half_vocab_dumps):
    result = invoke("compare", half_vocab_dumps["one"], half_vocab_dumps["pp2_local_names"])
    assert result.exit_code == 1, result.output
    assert "first divergence: param step0/decoder.layers.1.self_attention.linear_proj.weight\n" in result.output


@pytest.fixture(scope="module")
def moe_dumps(tmp_path_factory) -> dict[str, Path]:
    """--moe (4 experts, top-2; DeepSeek-V3's router: --expert-bias) with --draw-weights (each expert drawn from its global index), steps 0
    and 1, on two ranks: DP=2 with every expert on each, EP=2 (experts 0 and 1 on rank 0, 2 and 3 on
    rank 1, each rank `local_experts.0` and `.1`), and EP=2 with each EP rank's experts drawn from its
    own indices; on four ranks, TP=2 with SP and EP=2 with expert TP 1 (the two TP ranks of a DP rank
    hold other experts, each whole). Four torchruns at once."""
    common = ("--half-vocab", "--draw-weights", "--moe", "--expert-bias")
    return dump_all(tmp_path_factory.mktemp("trainer_moe"), SCRIPT, {
        "ep1": (2, common), "ep2": (2, (*common, "--ep", "2")),
        "tp2_ep2_etp1": (4, (*common, "--tp", "2", "--sp", "--ep", "2", "--etp", "1")),
        "ep2_local_experts": (2, (*common, "--ep", "2", "--bug", "local-experts"))}, steps="0,1")


def test_ep2_equals_ep1_with_each_ranks_experts_named_globally(moe_dumps):
    ep2 = megalign.open(moe_dumps["ep2"])
    assert (ep2.meta["layout"]["ep"], ep2.meta["layout"]["dp"]) == (2, 2)
    # rank 1's local_experts.0 is the model's expert 2: its gradient, reduced over the expert-data-parallel
    # ranks (rank 1 alone), on its EP rank only, whole (expert TP 1)
    shards = ep2.shards("param_grad", "step0/decoder.layers.0.mlp.experts.2.linear_fc1.weight")
    assert [(s.rank, s.sharding.tp_dim) for s in shards] == [(1, None)]
    # the router's decisions over all 4 experts, each DP rank's tokens
    shards = ep2.shards("routing", "step0/decoder.layers.0.mlp.router.experts")
    assert [(s.rank, s.sharding.dp_dim) for s in shards] == [(0, 1), (1, 1)]
    result = invoke("compare", moe_dumps["ep1"], moe_dumps["ep2"])
    assert result.exit_code == 0, result.output
    # Both sides moved their routers' expert_bias after step 0, as a transformers replay never does: said.
    assert result.output.count("expert_bias moved after every step (megatron's finalize_model_grads, "
                               "moe_router_bias_update_rate 0.001)") == 2
    assert "param_grad  step1/decoder.layers.1.mlp.experts.3.linear_fc2.weight" in result.output
    assert "routing     step1/decoder.layers.1.mlp.router.weights" in result.output
    assert "act_grad    step1/decoder.layers.0.mlp " in result.output
    assert "238 compared, 238 passed, 0 failed\n" in result.output


def test_experts_under_tp2_with_expert_tp1_are_whole_on_their_ep_rank(moe_dumps):
    """megatron marks an expert's linears TP-split at any expert TP size: read as split over the TP
    ranks, each expert was half of a tensor whose other half no rank holds (before: exit 1, 64 not
    reassemblable)."""
    dump = megalign.open(moe_dumps["tp2_ep2_etp1"])
    assert (dump.meta["layout"]["tp"], dump.meta["layout"]["ep"], dump.meta["layout"]["etp"]) == (2, 2, 1)
    shards = dump.shards("param_grad", "step0/decoder.layers.0.mlp.experts.2.linear_fc1.weight")
    assert [(s.tp_rank, s.sharding.tp_dim) for s in shards] == [(1, None), (1, None)]
    result = invoke("compare", moe_dumps["ep1"], moe_dumps["tp2_ep2_etp1"])
    assert result.exit_code == 0, result.output
    assert "238 compared, 238 passed, 0 failed\n" in result.output


def test_ep_ranks_that_draw_their_experts_by_their_own_indices_are_caught_at_expert_2s_first_weight(moe_dumps):
    result = invoke("compare", moe_dumps["ep1"], moe_dumps["ep2_local_experts"])
    assert result.exit_code == 1, result.output
    assert "first divergence: param step0/decoder.layers.0.mlp.experts.2.linear_fc1.weight\n" in result.output
