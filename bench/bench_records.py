"""What a stats-only step costs the host, record by record: the Dumper in bench_trainer.py's loop against
the same loop without it, counted per record. Times say only what this machine did; the counts do
not depend on it.

- `host us`: the step's host time (no synchronisation inside the step) beyond the loop's, a record;
- `python calls`: function calls (cProfile) beyond the loop's, a record;
- `aten ops`: torch operators called (torch.profiler; not those an operator calls inside itself)
  beyond the loop's, a record: on a device, about a kernel launch or a copy each; `item`: those that
  read a value back (a sync on a device);
- on a GPU, the CUDA runtime's calls beyond the loop's, a record: kernel launches (torch's and
  Triton's), copies, and the calls that wait (stream, event or device synchronize);
- where the host time goes: the Dumper's own functions, each's time a record (inclusive: a
  function's callees are in its figure too).

usage: python bench/bench_records.py [--device cuda] [--steps 6] [--hidden H --layers L --vocab V --batch B --seq S]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import collections
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_run import positive  # bench/ is this script's own folder on sys.path
from bench_trainer import SIZES, step, synchronize
from transformers import LlamaConfig, LlamaForCausalLM

import megalign
import megalign.capture.dumper as dumper_module
import megalign.capture.grad_reads as grad_reads
import megalign.dump.stats as stats
import megalign.dump.writer as writer
from megalign.capture.dumper import NullDumper

# The Dumper's functions a record passes through (and the gradients' fingerprints, three a step), timed.
TIMED = [(dumper_module.Dumper, "add_output"), (dumper_module.Dumper, "_record"), (writer.RankWriter, "add"),
         (writer, "_located"), (writer, "host_summary"), (stats.SummaryBatch, "add"),
         (stats.SummaryBatch, "take"), (grad_reads, "_fingerprint")]
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def timed(spent: collections.Counter) -> None:
    """Wrap TIMED, adding each call's nanoseconds to spent[name]."""
    for owner, name in TIMED:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, __original=original, __name=f"{owner.__name__.rpartition('.')[2]}.{name}", **kwargs):
            start = time.perf_counter_ns()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__name] += time.perf_counter_ns() - start

        setattr(owner, name, wrapper)


def loop(model, optimizer, batches, dumper, device: str, spent: collections.Counter) -> dict:
    """The loop's steps after the first (untimed, as bench_trainer's) timed, then one more step
    profiled; `spent` holds the timed steps' time in TIMED only."""
    dumper.watch(model)
    step(model, optimizer, batches[0], dumper, 0)
    synchronize()
    host, before, first = [], collections.Counter(spent), _records(dumper)
    for n, ids in enumerate(batches[1:], 1):
        synchronize()
        start = time.perf_counter()
        step(model, optimizer, ids, dumper, n)
        host.append(time.perf_counter() - start)
        synchronize()
    spent.subtract(before)
    timed_records = _records(dumper) - first
    profile = cProfile.Profile()
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as traced:
        profile.enable()
        step(model, optimizer, batches[1], dumper, len(batches))
        profile.disable()
        synchronize()
    # Operators called by the loop or the Dumper, not those one calls inside itself (a multi-tensor
    # operator's per-tensor calls on a CPU): what a device launches, about.
    names = collections.Counter(event.name for event in traced.events()
                                if not (event.cpu_parent and event.cpu_parent.name.startswith("aten::")))
    records = _records(dumper) - first
    dumper.close()
    return {"host": statistics.median(host), "calls": pstats.Stats(profile).total_calls,
            "aten": sum(n for name, n in names.items() if name.startswith("aten::")),
            "item": names["aten::item"], "launches": sum(names[name] for name in LAUNCHES),
            "copies": names["cudaMemcpyAsync"], "waits": sum(names[name] for name in WAITS),
            "records": (records - timed_records) or 1, "timed_records": timed_records or 1}


def _records(dumper) -> int:
    return len(dumper._writer.records) if hasattr(dumper, "_writer") else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=positive, default=6, help="steps a loop, the first untimed (at least 3)")
    for name in SIZES["cpu"]:
        parser.add_argument(f"--{name}", type=positive, help="default: bench_trainer's by the device")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    size = {name: getattr(args, name) or default for name, default in SIZES[device].items()}
    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=size["seq"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device) for _ in range(args.steps)]
    spent: collections.Counter = collections.Counter()
    loop(model, optimizer, batches, NullDumper(), device, spent)  # warm-up
    off = loop(model, optimizer, batches, NullDumper(), device, spent)
    timed(spent)
    with tempfile.TemporaryDirectory(prefix="megalign-bench-records-") as folder:
        on = loop(model, optimizer, batches, megalign.Dumper(Path(folder) / "stats", stats_only=True), device, spent)
    n = on["records"]  # the profiled step's
    print(f"bench_records: LlamaForCausalLM hidden {size['hidden']}, {size['layers']} layers, vocab {size['vocab']}, "
          f"batch {size['batch']}x{size['seq']}, on {device}; stats-only, {n:.0f} records a step")
    print(f"  host step: off {off['host'] * 1e3:.2f} ms, stats-only {on['host'] * 1e3:.2f} ms "
          f"({on['host'] / off['host']:.2f}x): {(on['host'] - off['host']) / n * 1e6:.1f} us a record")
    print("  a record, beyond the loop: " + ", ".join(
        f"{label} {(on[key] - off[key]) / n:.2f}" for key, label in
        (("calls", "python calls"), ("aten", "aten ops"), ("item", "item"), ("launches", "kernel launches"),
         ("copies", "async copies"), ("waits", "waits"))))
    for name, ns in spent.most_common():  # over the timed steps
        print(f"  {name:28s} {ns / on['timed_records'] / 1e3:7.2f} us a record")


if __name__ == "__main__":
    main()
