#!/usr/bin/env bash
# megalign on one GPU (NCCL, world 1): fp32, bf16 and the fp64 reference, tiny and a 0.5B Qwen2
# layout, GPU vs CPU (with and without --reference), a planted --loss-norm local run, packed rows
# and the MoE model with routing replay, and the speed and memory ratios. Ends with a table of
# expectations; exits non-zero when one fails.
#
#   bash bench/gpu.sh [OUTDIR]            (OUTDIR default: $OUT, else gpu-out)
#   QUICK=1 DEVICE=cpu bash bench/gpu.sh  (a dry run of the script itself on a CPU, tiny model only)
#   STAGE=runs, then STAGE=bench          (two calls on one machine, each within a call's time limit:
#                                          the bench stage reads the dumps the runs stage left)
#   STAGE=trainer                         (one call: the Dumper in a user's loop, bench_trainer.py at two widths,
#                                          a stats-only step's host work a record, bench_records.py, the
#                                          sketch's kernel against a plain sum, bench_sketch.py, and the
#                                          Dumper's device tests)
#   STAGE=scale8b                         (one call on its own, on an H200: Llama-3-8B's shape at full depth,
#                                          bench/llama-3-8b.yaml, 2x4096 tokens, bf16 against fp32 under
#                                          --recompute full through megalign check --zoom: its wall time and disk)
#   STAGE=scale                           (one call on its own: the 8B-wide model, bench/llama-8b-wide.yaml,
#                                          2x2048 tokens, bf16 and fp32 backward with full dumps, a stats-only
#                                          run and their compare; bench/scale_figures.py prints the figures)
#
# Needs megatron-core importable; where a folder .whl holds its wheel, it is installed from there
# first (the lent GPU machines reach no package index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-gpu-out}}
DEVICE=${DEVICE:-cuda}
DUMPS=${DUMPS:-/tmp/megalign-gpu-dumps}
LOGS=$DUMPS/logs  # every command's log; what comes back in OUTDIR is the summary (8 files at most)
STAGE=${STAGE:-all}
[ "$STAGE" = bench ] || rm -rf "$DUMPS"
mkdir -p "$OUTDIR" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  # Bytecode compiled at install: each rank would otherwise compile megatron-core's sources as it imports them.
  # The wheel for the host's Python, of those in .whl (one a Python version: cp311, cp312).
  python3 -m pip install -q --no-index --no-deps --find-links .whl --target /tmp/megalign-site megatron-core || exit 1
  export PYTHONPATH=/tmp/megalign-site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m compileall -q megalign
# What an install does once, done here on the bare host: bytecode for the host's own packages (torch
# and what it imports came without it: each of a run's three processes compiled their sources, 2 to
# 5 s each, measured with py-spy), and numba's compare kernels into its on-disk cache (5 s at the
# first compare otherwise).
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
timeout 120 python3 -m compileall -q -j 0 "$site" >/dev/null 2>&1 || echo "bytecode for $site: not all compiled"
python3 -c "from megalign.compare.fused import load_kernels; load_kernels()"
M="python3 -m megalign"
RESULTS="$OUTDIR/results.txt"
: >"$RESULTS"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi";
  python3 -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'; } \
  | tee "$OUTDIR/machine.txt"

# expect NAME WANTED_RC COMMAND...: run it, keep its log, record whether its exit code was the wanted one,
# and its wall time in $LOGS/walls.txt.
expect() {
  local name=$1 wanted=$2; shift 2
  local start=$EPOCHREALTIME
  "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local wall; wall=$(python3 -c "print(f'{$EPOCHREALTIME - $start:.1f}')")
  echo "$name $wall" >>"$LOGS/walls.txt"
  local verdict=ok; [ "$rc" = "$wanted" ] || verdict=FAILED
  printf '%-34s exit %s (wanted %s)  %6ss  %s\n' "$name" "$rc" "$wanted" "$wall" "$verdict" | tee -a "$RESULTS"
}

