"""What a rollout's logprobs say beyond the logprobs row: the worst sequences, and the known causes.

Over the response positions (the loss mask), with delta = trainer - rollout (tokens were drawn from
the rollout, so k3 = mean((r - 1) - log r), r = exp(delta), estimates KL(rollout || trainer)):

- the worst sequences by k3 and by max |delta|;
- causes, each named instead of a wall of failures, tested on the numbers (the files do not record
  which logprobs an engine returned; docs/compare.md), in this order, the first found the one named:
  1. impossible values, whatever the sampling: a logprob above 0 (a probability above 1) beyond an
     engine's rounding, or one not finite (NaN, or -inf: a token sampled at probability 0);
  2. a wrong model, tokenizer or ids: most sampled tokens improbable to the trainer (below 1e-4)
     though the engine gave them 100 times that or more; no sampling setting makes an engine draw
     most of its tokens from the trainer's far tail;
  3. sampling semantics, fitted on the tokens the trainer finds probable (where a few are not, they
     are named apart, and the fit leaves them out with the tokens after them in their sequence, whose
     context holds a wrong id: what is left must still be most of the tokens):
     - logprobs one position off: the rollout's logprob of token k is the trainer's of token k +- 1;
     - temperature: the engine's log softmax(logits / T) (SGLang's output logprobs, vLLM's
       processed_logprobs), with T fitted to the trainer's logits;
     - a constant offset: one number, of either sign, added to every token's logprob;
     - renormalisation over a top-p/top-k set (vLLM's processed_logprobs): every token's logprob
       raised by the same -log(kept mass) as the rest of its set, so delta <= 0 on every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megalign.compare.metrics import k3_terms, logprob_gap, unravel

WORST = 5  # sequences listed per table: the outliers, not a second report
EXPLAINED = 0.01  # a cause explains the gap when it leaves less than 1% of its mean square
T_RANGE = (0.05, 20.0)
# How far above 0 a logprob may be before it is impossible: an engine's float32 log_softmax rounds a
# near-certain token's to a few ulps of its logits above 0 (+1e-7 .. +1e-5), which is no wrong field;
# 1e-3 (a probability of 1.001) is far above any such rounding and far below a sign lost or a score.
ROUNDING_ABOVE_ZERO = 1e-3
# A sampled token is improbable to the trainer below this probability where the engine gave it LIKELIER
# times more: an engine sampling from the trainer's own distribution draws such tokens about 1e-4 of
# the time each, so more than a few of them are ids of another model or tokenizer (a checkpoint other
# than --hf; text tokens mapped through another vocabulary; "\ufffd" bytes read as one id). A tail token
# both sides find improbable (sampled at T >= 1) is no such id.
IMPROBABLE = 1e-4
LIKELIER = 100.0
MOST = 0.5  # a cause is named only where more than this share of the tokens compared supports it
LISTED = 3  # improbable tokens named by their place


@dataclass
class SequenceGap:
    sequence: int
    tokens: int  # response positions compared
    k3: float
    max_abs_diff: float
    position: int  # of the max
    mean_abs_diff: float


def sequence_gaps(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> list[SequenceGap]:
    """Per sequence ([sequence, position] tensors), over its masked positions; sequences without one left out."""
    gaps = []
    delta = logprob_gap(rollout, trainer)
    for i in range(delta.shape[0]):
        keep = mask[i] > 0
        if not keep.any():
            continue
        d = delta[i][keep]
        where = keep.nonzero().flatten()
        worst = int(d.abs().argmax())
        gaps.append(SequenceGap(sequence=i, tokens=int(keep.sum()),
                                k3=float(k3_terms(d).mean()), max_abs_diff=float(d.abs().max()),
                                position=int(where[worst]), mean_abs_diff=float(d.abs().mean())))
    return gaps


def worst(gaps: list[SequenceGap], key: Callable[[SequenceGap], float], n: int = WORST) -> list[SequenceGap]:
    return sorted(gaps, key=lambda g: -key(g))[:n]


def causes(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
           valid: torch.Tensor, logits: Callable[[], Optional[torch.Tensor]], hf: Optional[str] = None) -> list[str]:
    """The known causes the numbers show, in words. [sequence, position] tensors; `valid`: the positions
    with a next token (the trainer has a logprob there); `logits`: the trainer's [sequence, position,
    vocab], loaded only when needed (None when the dump has none); `hf`: the trainer's --hf checkpoint
    (None: it ran without one)."""
    rollout, trainer = rollout.double(), trainer.double()
    compared = mask > 0
    impossible = _above_zero(rollout, compared) or _not_finite(rollout, compared)
    if impossible:
        return [impossible]  # no model or sampling setting explains a probability above 1 or none at all
    keep = compared & trainer.isfinite()
    if not keep.any():
        return []
    labels = tokens.roll(-1, dims=1)  # the token each position predicts
    improbable = keep & (trainer < math.log(IMPROBABLE)) & (rollout - trainer > math.log(LIKELIER))
    if int(improbable.sum()) > MOST * int(keep.sum()):
        return [_wrong_model(rollout, trainer, keep, improbable, hf)]
    # A wrong id is in the context of every later token of its sequence: those are the trainer's logprobs
    # of another sequence than the engine's, left out of the fit with it.
    fitted = keep & (improbable.long().cumsum(dim=1) == 0)
    sampling = _sampling(rollout, trainer, fitted, labels, valid, logits) \
        if int(fitted.sum()) > MOST * int(keep.sum()) else []
    if not improbable.any():
        return sampling
    return sampling + [_improbable_tokens(rollout, trainer, keep, improbable, labels)]


def _sampling(rollout: torch.Tensor, trainer: torch.Tensor, keep: torch.Tensor, labels: torch.Tensor,
              valid: torch.Tensor, logits: Callable[[], Optional[torch.Tensor]]) -> list[str]:
    """The sampling setting that explains the gap on the `keep` positions, if one does."""
    r, d = rollout[keep], trainer[keep]
    gap = _mean_square(r - d)
    if gap == 0:
        return []
    found = [_shift(rollout, trainer, keep, valid > 0, gap)]
    z = logits()
    labels = labels[keep]
    z = None if z is None else z[keep].double()
    if z is not None:
        found.append(_temperature(r, z, labels, gap))
    found += [_offset(r - d), _renormalised(r - d, z, labels)]
    return [f for f in found if f][:1]  # the first that explains the gap: the others then cannot


def _not_finite(rollout: torch.Tensor, keep: torch.Tensor) -> Optional[str]:
    bad = keep & ~rollout.isfinite()
    if not bad.any():
        return None
    sequence, position = (int(i) for i in bad.nonzero()[0])
    return (f"impossible logprobs: {int(bad.sum())} of the rollout's {int(keep.sum())} not finite (the first "
            f"{float(rollout[sequence, position])} at seq {sequence} pos {position}): a sampled token's logprob is a "
            "number above -inf, whatever the sampling (a null written for a number, a token the engine gave "
            "probability 0, another field)")


def _wrong_model(rollout: torch.Tensor, trainer: torch.Tensor, keep: torch.Tensor, improbable: torch.Tensor,
                 hf: Optional[str]) -> str:
    fix = (f"is --hf {hf} the checkpoint the engine ran, and" if hf else
           "the dump ran without --hf (seeded weights unless --load): run megalign forward --hf CKPT --rollout FILE "
           "with the checkpoint the engine ran; otherwise")
    return (f"wrong model, tokenizer or ids: {int(improbable.sum())} of the {int(keep.sum())} sampled tokens are "
            f"improbable to the trainer (probability below {IMPROBABLE:g}, median "
            f"{float(trainer[improbable].exp().median()):.2g}) where the engine gave them "
            f"{float(rollout[improbable].exp().median()):.2g} (median): the engine did not draw these ids from "
            f"this model, and no sampling setting explains it; {fix} are the file's ids the engine's own (string "
            "tokens are mapped through --hf's tokenizer)?")


def _improbable_tokens(rollout: torch.Tensor, trainer: torch.Tensor, keep: torch.Tensor, improbable: torch.Tensor,
                       labels: torch.Tensor) -> str:
    """The few tokens left out of the sampling fit, by place, the furthest first."""
    gap = (rollout - trainer).masked_fill(~improbable, -math.inf)
    order = gap.flatten().argsort(descending=True)[:min(LISTED, int(improbable.sum()))]
    places = []
    for flat in order.tolist():
        sequence, position = unravel(flat, list(gap.shape))
        places.append(f"seq {sequence} pos {position} token {int(labels[sequence, position])}: trainer "
                      f"{float(trainer[sequence, position].exp()):.2g}, engine {float(rollout[sequence, position].exp()):.2g}")
    return (f"{int(improbable.sum())} of the {int(keep.sum())} sampled tokens are improbable to the trainer "
            f"(probability below {IMPROBABLE:g}, the engine's {LIKELIER:g} times more or higher; {'; '.join(places)}): "
            "their ids are likely not the ones the engine sampled (a token read from its text or bytes: \ufffd "
            "bytes, which vLLM, TensorRT-LLM and ollama write for a piece of a UTF-8 character, map several tokens "
            "to one id); the rest are diagnosed without them and the tokens after them in their sequence (whose "
            "context holds them), where those left are most of the tokens")


def _above_zero(rollout: torch.Tensor, keep: torch.Tensor) -> Optional[str]:
    above = keep & (rollout > ROUNDING_ABOVE_ZERO)
    if not above.any():
        return None
    largest = rollout.masked_fill(~above, -math.inf)
    sequence, position = unravel(int(largest.argmax()), list(largest.shape))
    return (f"impossible logprobs: {int(above.sum())} of the rollout's {int(keep.sum())} above 0 by more than "
            f"rounding ({ROUNDING_ABOVE_ZERO:g}), a probability above 1 (the largest {float(largest.max()):.3g} at seq "
            f"{sequence} pos {position}): they are not the log-probabilities of the tokens, whatever the sampling (a "
            "sign lost, a score, another field)")


def _mean_square(x: torch.Tensor) -> float:
    return float(x.pow(2).mean())


def _shift(rollout: torch.Tensor, trainer: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor,
           gap: float) -> Optional[str]:
    for s, words in ((1, "the trainer's of the token after it"), (-1, "the trainer's of the token before it")):
        there = trainer.roll(-s, dims=1)  # there[:, t] = trainer[:, t + s]
        here = keep & valid.roll(-s, dims=1)  # t + s has a logprob of the trainer's (never wraps: see valid)
        if here.sum() < max(2, int(keep.sum()) // 2):
            continue
        shifted = _mean_square(rollout[here] - there[here])
        if shifted < EXPLAINED * gap:
            return (f"logprobs shifted by one position: the rollout's logprob of each token is {words} "
                    f"(rms |Δ| {math.sqrt(gap):.3g}, shifted {math.sqrt(shifted):.3g})")
    return None


def _at_temperature(z: torch.Tensor, labels: torch.Tensor, t: float) -> torch.Tensor:
    scaled = z / t
    return scaled.gather(1, labels[:, None]).squeeze(1) - scaled.logsumexp(dim=1)


def _temperature(r: torch.Tensor, z: torch.Tensor, labels: torch.Tensor, gap: float) -> Optional[str]:
    """Golden-section search of log T for the least squares between the rollout and log softmax(z / T)."""
    def loss(log_t: float) -> float:
        return _mean_square(r - _at_temperature(z, labels, math.exp(log_t)))

    lo, hi = map(math.log, T_RANGE)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if loss(a) < loss(b):
            hi = b
        else:
            lo = a
    t = math.exp((lo + hi) / 2)
    fitted = loss(math.log(t))
    at_one = loss(0.0)
    if abs(t - 1) < 1e-3 or not fitted < EXPLAINED * at_one:
        return None
    return (f"temperature-scaled rollout: its logprobs are log softmax(logits / T) with T ≈ {t:.3f} (rms |Δ| "
            f"{math.sqrt(at_one):.3g} at T = 1, {math.sqrt(fitted):.3g} at T = {t:.3f}); request the raw logprobs "
            "(vLLM: --logprobs-mode raw_logprobs; SGLang: SGLANG_RETURN_ORIGINAL_LOGPROB=1) or compare at T")


def _offset(excess: torch.Tensor) -> Optional[str]:
    """excess = rollout - trainer: one number, of either sign, on every token."""
    scale = float(excess.abs().mean())
    spread = float(excess.std()) if excess.numel() > 1 else 0.0
    if scale < 1e-6 or spread >= 1e-2 * scale:
        return None
    return (f"a constant offset: the rollout's logprobs are the trainer's {float(excess.mean()):+.4g} on every token "
            "(a normalisation over another set)")


def _renormalised(excess: torch.Tensor, z: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> Optional[str]:
    """excess = rollout - trainer: >= 0 on every token, and (with the logits) -log of a top-k mass on the
    tokens that hold nearly all of it (a token raised by nothing matches the whole vocabulary's mass)."""
    scale = float(excess.abs().mean())
    if float(excess.min()) < -1e-3 * scale or scale < 1e-6:
        return None
    if z is None:
        return (f"the rollout's logprobs exceed the trainer's on every token ({float(excess.min()):.3g} to "
                f"{float(excess.max()):.3g}): top-p/top-k renormalisation or a temperature below 1; the dump has no "
                "logits to tell which (run without --filter, or with logits in it)")
    cumulative = z.softmax(dim=1).sort(dim=1, descending=True).values.cumsum(dim=1)
    kept = (-excess).exp()
    matched = (cumulative.log() - kept.log()[:, None]).abs().min(dim=1).values < 1e-3
    if float(excess.clamp(min=0)[~matched].sum()) > EXPLAINED * float(excess.clamp(min=0).sum()):
        return None
    return (f"top-p/top-k renormalisation: every rollout logprob is the trainer's + -log(kept mass), "
            f"{float(excess.min()):.3g} to {float(excess.max()):.3g} (the engine returned processed logprobs: "
            "vLLM --logprobs-mode raw_logprobs returns the raw ones)")
