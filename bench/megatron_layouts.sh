#!/usr/bin/env bash
# The layouts dsrun's search picks for the GPT models of Megatron-LM's scaling table, beside the
# ones Megatron-LM used (Narayanan et al. 2021, Table 1), and how long each search takes.
# Usage: bench/megatron_layouts.sh    (results: docs/plan.md §6, docs/benchmarks.md)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=./build/dsrun
[ -x "$bin" ] || { echo "build first: ./setup.sh" >&2; exit 1; }
printf "%-8s %6s %6s %6s %6s %8s | %-10s | %-40s %8s %6s %8s\n" params hidden heads layers gpus batch "megatron" "dsrun's choice" "step s" "MFU" "search ms"
# params hidden heads layers gpus batch megatron_tp megatron_pp
while read -r params hidden heads layers gpus batch mtp mpp; do
  inter=$(( (8 * hidden / 3 + 63) / 64 * 64 ))
  sets="--set model.hidden=$hidden --set model.heads=$heads --set model.kv_heads=$heads --set model.layers=$layers --set model.intermediate=$inter"
  sets="$sets --set hardware.nodes=$(( gpus / 8 )) --set batch.global=$batch"
  start=$(date +%s%N)
  json=$("$bin" plan bench/megatron_gpt.toml $sets --json 2>/dev/null || true)
  end=$(date +%s%N)
  echo "$json" | python3 -c '
import json, sys
p = json.load(sys.stdin)
t = p["topology"]; pipe = p.get("pipeline", {})
sched = pipe.get("schedule", "") + ("×%d" % pipe["virtual_stages"] if pipe.get("virtual_stages", 1) > 1 else "")
choice = "tp%d pp%d %s dp%d ZeRO-%d%s" % (t["tensor_parallel"], t["pipeline_parallel"], sched, t["data_parallel"], p["parallel"]["zero_stage"], " recompute" if p["parallel"]["activation_checkpointing"] else "")
print("%-8s %6s %6s %6s %6s %8s | tp%-2s pp%-4s | %-40s %8.2f %5.1f%% %8.1f" % (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7], sys.argv[8], choice, p["speed"]["step_seconds"], 100 * p["speed"]["mfu"], float(sys.argv[9])))
' "$params" "$hidden" "$heads" "$layers" "$gpus" "$batch" "$mtp" "$mpp" "$(( (end - start) / 1000 ))e-3"
done <<'ROWS'
1.7B 2304 24 24 32 512 1 1
3.6B 3072 32 30 64 512 2 1
7.5B 4096 32 36 128 512 4 1
18B 6144 48 40 256 1024 8 1
39B 8192 64 48 512 1536 8 2
76B 10240 80 60 1024 1792 8 4
146B 12288 96 80 1536 2304 8 8
310B 16384 128 96 1920 2160 8 16
530B 20480 128 105 2520 2520 8 35
1T 25600 160 128 3072 3072 8 64
ROWS
