#!/usr/bin/env bash
# One GPU (issue 33): `dsrun probe` with the ~1B recipe writes this machine's template
# ($out/probed.toml, to be committed as templates/hardware/<gpu>-probed.toml), then runs train
# against the plan of the probed template, each run's plan under the shipped template beside it.
# Usage (device, .device carried; scripts/gpu_kit.sh):
#   bash bench/gpu_probe.sh 1b   the probe (and the MoE recipe's), then the 1B without offload and
#                                with optimizer offload, delayed and not (STEPS, default 12)
#   bash bench/gpu_probe.sh 7b   recipes/gpu/deepseek7b_offload_h100.toml, without and with the
#                                delayed update (STEPS_7B, default 10); probes first if 1b did not
#                                run on this machine
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mode=${1:-1b}
nvidia-smi -L
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-host step|CUDA: ZeRO|CUDA: the offload|probe}"
db=/tmp/probe.db
big=recipes/gpu/deepseek_1b_h200.toml
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu_name" in
  *H200*) shipped_hw=hardware/h200-x1 ;;
  *H100*) shipped_hw=hardware/h100-80gb-x1 ;;
  *) shipped_hw=hardware/h100-80gb-x8 ;;
esac
host_gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
one=(--set parallel.data_parallel=1 --set hardware.devices_per_node=1)
shipped_sets=("${one[@]}" --set hardware.host_memory_gib=$host_gib)

if [ ! -f /tmp/probed.toml ]; then
  t0=$(date +%s)
  build-gpu/dsrun probe $big "${one[@]}" --set batch.global=8 --name "$(echo "$gpu_name" | tr ' ' '-' | tr 'A-Z' 'a-z')-probed" \
    -o /tmp/probed.toml --disk /tmp 2> "$out/probe.log" || { cat "$out/probe.log"; exit 1; }
  echo "probe: $(( $(date +%s) - t0 )) s"
  # The MoE recipe's probe adds the routed experts' grouped products (issue 30).
  build-gpu/dsrun probe recipes/gpu/deepseek_moe_h100.toml --print --disk /tmp > "$out/probed_moe.toml" 2>> "$out/probe.log" || tail -20 "$out/probe.log"
  grep -E "grouped|matmul_efficiency|memory_bandwidth" "$out/probed_moe.toml"
fi
cp /tmp/probed.toml "$out/probed.toml"
cat /tmp/probed.toml

# run NAME PROBED_RECIPE SHIPPED_RECIPE SETS...: the run on the probed plan, and the shipped plan's step.
run() {
  local name=$1 probed=$2 shipped=$3; shift 3
  local t0=$(date +%s)
  build-gpu/dsrun run "$probed" --db "$db" "$@" --set run.name="$name" >> "$out/runs.log" 2>&1; echo "run $name -> $? in $(( $(date +%s) - t0 )) s"
  build-gpu/dsrun plan "$shipped" "${shipped_sets[@]}" "$@" --json 2>/dev/null |
    python3 -c "import json,sys; p=json.load(sys.stdin); print('$name', '$shipped_hw', 'plan step', p['speed']['step_seconds'], 'host', p['host_memory_per_node']['needed'], 'device', p['memory_per_rank']['total'] - p['memory_per_rank']['runtime'])" >> "$out/shipped.txt"
}

if [ "$mode" = 1b ]; then
  printf 'base = ["%s/%s", "/tmp/probed.toml"]\n' "$PWD" "$big" > /tmp/probed_1b.toml
  printf 'base = ["%s/%s", "%s"]\n' "$PWD" "$big" "$shipped_hw" > /tmp/shipped_1b.toml
  sets=("${one[@]}" --set batch.global=8 --set run.steps=${STEPS:-12} --set parallel.zero_stage=2)
  run offload-none /tmp/probed_1b.toml /tmp/shipped_1b.toml "${sets[@]}"
  run offload-optimizer /tmp/probed_1b.toml /tmp/shipped_1b.toml "${sets[@]}" --set parallel.offload=optimizer
  run offload-delayed /tmp/probed_1b.toml /tmp/shipped_1b.toml "${sets[@]}" --set parallel.offload=optimizer --set parallel.delayed_update=true
  # THREADS="13 10": the delayed update again with the host step on that many threads (DSRUN_HOST_STEP_THREADS)
  for n in ${THREADS:-}; do
    DSRUN_HOST_STEP_THREADS=$n run offload-delayed-t$n /tmp/probed_1b.toml /tmp/shipped_1b.toml "${sets[@]}" --set parallel.offload=optimizer --set parallel.delayed_update=true
  done
else
  seven=recipes/gpu/deepseek7b_offload_h100.toml
  printf 'base = ["%s/%s", "/tmp/probed.toml"]\n' "$PWD" "$seven" > /tmp/probed_7b.toml
  printf 'base = ["%s/%s", "%s"]\n' "$PWD" "$seven" "$shipped_hw" > /tmp/shipped_7b.toml
  build-gpu/dsrun plan /tmp/probed_7b.toml > "$out/plan_7b.txt" 2>&1
  grep -E "global|ZeRO stage|per step|MFU|host memory fits|fits:" "$out/plan_7b.txt"
  sets=(--set run.steps=${STEPS_7B:-10})
  run offload-7b /tmp/probed_7b.toml /tmp/shipped_7b.toml "${sets[@]}" --set parallel.delayed_update=false
  run offload-7b-delayed /tmp/probed_7b.toml /tmp/shipped_7b.toml "${sets[@]}"
fi
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
cat "$out/shipped.txt"
cp "$db" "$out/probe_runs.db"
grep -E "error|killed|does not fit" "$out/runs.log" | head -10
cp "$out/runs.log" /tmp/runs_$mode.log 2>/dev/null
free -g | head -2
