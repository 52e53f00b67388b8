"""What `megalign.Dumper` costs a user's training loop: a Hugging Face LlamaForCausalLM from a random
config, AdamW, a few steps, timed with the Dumper off (what `Dumper.from_env()` gives with
MEGALIGN_DUMP unset), dumping everything (every module's output and its gradient, the parameter
gradients and the parameters, each step) and stats-only. Prints ratios to the loop without the
Dumper only (the median of the rounds, modes interleaved), never times: those say only what this
machine did. Issue 20's bar: a full dump at most 1.5x on the CPU and 1.2x on a GPU; stats-only 1.05x.

Two ratios a mode: `step`, the median step (each step timed alone, the device synchronised around
it), and `loop`, the timed steps and the Dumper's close() together (the writing threads done, the
dump landed). Each loop's first step is untimed, as a training run's first is (the Dumper compiles
its device statistics there); the dump is removed afterwards, untimed.

A full dump writes every tensor, and the disk bounds it: after the rounds the same bytes are written
once more as one plain sequential write into the same folder (from one host buffer, into the page
cache as the dump's files are), and `bound` is the full loop against the loop without the Dumper
plus that write: 1.00x is a Dumper that costs nothing but the disk's time.

`--dumped every:K` dumps every K-th step only (steps=, as MEGALIGN_DUMP_STEPS reads it), as a long
run dumps a few of its steps: the files of a dumped step are written while the next steps train.

usage: python bench/bench_trainer.py [--device cuda] [--steps 4] [--rounds 3] [--modes full,stats-only]
                                     [--dumped all|every:K|1,2] [--hidden H --layers L --vocab V --batch B --seq S]
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
from megalign.capture.dumper import NullDumper
from megalign.capture.steps import choose_steps
from megalign.errors import UserError

# A model that takes a CPU seconds, and one that keeps a GPU busy for as long.
SIZES = {"cpu": dict(hidden=128, layers=2, vocab=1024, batch=4, seq=64),
         "cuda": dict(hidden=1024, layers=8, vocab=32000, batch=8, seq=1024)}
MODES = {"full": dict(params=True), "stats-only": dict(stats_only=True)}
CHUNK = 64 << 20  # the plain write's pieces


def step(model, optimizer, ids: torch.Tensor, dumper, n: int) -> None:
    """One step of the user's loop, as it would be written with the Dumper in it."""
    with dumper.step(n):
        loss = model(input_ids=ids, labels=ids).loss
        dumper.add("loss", "loss", loss.detach())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(model, optimizer, batches, mode: str, folder: Path, dumped: str) -> tuple[float, float, int]:
    """The median step after the first and the seconds of those steps and the dump's close (its
    files written); the first step is untimed, as a training run's first is. Also the bytes dumped."""
    out = folder / mode
    dumper = NullDumper() if mode == "off" else megalign.Dumper(out, steps=dumped, **MODES[mode])
    dumper.watch(model)
    step(model, optimizer, batches[0], dumper, 0)
    synchronize()
    steps = []
    for n, ids in enumerate(batches[1:], 1):
        start = time.perf_counter()
        step(model, optimizer, ids, dumper, n)
        synchronize()
        steps.append(time.perf_counter() - start)
    start = time.perf_counter()
    dumper.close()
    synchronize()
    loop = sum(steps) + time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    # Untimed: the kernel's writeback of a full dump's pages would otherwise run during the next loop
    # (stats-only 1.75x after a full loop, 1.3x on a quiet disk, hidden 128 on 2 cores).
    os.sync()
    return statistics.median(steps), loop, dumper.bytes_written


def plain_write(folder: Path, size: int) -> float:
    """Seconds to write `size` bytes as one sequential file into `folder`, as the dump's files go
    (the page cache, no fsync); the file removed afterwards, and its pages written back, untimed."""
    piece = memoryview(os.urandom(min(CHUNK, size)))
    path = folder / "plain-write"
    start = time.perf_counter()
    with open(path, "wb") as file:
        for at in range(0, size, CHUNK):
            file.write(piece[:min(CHUNK, size - at)])
    seconds = time.perf_counter() - start
    path.unlink()
    os.sync()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=positive, default=4, help="steps a loop, the first untimed (at least 2)")
    parser.add_argument("--rounds", type=positive, default=3, help="timed loops of each mode (the median is used)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"the Dumper's modes timed, of {', '.join(MODES)}")
    parser.add_argument("--dumped", default="all", help="the steps dumped, as MEGALIGN_DUMP_STEPS: all, every:K, 1,2")
    for name in SIZES["cpu"]:
        parser.add_argument(f"--{name}", type=positive, help="default: by the device, " +
                            ", ".join(f"{d} {s[name]}" for d, s in SIZES.items()))
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first is untimed)")
    modes = args.modes.split(",")
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    try:
        choice = choose_steps(args.dumped, "--dumped")
    except UserError as error:
        parser.error(str(error))
    dumped = [n for n in range(args.steps) if choice.wants(n)]
    if not dumped:
        parser.error(f"--dumped {args.dumped}: none of the {args.steps} steps")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    size = {name: getattr(args, name) or default for name, default in SIZES[device].items()}
    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=size["seq"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device) for _ in range(args.steps)]
    runs: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in ("off", *modes)}
    with tempfile.TemporaryDirectory(prefix="megalign-bench-trainer-") as folder:
        timed(model, optimizer, batches, "off", Path(folder), args.dumped)  # warm-up: allocator, kernels, page cache
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(timed(model, optimizer, batches, mode, Path(folder), args.dumped))
        per_step = {mode: run[0][2] / len(dumped) for mode, run in runs.items()}  # a dumped step's bytes
        full_bytes = int(per_step["full"] * sum(n > 0 for n in dumped)) if "full" in runs else 0  # the timed steps'
        write = statistics.median(plain_write(Path(folder), full_bytes) for _ in range(args.rounds)) if full_bytes else 0
    step_off, loop_off = (statistics.median(run[i] for run in runs["off"]) for i in (0, 1))
    print(f"bench_trainer: LlamaForCausalLM hidden {size['hidden']}, {size['layers']} layers, vocab {size['vocab']}, "
          f"batch {size['batch']}x{size['seq']}, {args.steps} steps (the first untimed), steps dumped: {args.dumped}, "
          f"on {device}; median of {args.rounds} rounds")
    for mode in modes:
        step_ratio, loop_ratio = (statistics.median(run[i] for run in runs[mode]) / off
                                  for i, off in ((0, step_off), (1, loop_off)))
        bound = (f"   bound {statistics.median(run[1] for run in runs[mode]) / (loop_off + write):.2f}x"
                 if mode == "full" else "")
        print(f"  {mode:<10} / off: step {step_ratio:.2f}x   loop {loop_ratio:.2f}x{bound}   "
              f"({per_step[mode] / 2**20:.0f} MiB a dumped step)")
    if full_bytes:
        print(f"  the plain write of a full loop's bytes / the loop without the Dumper: {write / loop_off:.2f}x")


if __name__ == "__main__":
    main()
