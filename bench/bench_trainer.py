"""What `megalign.Dumper` costs a user's training loop: a Hugging Face LlamaForCausalLM from a random
config, AdamW, a few steps, timed with the Dumper off (what `Dumper.from_env()` gives with
MEGALIGN_DUMP unset), dumping everything (every module's output and its gradient, the parameter
gradients and the parameters, each step) and stats-only. Prints ratios to the loop without the
Dumper only (the median of the rounds, modes interleaved), never times: those say only what this
machine did. Issue 20's bar: a full dump at most 1.5x on the CPU and 1.2x on a GPU; stats-only 1.05x.

Each loop's first step is untimed, as a training run's first is (the Dumper compiles its device
statistics there); the timed steps end with the Dumper's close() (the writing threads done, the dump
landed); the dump is removed afterwards, untimed. The MiB a full dump writes a step say how far the
disk bounds it.

usage: python bench/bench_trainer.py [--device cuda] [--steps 4] [--rounds 3] [--hidden H --layers L ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_run import positive  # bench/ is this script's own folder on sys.path
from transformers import LlamaConfig, LlamaForCausalLM

import megalign
from megalign.dump.dumper import NullDumper

# A model that takes a CPU seconds, and one that keeps a GPU busy for as long.
SIZES = {"cpu": dict(hidden=128, layers=2, vocab=1024, batch=4, seq=64),
         "cuda": dict(hidden=1024, layers=8, vocab=32000, batch=8, seq=1024)}
MODES = {"full": dict(params=True), "stats-only": dict(stats_only=True)}


def step(model, optimizer, ids: torch.Tensor, dumper, n: int) -> None:
    """One step of the user's loop, as it would be written with the Dumper in it."""
    with dumper.step(n):
        loss = model(input_ids=ids, labels=ids).loss
        dumper.add("loss", "loss", loss.detach())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def timed(model, optimizer, batches, mode: str, folder: Path) -> tuple[float, int]:
    """Seconds of the loop's steps after the first, and the dump's close (its files written); the
    first step is untimed, as a training run's first is (the Dumper compiles its device statistics
    there). Also the bytes dumped a step."""
    out = folder / mode
    dumper = NullDumper() if mode == "off" else megalign.Dumper(out, **MODES[mode])
    dumper.watch(model)
    step(model, optimizer, batches[0], dumper, 0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for n, ids in enumerate(batches[1:], 1):
        step(model, optimizer, ids, dumper, n)
    dumper.close()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    # Untimed: the kernel's writeback of a full dump's pages would otherwise run during the next loop
    # (stats-only 1.75x after a full loop, 1.3x on a quiet disk, hidden 128 on 2 cores).
    os.sync()
    return seconds, dumper.bytes_written // len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=positive, default=4, help="steps a loop, the first untimed (at least 2)")
    parser.add_argument("--rounds", type=positive, default=3, help="timed loops of each mode (the median is used)")
    for name in SIZES["cpu"]:
        parser.add_argument(f"--{name}", type=positive, help="default: by the device, " +
                            ", ".join(f"{d} {s[name]}" for d, s in SIZES.items()))
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first is untimed)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    size = {name: getattr(args, name) or default for name, default in SIZES[device].items()}
    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=size["seq"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device) for _ in range(args.steps)]
    seconds: dict[str, list[float]] = {mode: [] for mode in ("off", *MODES)}
    dumped: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="megalign-bench-trainer-") as folder:
        timed(model, optimizer, batches, "off", Path(folder))  # warm-up: allocator, kernels, page cache
        for _ in range(args.rounds):
            for mode in seconds:
                took, dumped[mode] = timed(model, optimizer, batches, mode, Path(folder))
                seconds[mode].append(took)
    off = statistics.median(seconds["off"])
    print(f"bench_trainer: LlamaForCausalLM hidden {size['hidden']}, {size['layers']} layers, vocab {size['vocab']}, "
          f"batch {size['batch']}x{size['seq']}, {args.steps} steps (the first untimed), on {device}; median of "
          f"{args.rounds} rounds")
    for mode in MODES:
        print(f"  {mode:<10} / off: {statistics.median(seconds[mode]) / off:.2f}x   "
              f"({dumped[mode] / 2**20:.0f} MiB dumped a step)")


if __name__ == "__main__":
    main()
