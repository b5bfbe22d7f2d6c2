#!/usr/bin/env bash
# Peak GPU memory per ZeRO stage for the ~1B decoder on all GPUs of the machine, against the plan,
# plus recomputation and optimizer offload (docs/benchmarks.md). Builds first if needed.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -x build-gpu/dsrun ] || scripts/gpu_build.sh -j 8 -R "parameter counts" > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
db=/tmp/mem.db
big=recipes/gpu/deepseek_1b_h200.toml
run() { build-gpu/dsrun run $big --db "$db" --set run.steps=12 --set hardware.devices_per_node=$gpus "$@" >> "$out/memory_runs.log" 2>&1; echo "run $* -> $?"; }
run --set parallel.data_parallel=1 --set batch.global=8 --set parallel.zero_stage=0 --set run.name=mem-1gpu-zero0
for stage in 0 1 2 3; do
  run --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set parallel.zero_stage=$stage --set run.name=mem-${gpus}gpu-zero$stage
done
run --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set parallel.zero_stage=3 --set parallel.activation_checkpointing=full --set run.name=mem-${gpus}gpu-zero3-recompute
run --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set parallel.zero_stage=2 --set parallel.offload=optimizer --set run.name=mem-${gpus}gpu-zero2-offload
python3 bench/gpu_summary.py "$db" | tee "$out/memory_summary.txt"
