"""The causes compare names for a rollout's logprobs, on synthetic logits (the real-model twins, temperature and
shift, are in test_rollouts.py): top-k renormalisation, a constant offset, and none for noise."""

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


def _named(rollout, trainer, mask, tokens, valid, logits):
    return causes(rollout, trainer, mask, tokens, valid, lambda: logits)


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
