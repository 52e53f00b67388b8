"""Device tensors to a file through two pinned host buffers, a piece at a time.

Parameter gradients are most of a full dump (2 GB of a 0.5B model's 2.2 GiB). Copying each into a
pinned host tensor of its own first means page-locking as much host memory as the dump holds, and
the torch host allocator rounds every block up to a power of two. Here the bytes go through two
fixed buffers instead: one is filled by an asynchronous copy on a side stream while the other is
written, so the copy hides behind the disk.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megalign.dump.tensorfile import tensor_bytes

PIECE_BYTES = 32 << 20


class PinnedBuffers:
    """Two pinned buffers of `piece_bytes`, made at the first device tensor; one thread uses them."""

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        self.piece_bytes = piece_bytes
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def pieces(self, tensor: torch.Tensor) -> Iterator:
        """The bytes of a contiguous tensor, in order. A CPU tensor is one piece, its own memory; a
        device tensor's pieces are views of the pinned buffers, each valid until the next is asked for.
        The device tensor must be final: its producer's stream was synchronised before."""
        if tensor.device.type == "cpu":
            yield tensor_bytes(tensor)
            return
        flat = tensor.reshape(-1).view(torch.uint8)
        if not self._buffers:
            self._buffers = [torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        if tensor.device not in self._streams:
            self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream = self._streams[tensor.device]
        spans = [(start, min(start + self.piece_bytes, flat.numel()))
                 for start in range(0, flat.numel(), self.piece_bytes)]
        copied = [torch.cuda.Event(), torch.cuda.Event()]

        def copy(i: int) -> None:
            start, end = spans[i]
            with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
                self._buffers[i % 2][:end - start].copy_(flat[start:end], non_blocking=True)
                copied[i % 2].record(stream)

        if spans:
            copy(0)
        for i, (start, end) in enumerate(spans):
            if i + 1 < len(spans):
                copy(i + 1)  # into the other buffer, whose piece the caller has written by now
            copied[i % 2].synchronize()
            yield self._buffers[i % 2][:end - start].numpy()