# The scale stage: the 8B-wide model at 2x2048 tokens (QUICK=1: the tiny model at 2x32). The stats-only run goes first (its dump is
# small): the two full dumps are about 60 GiB together on a disk of 64 GiB.
if [ "$STAGE" = scale ]; then
  s=$DUMPS/scale
  mkdir -p "$s"
  cfg=bench/llama-8b-wide.yaml; n=2048
  [ -n "${QUICK:-}" ] && { cfg=configs/tiny.yaml; n=32; }  # a dry run of the stage itself
  python3 -c "import json, random; from megalign.spec import ModelConfig; r = random.Random(0); \
vocab = ModelConfig.from_yaml('$cfg').vocab_size; print(json.dumps([[r.randrange(vocab) for _ in range($n)]] * 2))" \
    >"$s/tokens.json"
  big="-c $cfg --tokens $s/tokens.json --device $DEVICE"
  expect "scale-bwd-bf16-stats-only" 0 $M backward $big --dtype bf16 --stats-only --out "$s/bf16-stats"
  expect "scale-bwd-bf16" 0 $M backward $big --dtype bf16 --out "$s/bf16"
  expect "scale-bwd-fp32" 0 $M backward $big --out "$s/fp32"
  expect "scale-compare-bf16-vs-fp32" 0 $M compare "$s/bf16" "$s/fp32"
  expect "bench-compare-scale" 0 python3 bench/bench_compare.py --dumps "$s/bf16" "$s/fp32" --once
  python3 bench/scale_figures.py "$s" "$LOGS/walls.txt" "$LOGS/bench-compare-scale.log" | tee "$OUTDIR/scale.txt"
  cp "$LOGS"/scale-*.log "$OUTDIR"/ 2>/dev/null
  echo "== results"; cat "$RESULTS"
  ! grep -q FAILED "$RESULTS"
  exit
fi

# The scale8b stage: Llama-3-8B's shape at full depth (QUICK=1: the tiny model at 2x32 tokens), 2x4096
# tokens, bf16 against fp32 under --recompute full (fp32 without it needs about 180 GB): `megalign check
# --zoom`, a stats-only pass over every tensor, then, where it diverges, both runs again with values for
# the tensors around the first divergence. Its wall time is the verdict's, and du says the disk of all it
# wrote. Where bf16 and fp32 agree there is no second pass: the target's weights drawn from another seed
# then force one (a divergence at the first activation), unless the first check left too little of the
# call's 10 minutes.
if [ "$STAGE" = scale8b ]; then
  s=$DUMPS/scale8b
  mkdir -p "$s"
  cfg=bench/llama-3-8b.yaml; n=4096
  [ -n "${QUICK:-}" ] && { cfg=configs/tiny.yaml; n=32; }  # a dry run of the stage itself
  python3 -c "import json, random; from megalign.spec import ModelConfig; r = random.Random(0); \
vocab = ModelConfig.from_yaml('$cfg').vocab_size; print(json.dumps([[r.randrange(vocab) for _ in range($n)]] * 2))" \
    >"$s/tokens.json"
  big=(-c "$cfg" --tokens "$s/tokens.json" --device "$DEVICE" --recompute full --baseline "--dtype bf16" --zoom)
  started=$SECONDS
  expect "scale8b-check-zoom-bf16-vs-fp32" 0 $M check "${big[@]}" --out "$s/bf16-vs-fp32"
  checks="bf16-vs-fp32"
  if grep -q "nothing to zoom into" "$LOGS/scale8b-check-zoom-bf16-vs-fp32.log"; then
    if [ $((SECONDS - started)) -lt 240 ]; then
      expect "scale8b-check-zoom-other-seed" 1 $M check "${big[@]}" --target "--seed 7" --out "$s/other-seed"
      checks="$checks other-seed"
    else
      echo "scale8b-check-zoom-other-seed: not run, the first check took $((SECONDS - started)) s" | tee -a "$RESULTS"
    fi
  fi
  for c in $checks; do
    log=$LOGS/scale8b-check-zoom-$c.log
    echo "== $c: wall $(awk -v n="scale8b-check-zoom-$c" '$1 == n {print $2}' "$LOGS/walls.txt") s," \
      "disk $(du -sh "$s/$c" | cut -f1) (stats-only pass $(du -sh "$s/$c/stats-only" | cut -f1)," \
      "zoomed pass $( [ -d "$s/$c/zoomed" ] && du -sh "$s/$c/zoomed" | cut -f1 || echo none))"
    grep -E "^(tensors|size|time) |compared, |first divergence|zoomed: |nothing to zoom|^error" "$log"
  done | tee "$OUTDIR/scale8b.txt"
  cp "$LOGS"/scale8b-*.log "$OUTDIR"/ 2>/dev/null
  echo "== results"; cat "$RESULTS"
  ! grep -q FAILED "$RESULTS"
  exit
fi

