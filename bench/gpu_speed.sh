#!/usr/bin/env bash
# One GPU: build against PyTorch's CUDA libtorch, run the CUDA tests (fused kernels against the
# reference ops, overlap, collectives), then the ~1B decoder's speed and memory against PyTorch
# eager and against the plan, at sequence 2048 and 4096 (docs/benchmarks.md). Logs go to $OUT.
# Usage (device): bash bench/gpu_speed.sh        with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
build_and_test "${GPU_TESTS:-cuda|fused|reductions start during backward|AdamW|SGD|Gloo|ZeRO 0-3 on 2 ranks}"
db=/tmp/speed.db
big=recipes/gpu/deepseek_1b_h200.toml
one=(--set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set run.steps=${STEPS:-20})
run() { build-gpu/dsrun run $big --db "$db" "${one[@]}" "$@" >> "$out/runs.log" 2>&1; echo "run $* -> $?"; }
run --set batch.global=8 --set parallel.zero_stage=0 --set run.name=speed-s2048-zero0
run --set batch.global=8 --set parallel.zero_stage=2 --set run.name=speed-s2048-zero2
run --set batch.global=4 --set batch.micro=4 --set batch.seq_len=4096 --set model.max_seq_len=4096 --set parallel.zero_stage=0 --set run.name=speed-s4096-zero0
run --set batch.global=8 --set parallel.zero_stage=0 --set parallel.activation_checkpointing=full --set run.name=mem-s2048-zero0-recompute
run --set batch.global=8 --set parallel.zero_stage=3 --set run.name=mem-s2048-zero3
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
ref() { python3 bench/python_reference_gpu.py --steps ${STEPS:-20} "$@" 2>&1 | tail -1 | tee -a "$out/summary.txt"; }
ref --micro 8 --seq 2048 --profile "$out/profile_eager_s2048.txt"
ref --micro 4 --seq 4096
tail -30 "$out/runs.log"
