#!/usr/bin/env bash
# Two GPUs or more (every GPU of the machine): build, CUDA tests, ZeRO 0-3 loss agreement (small
# model, fp32 and bf16) against 1 GPU, the ~1B decoder's speed on 1 and N GPUs (scaling) against
# PyTorch DDP, memory per stage against the plan, recomputation and optimizer offload.
# Usage (device): bash bench/gpu_two.sh        with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5
build_and_test "${GPU_TESTS:-CUDA|reductions start during backward|AdamW|Gloo}"
db=/tmp/two.db
run() { build-gpu/dsrun run "$@" --db "$db" --set hardware.devices_per_node=$gpus >> "$out/runs.log" 2>&1; echo "run ${*: -1} -> $?"; }
small=recipes/gpu/small_gpu_check.toml
for dtype in fp32 bf16; do
  run $small --set precision.dtype=$dtype --set parallel.data_parallel=1 --set parallel.zero_stage=0 --set run.name=check-$dtype-1gpu-zero0
  for stage in 0 1 2 3; do
    run $small --set precision.dtype=$dtype --set parallel.data_parallel=$gpus --set parallel.zero_stage=$stage --set run.name=check-$dtype-${gpus}gpu-zero$stage
  done
done
run $small --set precision.dtype=bf16 --set parallel.data_parallel=$gpus --set parallel.zero_stage=3 --set parallel.activation_checkpointing=full --set run.name=check-bf16-${gpus}gpu-zero3-recompute
big=recipes/gpu/deepseek_1b_h200.toml
steps=--set\ run.steps=${STEPS:-20}
run $big $steps --set parallel.data_parallel=1 --set batch.global=8 --set parallel.zero_stage=2 --set run.name=speed-1gpu-zero2
for stage in 0 1 2 3; do
  run $big $steps --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set parallel.zero_stage=$stage --set run.name=speed-${gpus}gpu-zero$stage
done
run $big $steps --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set parallel.zero_stage=3 --set parallel.activation_checkpointing=full --set run.name=mem-${gpus}gpu-zero3-recompute
run $big --set run.steps=8 --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set parallel.zero_stage=2 --set parallel.offload=optimizer --set run.name=mem-${gpus}gpu-zero2-offload
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
python3 bench/python_reference_gpu.py --steps ${STEPS:-20} --micro 8 2>&1 | tail -1 | tee -a "$out/summary.txt"
python3 -m torch.distributed.run --nproc-per-node "$gpus" bench/python_reference_gpu.py --steps ${STEPS:-20} --micro 8 2>&1 | grep "pytorch eager" | tee -a "$out/summary.txt"
grep -iE "error|overlap" "$out/runs.log" | head -20
