"""A norm for the local layer spec under sequence parallelism.

megatron-core's local spec builds its norms with `WrappedTorchNorm`, which refuses sequence
parallelism: under SP each TP rank's norm sees only its part of the sequence, so the norm weights'
gradients are partial sums, and megatron's finalize_model_grads all-reduces them over the TP group
only for parameters marked `sequence_parallel` (TransformerEngine's norms mark theirs; TE is what a
CPU lacks). This is torch's own RMSNorm or LayerNorm, as WrappedTorchNorm builds it, with that mark.
"""

from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Drop-in for WrappedTorchNorm: the same constructor, a torch norm whose parameters are marked."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
