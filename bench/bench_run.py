"""Benchmark of `megalign forward/backward`: ratios from one run, never absolute times as claims.

1. Forward-only peak memory with and without megatron DDP wrapping (why forward never wraps):
   each variant in a fresh process, world size 1 on gloo, the llama-0.1b config.
2. Backward time with a full dump, with --stats-only and with no dump (--filter matching nothing:
   hooks installed, no tensor copied), through the real CLI; time is the workers' own elapsed_s
   from dump.json, so interpreter start-up is left out; the fastest of three runs of each (--repeats).
3. The full dump's added time against one plain sequential write of as many bytes to the same disk
   (the fastest of three): near 1x, the dump runs at the speed of one writing thread; under 1x, faster
   (the writer writes several files side by side where there are cores for it). And that write
   against the run with no dump: what writing the bytes from one thread would add to the run.

usage: python bench/bench_run.py [--config configs/llama-0.1b.yaml] [--device cuda] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def forward_memory(config: Path, ddp: bool, device: str) -> dict:
    """In this process: build the model as the worker does, optionally wrap it in DDP, run forward."""
    if device == "cpu":
        from megalign.stacks.megatron.cpu_patches import apply_cpu_patches, install_import_stubs

        install_import_stubs()
        apply_cpu_patches()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megalign.run.tokens import default_tokens
    from megalign.spec import ModelConfig, RunSpec
    from megalign.stacks.batch import batch_rows, build_batch
    from megalign.stacks.megatron.model import build_model, load_weights, transformer_config
    from megalign.stacks.seeded import seeded_weights

    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    model_config = ModelConfig.from_yaml(config)
    tokens = default_tokens(model_config.vocab_size)
    spec = RunSpec(mode="forward", out="", model=model_config, tokens=tokens, seq_len=32, device=device)
    before = rss_bytes()
    torch_config = transformer_config(spec)
    model = build_model(spec, torch_config)
    load_weights(model, model_config, seeded_weights(spec.seed, model_config.init_method_std))
    if ddp:
        model = DistributedDataParallel(torch_config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.train(False)
    batch = {k: v.to(device) for k, v in build_batch(tokens, batch_rows(spec)).as_dict().items()}
    with torch.no_grad():
        model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        return {"peak": peak, "model_part": peak}
    return {"peak": peak_rss_bytes(), "model_part": peak_rss_bytes() - before}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_memory(config: Path, device: str) -> dict:
    results = {}
    for ddp in (False, True):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        done = subprocess.run([sys.executable, __file__, "--config", str(config), "--device", device,
                               "--memory-child", str(int(ddp))], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"memory run failed:\n{done.stderr[-3000:]}")
        results[ddp] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def measure_backward(config: Path, device: str, repeats: int = 3) -> dict:
    """Each variant `repeats` times, interleaved; the fastest of each counts (least disturbed)."""
    variants = {"full dump": [], "--stats-only": ["--stats-only"], "no dump": ["--filter", "(?!)"]}
    best: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for label, extra in variants.items():
                out = Path(tmp) / label.replace(" ", "-").strip("-")
                done = subprocess.run([sys.executable, "-m", "megalign", "backward", "--config", str(config),
                                       "--device", device, "--out", str(out), "--overwrite", *extra],
                                      capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"backward run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                seconds = json.loads((out / "dump.json").read_text())["elapsed_s"]
                size = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
                best[label] = min(best.get(label, (seconds, size)), (seconds, size))
    return best


def write_seconds(folder: Path, size: int, repeats: int = 3) -> float:
    """The fastest of `repeats` plain sequential writes of `size` bytes into a new file in `folder`:
    what the disk takes for a dump's bytes, whatever writes them."""
    block = bytearray(16 << 20)
    best = float("inf")
    for _ in range(repeats):
        with tempfile.NamedTemporaryFile(dir=folder) as f:
            start = time.perf_counter()
            for _ in range(0, size, len(block)):
                f.write(block)
            f.flush()
            best = min(best, time.perf_counter() - start)
    return best


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "llama-0.1b.yaml")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=positive, default=3, help="runs of each variant; the fastest counts")
    parser.add_argument("--memory-child", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        print(json.dumps(forward_memory(args.config, bool(args.memory_child), args.device)))
        return

    print(f"megalign run benchmark, model {args.config.name}, 2 sequences (32 and 20 tokens), "
          f"{args.device}, world size 1")
    memory = measure_memory(args.config, args.device)
    what = "peak GPU memory allocated" if args.device == "cuda" else "peak RSS (whole process)"
    print(f"forward-only {what}, DDP-wrapped / plain: {memory[True]['peak'] / memory[False]['peak']:.2f}x")
    if args.device == "cpu":
        print(f"forward-only RSS added by the model run, DDP-wrapped / plain: "
              f"{memory[True]['model_part'] / memory[False]['model_part']:.2f}x")
    backward = measure_backward(args.config, args.device, args.repeats)
    base, _ = backward["no dump"]
    for label in ("full dump", "--stats-only"):
        seconds, size = backward[label]
        print(f"backward time, {label} / no dump: {seconds / base:.2f}x"
              + (f"   ({size / 2**20:.0f} MiB of tensors)" if size else ""))
    seconds, size = backward["full dump"]
    write = write_seconds(Path(tempfile.gettempdir()), size)
    print(f"full dump's added time / one sequential write of its {size / 2**20:.0f} MiB on the same disk: "
          f"{(seconds - base) / write:.2f}x")
    print(f"one sequential write of those bytes / backward time with no dump: {write / base:.2f}x   "
          f"(what writing them from one thread would add)")


if __name__ == "__main__":
    main()
