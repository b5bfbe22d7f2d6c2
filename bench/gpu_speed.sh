#!/usr/bin/env bash
# One GPU: build against PyTorch's CUDA libtorch, run the CUDA tests (fused kernels against the
# reference ops, overlap, collectives), then the ~1B decoder's speed and memory against PyTorch
# eager and against the plan, at sequence 2048 and 4096 (docs/benchmarks.md). Logs go to $OUT.
# Usage (device): bash bench/gpu_speed.sh        with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast here
nvidia-smi -L
t0=$(date +%s)
scripts/gpu_build.sh -j 8 -R "${GPU_TESTS:-cuda|fused|overlap|AdamW|SGD|Gloo|ZeRO 0-3 on 2 ranks}" > "$out/build_and_tests.log" 2>&1
echo "build+tests exit $? in $(( $(date +%s) - t0 )) s"
grep -E "tests passed|tests failed|Failed|SKIPPED" "$out/build_and_tests.log" | head -20
[ -x build-gpu/dsrun ] || { tail -80 "$out/build_and_tests.log"; exit 1; }
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
