"""The causes compare names for a rollout's logprobs, on synthetic logits (the real-model twins, temperature,
shift and wrong ids, are in test_rollouts.py): impossible values first, then a wrong model, tokenizer or ids,
then top-k renormalisation, a constant offset, temperature, and none for noise."""

from __future__ import annotations

import pytest
import torch

from megalign.compare.rollout_causes import causes, sequence_gaps, worst

SEQUENCES, POSITIONS, VOCAB = 3, 12, 50


def _case():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQUENCES, POSITIONS, VOCAB, generator=generator, dtype=torch.float64) * 3
    tokens = torch.randint(0, VOCAB, (SEQUENCES, POSITIONS), generator=generator)
    labels = tokens.roll(-1, dims=1)
    trainer = logits.log_softmax(-1).gather(2, labels[..., None]).squeeze(2)
    mask = torch.zeros(SEQUENCES, POSITIONS)
    mask[:, 4:-1] = 1  # the response: positions 4.. predict tokens 5..
    valid = torch.ones(SEQUENCES, POSITIONS, dtype=torch.bool)
    valid[:, -1] = False
    return logits, tokens, labels, trainer, mask, valid


def _named(rollout, trainer, mask, tokens, valid, logits, hf="ckpt"):
    return causes(rollout, trainer, mask, tokens, valid, lambda: logits, hf)


def _wrong_ids(logits, tokens, mask):
    """The engine's own view of its sampled tokens (about 0.5 each), on ids the trainer finds in its far tail:
    each position's least likely token."""
    labels = logits.argmin(-1)
    tokens = labels.roll(1, dims=1)
    trainer = logits.log_softmax(-1).gather(2, labels[..., None]).squeeze(2)
    engine = torch.full_like(trainer, -0.7) + 0.1 * torch.rand(trainer.shape, generator=torch.Generator().manual_seed(3),
                                                                dtype=torch.float64)
    return tokens, trainer, engine


def test_top_k_renormalisation_is_named():
    logits, tokens, labels, trainer, mask, valid = _case()
    # The sampled tokens kept in the top 10; the engine's processed logprobs: log softmax over them.
    kept = logits.topk(10, dim=-1).indices
    labels = kept[..., 3]
    tokens = labels.roll(1, dims=1)
    trainer = logits.log_softmax(-1).gather(2, labels[..., None]).squeeze(2)
    top = torch.full_like(logits, -torch.inf).scatter(2, kept, logits.gather(2, kept))
    rollout = top.log_softmax(-1).gather(2, labels[..., None]).squeeze(2)
    found = _named(rollout, trainer, mask, tokens, valid, logits)
    assert len(found) == 1 and found[0].startswith("top-p/top-k renormalisation"), found


@pytest.mark.parametrize("offset", (0.25, -0.2))
def test_constant_offset_is_named(offset):
    """Either sign: the docs list a constant offset, not only a raise (-0.2 on every token was named by nothing)."""
    logits, tokens, _, trainer, mask, valid = _case()
    found = _named(trainer + offset, trainer, mask, tokens, valid, logits)
    assert found and found[0].startswith(f"a constant offset: the rollout's logprobs are the trainer's {offset:+g} ")


def test_one_raised_token_is_not_renormalisation():
    """The other tokens, raised by nothing, each match the whole vocabulary's mass: they do not make the one raised
    token a top-k renormalisation."""
    logits, tokens, _, trainer, mask, valid = _case()
    rollout = trainer.clone()
    rollout[1, 6] += 0.5
    assert _named(rollout, trainer, mask, tokens, valid, logits) == []


def test_a_logprob_above_zero_is_impossible_before_any_other_cause():
    logits, tokens, _, trainer, mask, valid = _case()
    rollout = trainer + 0.25  # a constant offset, but for one token above 0
    rollout[2, 5] = 0.5
    found = _named(rollout, trainer, mask, tokens, valid, logits)
    assert found == [found[0]] and found[0].startswith("impossible logprobs: 1 of the rollout's 21 above 0")
    assert "(the largest 0.5 at seq 2 pos 5)" in found[0]


