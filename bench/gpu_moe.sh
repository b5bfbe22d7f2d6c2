#!/usr/bin/env bash
# One GPU: DeepSeek-MoE speed, dsrun against PyTorch eager in the same call. Builds (or updates) dsrun
# and runs the MoE test, trains recipes/gpu/deepseek_moe_h100.toml (DeepSeek-MoE 16B's shape with
# 5 layers: 2.86 B parameters, 0.85 B active; bf16, ZeRO-0, AdamW with bf16 moments, micro 4 x 2048)
# for ${STEPS:-20} steps, again with fp32 moments, then bench/moe_reference_gpu.py on the same shape,
# micro batch and sequence. All report the mean of the steps after the first 5, MFU on active
# parameters (6 N_active + 12 L h s per token).
# Logs go to $OUT: build_and_tests.log, runs.log, summary.txt (dsrun's line, then PyTorch's).
# Usage (device): bash bench/gpu_moe.sh        with .device carried (scripts/gpu_kit.sh)
# Env: STEPS (20), MICRO (4), SEQ (2048), GPU_TESTS (the ctest regex), PROFILE=1 (eager kernel table).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
build_and_test "${GPU_TESTS:-MoE: top-k routing|expert}"
db=/tmp/moe.db
rm -f "$db" "$db-wal" "$db-shm"
recipe=recipes/gpu/deepseek_moe_h100.toml
steps=${STEPS:-20} micro=${MICRO:-4} seq=${SEQ:-2048}
t0=$(date +%s)
build-gpu/dsrun run $recipe --db "$db" --set parallel.data_parallel=1 --set hardware.devices_per_node=1 \
  --set run.steps=$steps --set batch.global=$micro --set batch.micro=$micro --set batch.seq_len=$seq \
  --set model.max_seq_len=$seq --set run.name=moe-s$seq-m$micro-zero0 >> "$out/runs.log" 2>&1
echo "dsrun run exit $? in $(( $(date +%s) - t0 )) s"
# The same with AdamW's moments in fp32 (the recipe keeps them in bf16, as DeepSeek-V3 does).
build-gpu/dsrun run $recipe --db "$db" --set parallel.data_parallel=1 --set hardware.devices_per_node=1 \
  --set run.steps=$steps --set batch.global=$micro --set batch.micro=$micro --set batch.seq_len=$seq \
  --set model.max_seq_len=$seq --set optimizer.state_dtype=fp32 --set run.name=moe-s$seq-m$micro-zero0-fp32-states >> "$out/runs.log" 2>&1
echo "dsrun run (fp32 states) exit $?"
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
t0=$(date +%s)
# The same shape as the recipe (models/deepseek-moe-16b with 5 layers).
python3 bench/moe_reference_gpu.py --steps $steps --micro $micro --seq $seq \
  --hidden 2048 --layers 5 --heads 16 --kv-heads 16 --vocab 102400 --intermediate 10944 \
  --experts 64 --shared 2 --top-k 6 --moe-intermediate 1408 --first-dense 1 \
  ${PROFILE:+--profile "$out/profile_eager_moe.txt"} > "$out/reference.log" 2>&1
echo "reference exit $? in $(( $(date +%s) - t0 )) s"
tail -1 "$out/reference.log" | tee -a "$out/summary.txt"
grep -E "verdict|fits|does not fit|error|Error|out of memory" "$out/runs.log" | head -10
tail -20 "$out/runs.log"
