#!/usr/bin/env bash
# One GPU: where a DeepSeek-MoE step spends its time. dsrun with and without the routed experts
# (the difference is what the expert loop costs), dsrun under torch's profiler (DSRUN_PROFILE,
# summarised by bench/trace_summary.py), and PyTorch eager under torch.profiler (its kernel
# table: how much of the step the GPU is busy). Logs in $OUT (docs/benchmarks.md).
# Usage (device): bash bench/gpu_moe_profile.sh   with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
build_and_test "MoE: top-k"
r=recipes/gpu/deepseek_moe_h100.toml
common="--set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set run.steps=10"
build-gpu/dsrun run $r --db /tmp/p.db $common --set run.name=moe > "$out/moe.log" 2>&1; echo "moe exit $?"
build-gpu/dsrun run $r --db /tmp/p.db $common --set model.moe.routed_experts=0 --set run.name=dense-rest > "$out/dense.log" 2>&1; echo "dense exit $?"
DSRUN_PROFILE=/tmp/trace:6:7 build-gpu/dsrun run $r --db /tmp/p.db $common --set run.steps=8 --set run.name=moe-traced > "$out/traced.log" 2>&1; echo "traced exit $?"
python3 bench/trace_summary.py /tmp/trace/trace_rank0.json 30 | tee "$out/dsrun_trace.txt"
python3 bench/gpu_summary.py /tmp/p.db | tee "$out/summary.txt"
python3 bench/moe_reference_gpu.py --steps 10 --micro 4 --seq 2048 --hidden 2048 --layers 5 --heads 16 --kv-heads 16 --vocab 102400 \
  --intermediate 10944 --experts 64 --shared 2 --top-k 6 --moe-intermediate 1408 --first-dense 1 --profile "$out/eager_profile.txt" 2>&1 | tail -1 | tee -a "$out/summary.txt"
head -45 "$out/eager_profile.txt" | cut -c1-220