# The trainer stage: what the Dumper costs a user's loop (bench_trainer.py) at the width measured so far
# (hidden 1024) and at an 8B model's (hidden 4096: its full dump of two layers alone is about 10 GiB a
# step), and the Dumper's device tests. QUICK=1: the smallest model, a dry run of the stage itself.
if [ "$STAGE" = trainer ]; then
  bt="python3 bench/bench_trainer.py --device $DEVICE"
  narrow="--hidden 1024 --layers 4 --batch 4 --seq 512"; wide="--hidden 4096 --batch 2 --seq 2048"
  [ -n "${QUICK:-}" ] && { narrow="--hidden 64 --layers 1 --vocab 256 --batch 2 --seq 16"; wide=$narrow; }
  expect "pytest-device-dumper" 0 python3 -m pytest -q -p no:cacheprovider tests/unit/test_stats.py \
    tests/unit/test_sketch.py tests/compare/test_fast_paths.py -k "device or triton_kernel or cuda"
  if [ "$DEVICE" = cuda ]; then expect "bench-sketch" 0 python3 bench/bench_sketch.py; fi
  expect "bench-trainer-1024" 0 $bt $narrow --steps 6 --rounds 3
  # Where a stats-only step's host time goes, record by record (calls, operators, launches, waits).
  expect "bench-records-1024" 0 python3 bench/bench_records.py --device "$DEVICE" $narrow
  expect "bench-records-4096" 0 python3 bench/bench_records.py --device "$DEVICE" $wide --layers 4
  expect "bench-trainer-4096-stats-only" 0 $bt $wide --layers 4 --steps 5 --rounds 3 --modes stats-only
  expect "bench-trainer-4096-full" 0 $bt $wide --layers 2 --steps 2 --rounds 1 --modes full
  # A long run dumps a few of its steps: every tenth, its files written while the next steps train.
  expect "bench-trainer-1024-full-every-10" 0 $bt $narrow --steps 21 --rounds 3 --modes full --dumped every:10
  expect "bench-trainer-4096-full-every-10" 0 $bt $wide --layers 2 --steps 21 --rounds 1 --modes full --dumped every:10
  for f in "$LOGS"/bench-sketch.log "$LOGS"/bench-trainer-*.log "$LOGS"/bench-records-*.log "$LOGS"/pytest-*.log; do [ -f "$f" ] || continue; echo "--- $(basename "$f")"; tail -n 12 "$f"; done \
    | tee "$OUTDIR/bench.txt"
  echo "== results"; cat "$RESULTS"
  ! grep -q FAILED "$RESULTS"
  exit
fi

models="tiny"
[ -z "${QUICK:-}" ] && models="tiny qwen2-0.5b"
[ "$STAGE" = bench ] && models=""
for model in $models; do
  cfg=configs/$model.yaml
  d=$DUMPS/$model
  expect "$model-fwd-$DEVICE-fp32" 0 $M forward --device "$DEVICE" -c "$cfg" --out "$d/fwd-fp32"
  expect "$model-fwd-$DEVICE-bf16" 0 $M forward --device "$DEVICE" -c "$cfg" --dtype bf16 --out "$d/fwd-bf16"
  expect "$model-bwd-$DEVICE-fp32" 0 $M backward --device "$DEVICE" -c "$cfg" --out "$d/bwd-fp32"
  expect "$model-bwd-$DEVICE-bf16" 0 $M backward --device "$DEVICE" -c "$cfg" --dtype bf16 --out "$d/bwd-bf16"
  expect "$model-bwd-$DEVICE-fp64" 0 $M backward --device "$DEVICE" -c "$cfg" --dtype fp64 --out "$d/bwd-fp64"
  expect "$model-bwd-cpu-fp32" 0 $M backward --device cpu -c "$cfg" --out "$d/cpu-fp32"
  # fp64 on the CPU for the tiny model only: the 0.5B one would take minutes of the lease.
  [ "$model" = tiny ] && expect "$model-bwd-cpu-fp64" 0 $M backward --device cpu -c "$cfg" --dtype fp64 --out "$d/cpu-fp64"
  expect "$model-bwd-cpu-cp2-local" 0 $M backward --device cpu -c "$cfg" --cp 2 --loss-norm local --out "$d/cpu-cp2-local"
  expect "$model-compare-$DEVICE-vs-cpu" 0 $M compare "$d/bwd-fp32" "$d/cpu-fp32" --json "$LOGS/$model-gpu-vs-cpu.jsonl"
  expect "$model-compare-bf16-vs-fp32" 0 $M compare "$d/bwd-bf16" "$d/bwd-fp32"
  expect "$model-compare-fwd-bf16-vs-fp32" 0 $M compare "$d/fwd-bf16" "$d/fwd-fp32"
  expect "$model-bwd-$DEVICE-fp32-stats" 0 $M backward --device "$DEVICE" -c "$cfg" --stats-only --out "$d/bwd-fp32-stats"
  expect "$model-compare-stats-vs-full" 0 $M compare "$d/bwd-fp32" "$d/bwd-fp32-stats"
  expect "$model-compare-planted-local" 1 $M compare "$d/bwd-fp32" "$d/cpu-cp2-local"
  [ "$model" = tiny ] && expect "$model-compare-fp64-$DEVICE-vs-cpu" 0 $M compare "$d/bwd-fp64" "$d/cpu-fp64"
  expect "$model-compare-ref-$DEVICE-vs-cpu" 0 $M compare "$d/bwd-fp32" "$d/cpu-fp32" --reference "$d/bwd-fp64"
  expect "$model-compare-ref-bf16-vs-fp32" 0 $M compare "$d/bwd-bf16" "$d/bwd-fp32" --reference "$d/bwd-fp64"
  expect "$model-compare-ref-planted" 1 $M compare "$d/bwd-fp32" "$d/cpu-cp2-local" --reference "$d/bwd-fp64"
