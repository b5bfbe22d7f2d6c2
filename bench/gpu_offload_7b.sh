#!/usr/bin/env bash
# One GPU: the flagship 7B recipe (recipes/rtx4090x3_deepseek7b.toml: ZeRO-3, optimizer+params
# offload, full recomputation, micro 2 x 2048) on one 80 GB GPU with this machine's host memory,
# 20 steps: step time and host peak RSS against the plan (docs/benchmarks.md, issue 14).
# Usage (device): bash bench/gpu_offload_7b.sh     with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-CUDA: the offload}"
db=/tmp/offload7b.db
host_gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
free -g | head -2
sets=(--set hardware.devices_per_node=1 --set parallel.data_parallel=1 --set hardware.memory_gib=79
      --set hardware.host_memory_gib=$host_gib --set hardware.peak_tflops_bf16=989
      --set hardware.host_link_bandwidth_gbs=${LINK_GBS:-54} --set hardware.host_memory_bandwidth_gbs=${HOST_GBS:-75}
      --set batch.global=2 --set batch.micro=2 --set data.kind=\"synthetic\" --set run.steps=${STEPS:-20}
      --set schedule.warmup_steps=5 --set checkpoint.every=0 --set checkpoint.at_end=false)
( while sleep 5; do echo "$(date +%T) $(free -m | awk '/Mem:/ {print $3}') MiB used"; done ) > "$out/host_memory_7b.log" &
sampler=$!
build-gpu/dsrun run recipes/rtx4090x3_deepseek7b.toml --db "$db" "${sets[@]}" ${DELAYED:+--set parallel.delayed_update=true} --set run.name=offload-7b-zero3 > "$out/runs_7b.log" 2>&1
echo "7B run exit $?"
kill $sampler
python3 bench/gpu_summary.py "$db" | tee "$out/summary_7b.txt"
sort -k2 -n "$out/host_memory_7b.log" | tail -1 | sed 's/^/host memory used at its highest: /'
grep -E "host memory|verdict|per step|error|killed" "$out/runs_7b.log" | head -20
tail -5 "$out/runs_7b.log"