@pytest.mark.parametrize("above, impossible", ((1e-6, False), (0.05, True)))
def test_an_engines_rounding_above_zero_is_not_impossible(above, impossible):
    """A near-certain token's float32 log_softmax rounds to a hair above 0: called impossible, it hid the
    real cause (here a constant offset). A logprob of +0.05 is no rounding."""
    logits, tokens, _, trainer, mask, valid = _case()
    trainer[2, 5] = above - 0.25
    found = _named(trainer + 0.25, trainer, mask, tokens, valid, logits)
    said = "impossible logprobs: 1 of the rollout's 21 above 0" if impossible else "a constant offset: "
    assert len(found) == 1 and found[0].startswith(said), found


def test_noise_has_no_cause():
    logits, tokens, _, trainer, mask, valid = _case()
    noise = torch.randn(trainer.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.3
    assert _named(trainer + noise, trainer, mask, tokens, valid, logits) == []
    assert _named(trainer, trainer, mask, tokens, valid, logits) == []


def test_worst_sequences_by_k3_and_max():
    _, _, _, trainer, mask, _ = _case()
    rollout = trainer.clone()
    rollout[1, 6] += 2.0  # one big gap
    rollout[2, 4:-1] += 0.3  # many small ones
    gaps = sequence_gaps(rollout, trainer, mask)
    assert [g.sequence for g in worst(gaps, lambda g: g.max_abs_diff, n=1)] == [1]
    assert gaps[1].position == 6 and gaps[0].k3 == 0.0
    assert [g.sequence for g in worst(gaps, lambda g: g.k3)][:2] == [1, 2]


def test_without_logits_an_excess_is_named_without_choosing():
    _, tokens, _, trainer, mask, valid = _case()
    excess = torch.rand(trainer.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    found = _named(trainer + excess, trainer, mask, tokens, valid, None)
    assert found and "renormalisation or a temperature below 1" in found[0]


@pytest.mark.parametrize("value", (float("nan"), -float("inf")))
def test_a_non_finite_logprob_is_impossible(value):
    """A NaN or -inf sampled token's logprob was left out of the causes' fit silently (a constant offset named)."""
    logits, tokens, _, trainer, mask, valid = _case()
    rollout = trainer + 0.25
    rollout[1, 7] = value
    found = _named(rollout, trainer, mask, tokens, valid, logits)
    assert found == [found[0]] and found[0].startswith("impossible logprobs: 1 of the rollout's 21 not finite "
                                                       f"(the first {value} at seq 1 pos 7)"), found


@pytest.mark.parametrize("with_logits", (True, False))
def test_ids_the_trainer_finds_improbable_are_a_wrong_model_not_sampling(with_logits):
    """Without logits, every rollout logprob above the trainer's was called "top-p/top-k renormalisation or a
    temperature below 1"."""
    logits, _, _, _, mask, valid = _case()
    tokens, trainer, engine = _wrong_ids(logits, None, mask)
    found = _named(engine, trainer, mask, tokens, valid, logits if with_logits else None)
    assert len(found) == 1 and found[0].startswith("wrong model, tokenizer or ids: 21 of the 21 sampled tokens are "
                                                   "improbable to the trainer (probability below 0.0001"), found
    assert "is --hf ckpt the checkpoint the engine ran" in found[0]
    without = _named(engine, trainer, mask, tokens, valid, None, hf=None)[0]
    assert "the dump ran without --hf (seeded weights unless --load): run megalign forward --hf CKPT" in without


def test_a_few_improbable_ids_leave_the_temperature_named():
    """Two of 21 tokens with ids the trainer finds improbable (as "\ufffd" bytes read as one id make them): the
    temperature still explains the other 19, and the two are named by their place. Their gap hid the
    temperature (no cause named)."""
    logits, tokens, labels, trainer, mask, valid = _case()
    rollout = (logits / 0.7).log_softmax(-1).gather(2, labels[..., None]).squeeze(2)
    for sequence, position in ((0, 6), (2, 9)):
        wrong = int(logits[sequence, position].argmin())
        tokens[sequence, position + 1] = wrong
        trainer[sequence, position] = logits[sequence, position].log_softmax(-1)[wrong]
        rollout[sequence, position] = -0.1
    found = _named(rollout, trainer, mask, tokens, valid, logits)
    assert len(found) == 2 and found[0].startswith("temperature-scaled rollout"), found
    assert "T ≈ 0.700" in found[0]
    assert found[1].startswith("2 of the 21 sampled tokens are improbable to the trainer"), found
    assert "seq 0 pos 6 token" in found[1] and "seq 2 pos 9 token" in found[1]