done

# The writer's device path (parameter gradients streamed through pinned buffers), where pytest is.
if [ "$STAGE" != bench ] && python3 -c "import pytest" 2>/dev/null; then
  expect "pytest-device-writer" 0 python3 -m pytest -q -p no:cacheprovider tests/compare/test_fast_paths.py tests/unit/test_stats.py -k device
fi

# The training layouts that fit one device: a packed (THD) row against the padded CPU run; the MoE
# model against its CPU run; a bf16 MoE run replaying the fp32 run's routing.
d=$DUMPS/layouts
if [ "$STAGE" != bench ]; then
expect "packed-bwd-$DEVICE" 0 $M backward --device "$DEVICE" --packed --out "$d/packed"
expect "compare-packed-$DEVICE-vs-padded-cpu" 0 $M compare "$DUMPS/tiny/cpu-fp32" "$d/packed"
expect "moe-bwd-$DEVICE" 0 $M backward --device "$DEVICE" -c configs/tiny-moe.yaml --out "$d/moe"
expect "moe-bwd-cpu" 0 $M backward --device cpu -c configs/tiny-moe.yaml --out "$d/moe-cpu"
expect "compare-moe-$DEVICE-vs-cpu" 0 $M compare "$d/moe" "$d/moe-cpu"
expect "moe-bwd-$DEVICE-bf16-replay" 0 $M backward --device "$DEVICE" -c configs/tiny-moe.yaml --dtype bf16 \
  --routing "replay:$d/moe" --out "$d/moe-bf16-replay"
expect "compare-moe-bf16-replay-vs-fp32" 0 $M compare "$d/moe" "$d/moe-bf16-replay"
fi

if [ -z "${QUICK:-}" ] && [ "$STAGE" != runs ]; then
  big=configs/qwen2-0.5b.yaml
  expect "bench-run-0.5b" 0 python3 bench/bench_run.py --device "$DEVICE" --config "$big" --repeats 4
  expect "bench-writer" 0 python3 bench/bench_writer.py --device "$DEVICE"
  expect "bench-trainer" 0 python3 bench/bench_trainer.py --device "$DEVICE"
  expect "bench-compare-0.5b-grads" 0 python3 bench/bench_compare.py \
    --dumps "$DUMPS/qwen2-0.5b/bwd-fp32" "$DUMPS/qwen2-0.5b/cpu-fp32"
fi

for f in "$LOGS"/*compare*.log; do echo "--- $(basename "$f")"; tail -n 6 "$f"; done >"$OUTDIR/compare-tails.txt"
for f in "$LOGS"/bench-*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; cat "$f"; }; done >"$OUTDIR/bench.txt"
cp "$LOGS"/qwen2-0.5b-compare-$DEVICE-vs-cpu.log "$LOGS"/qwen2-0.5b-gpu-vs-cpu.jsonl "$OUTDIR"/ 2>/dev/null
cat "$OUTDIR/bench.txt"
echo "== results"
cat "$RESULTS"
! grep -q FAILED "$RESULTS"
