#!/usr/bin/env bash
# The GPU issue's checks in one device call (see docs/benchmarks.md): build against PyTorch's
# CUDA libtorch and run the test suite, then ZeRO 0-3 on 1 and 2 GPUs (fp32, bf16), memory against
# the plan, and the ~1B model's speed against PyTorch eager. Writes logs to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
echo "gpus: $gpus"; nvidia-smi -L
# The whole suite runs on the CPU machines (CI); here only what the CUDA build changes, quickly.
ctest_args=(-j 8 -R "Gloo|AdamW|SGD|MoE|checkpointed|global-norm|parameter counts|ZeRO paper|ZeRO 0-3 on 2 ranks")
[ "${GPU_FULL_TESTS:-0}" = 1 ] && ctest_args=(-j 4)
scripts/gpu_build.sh "${ctest_args[@]}" > "$out/build_and_tests.log" 2>&1
echo "build+tests exit $?"
grep -E "tests passed|tests failed" "$out/build_and_tests.log"
[ -x build-gpu/dsrun ] || { tail -60 "$out/build_and_tests.log"; exit 1; }
db=/tmp/gpu.db
run() { build-gpu/dsrun run "$@" --db "$db" >> "$out/runs.log" 2>&1; echo "run $* -> $?"; }
small=recipes/gpu/small_gpu_check.toml
for dtype in fp32 bf16; do
  for ranks in 1 "$gpus"; do
    for stage in 0 1 2 3; do
      run $small --set precision.dtype=$dtype --set parallel.data_parallel=$ranks --set parallel.zero_stage=$stage \
        --set hardware.devices_per_node=$gpus --set run.name="check-$dtype-$ranks-gpu-zero$stage"
    done
  done
done
run $small --set precision.dtype=bf16 --set parallel.data_parallel=$gpus --set parallel.zero_stage=3 --set hardware.devices_per_node=$gpus \
  --set parallel.activation_checkpointing=full --set run.name="check-bf16-$gpus-gpu-zero3-recompute"
run $small --set precision.dtype=bf16 --set parallel.data_parallel=$gpus --set parallel.zero_stage=2 --set hardware.devices_per_node=$gpus \
  --set parallel.offload=optimizer --set run.name="check-bf16-$gpus-gpu-zero2-offload"
big=recipes/gpu/deepseek_1b_h200.toml
run $big --set parallel.data_parallel=1 --set batch.global=8 --set hardware.devices_per_node=$gpus --set run.name=speed-1b-1gpu-zero2
run $big --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set hardware.devices_per_node=$gpus --set run.name=speed-1b-${gpus}gpu-zero2
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
python3 bench/python_reference_gpu.py --steps 30 --micro 8 2>&1 | tail -2 | tee -a "$out/summary.txt"
[ "$gpus" -gt 1 ] && python3 -m torch.distributed.run --nproc-per-node "$gpus" bench/python_reference_gpu.py --steps 30 --micro 8 2>&1 | tail -2 | tee -a "$out/summary.txt"
tail -40 "$out/runs.log"
