#!/usr/bin/env bash
# One GPU, one call (issue 33): `dsrun probe` with the ~1B recipe writes this machine's template
# ($out/probed.toml, to be committed as templates/hardware/<gpu>-probed.toml), then the 1B without
# offload, with optimizer offload (delayed and not) and the 7B offload recipe run against the plan
# of the probed template; each run's plan under the shipped template is printed beside it.
# Usage (device): bash bench/gpu_probe.sh      with .device carried (scripts/gpu_kit.sh)
#   NO_7B=1 skips the 7B run; STEPS (default 12) for the 1B runs.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-host step|CUDA: ZeRO}"
db=/tmp/probe.db
big=recipes/gpu/deepseek_1b_h200.toml
one=(--set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set batch.global=8)
t0=$(date +%s)
build-gpu/dsrun probe $big "${one[@]}" --name "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')-probed" \
  -o "$out/probed.toml" --disk /tmp 2> "$out/probe.log" || { cat "$out/probe.log"; exit 1; }
echo "probe: $(( $(date +%s) - t0 )) s"; cat "$out/probed.toml"
printf 'base = ["%s/%s", "%s/probed.toml"]\n' "$PWD" "$big" "$out" > /tmp/probed_1b.toml
run() {  # run NAME RECIPE SETS...
  local name=$1 recipe=$2; shift 2
  build-gpu/dsrun run "$recipe" --db "$db" "$@" --set run.name="$name" >> "$out/runs.log" 2>&1; echo "run $name -> $?"
  local shipped
  shipped=$(build-gpu/dsrun plan $big "$@" --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['speed']['step_seconds'])")
  echo "$name shipped-template plan step $shipped s" >> "$out/shipped.txt"
}
steps=(--set run.steps=${STEPS:-12})
run probed-none /tmp/probed_1b.toml "${one[@]}" "${steps[@]}" --set parallel.zero_stage=2
run probed-offload /tmp/probed_1b.toml "${one[@]}" "${steps[@]}" --set parallel.zero_stage=2 --set parallel.offload=optimizer
run probed-offload-delayed /tmp/probed_1b.toml "${one[@]}" "${steps[@]}" --set parallel.zero_stage=2 --set parallel.offload=optimizer --set parallel.delayed_update=true
if [ -z "${NO_7B:-}" ]; then
  printf 'base = ["%s/recipes/rtx4090x3_deepseek7b.toml", "%s/probed.toml"]\n' "$PWD" "$out" > /tmp/probed_7b.toml
  host_gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
  build-gpu/dsrun run /tmp/probed_7b.toml --db "$db" --set hardware.devices_per_node=1 --set parallel.data_parallel=1 --set hardware.host_memory_gib=$host_gib \
    --set batch.global=2 --set batch.micro=2 --set data.kind=\"synthetic\" --set run.steps=${STEPS_7B:-12} --set schedule.warmup_steps=5 \
    --set checkpoint.every=0 --set checkpoint.at_end=false --set run.name=probed-7b-offload >> "$out/runs.log" 2>&1
  echo "run probed-7b-offload -> $?"
fi
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
cat "$out/shipped.txt"
grep -E "error|killed|does not fit" "$out/runs.log" | head -10
