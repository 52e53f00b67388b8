"""Write what an sglang server's dumper writes, with sglang's own dumper code (sglang_writer.load_sglang_dumper):
per forward pass the forward batch's core fields (input_ids, positions, seq_lens, rids) and one per-token
tensor, `hidden`, as a model's layer output would be dumped.

The engine is a toy whose per-token output depends on the token and its position only, so any token's
output is known without the engine: hidden[t] = [token, position]. The passes: request a's prefill in
two chunks, b's prefill after a cached prefix (a's first 3 tokens), a mixed pass (a decodes, b's last
chunk), then two decode passes of both. `swap` swaps a's and b's rows of `hidden` in the last pass
(two requests' decode steps swapped).

    python sglang_server_writer.py OUT [swap]
"""

from __future__ import annotations

import sys

import torch
from sglang_writer import load_sglang_dumper

A = [11, 12, 13, 14, 15, 16]  # prompt of a
B = [11, 12, 13, 24, 25]  # prompt of b: a's first 3 tokens, cached
# Per pass: (rid, first position, tokens) of each request, in batch order.
PASSES = [
    [("a", 0, A[:4])],  # chunked prefill: a's first chunk
    [("a", 4, A[4:])],  # a's last chunk
    [("a", 6, [31]), ("b", 3, B[3:])],  # mixed: a decodes, b extends after its cached prefix
    [("a", 7, [32]), ("b", 5, [41])],
    [("a", 8, [33]), ("b", 6, [42])],
]


def main(out: str, swap: bool = False) -> None:
    dumper = load_sglang_dumper().dumper
    dumper.configure(enable=True, dir=out, exp_name="exp", enable_output_console=False)
    for index, batch in enumerate(PASSES):
        ids = [t for _, _, tokens in batch for t in tokens]
        positions = [start + k for _, start, tokens in batch for k in range(len(tokens))]
        hidden = torch.tensor([[float(t), float(p)] for t, p in zip(ids, positions)])
        if swap and index == len(PASSES) - 1:
            hidden = hidden.flip(0)
        dumper.dump("input_ids", torch.tensor(ids))
        dumper.dump("positions", torch.tensor(positions))
        dumper.dump("seq_lens", torch.tensor([start + len(tokens) for _, start, tokens in batch]))
        dumper.dump("rids", [rid for rid, _, _ in batch])
        dumper.dump("hidden", hidden)
        dumper.step()


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "swap")
