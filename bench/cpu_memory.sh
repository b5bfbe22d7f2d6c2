#!/usr/bin/env bash
# Peak resident memory of CPU ranks against the plan's host total, every rank, side by side in one
# run (issue 64 item 9): the quickstart recipe's 2 ranks, 3 steps, sequence 128, at two sizes,
#   S: hidden 512, 8 layers, 8 heads, intermediate 1536 (27.5 M parameters), micro 8
#   L: hidden 768, 12 layers, 12 heads, intermediate 2048 (85.4 M parameters), micro 4
# over data 2 at ZeRO 0-3, with recomputation, with the optimizer (and parameters) offloaded; tensor 2
# and pipeline 2 (1F1B, 2 micro-batches) on one data rank and beside data 2 (4 ranks) at ZeRO 1-3; the tiny DeepSeek-MoE with experts
# everywhere and with expert parallelism 2 (routed intermediate 384 for S, 512 for L).
# usage: bash bench/cpu_memory.sh [S|L ...]    (default: S L)
#        ONLY=REGEX bash bench/cpu_memory.sh    (only the layouts whose name matches)
set -uo pipefail
cd "$(dirname "$0")/.."
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem/ {print $2}') GiB; $(date -u +%F)"
printf "%-22s %-4s %-6s %9s %9s %7s\n" layout size rank "peak MiB" "plan MiB" ratio
moe=$(mktemp)
trap 'rm -f "$moe"' EXIT
printf 'base = ["%s/recipes/quickstart.toml", "%s/templates/models/deepseek-moe-tiny.toml"]\n' "$PWD" "$PWD" > "$moe"
probe() {  # NAME SIZE DATA ACCUMULATION RECIPE SETS...: one run, a row per rank
  local name=$1 size=$2 data=$3 acc=$4 recipe=$5 d
  shift 5
  [[ "$name" =~ ${ONLY:-.} ]] || return 0
  local model micro
  if [ "$size" = S ]; then
    model=(--set model.hidden=512 --set model.layers=8 --set model.heads=8 --set model.kv_heads=8 --set model.intermediate=1536) micro=8
  else
    model=(--set model.hidden=768 --set model.layers=12 --set model.heads=12 --set model.kv_heads=12 --set model.intermediate=2048) micro=4
  fi
  d=$(mktemp -d)
  ./build/dsrun run "$recipe" --db "$d/runs.db" --set run.steps=3 --set schedule.warmup_steps=1 --set eval.every=0 --set logging.progress=false \
    --set checkpoint.every=0 --set checkpoint.at_end=false "${model[@]}" --set batch.micro=$micro --set batch.global=$((data * micro * acc)) \
    --set batch.seq_len=128 --set parallel.data_parallel=$data "$@" > "$d/out" 2>&1 || { echo "$name $size: failed"; tail -3 "$d/out"; }
  local id show
  id=$(sqlite3 "$d/runs.db" "select id from runs limit 1")
  show=$(./build/dsrun show "$id" --db "$d/runs.db")
  for r in $(echo "$show" | grep -o 'memory/rank[0-9]*/peak_rss_bytes' | sed 's/memory\/rank//;s/\/.*//' | sort -n); do
    echo "$show" | awk -v n="$name" -v s="$size" -v r="$r" '$1 == "memory/rank" r "/peak_rss_bytes" {peak = $2} $1 == "memory/rank" r "/predicted_host_bytes" {plan = $2}
      END {printf "%-22s %-4s rank%-2s %9.0f %9.0f %7.3f\n", n, s, r, peak / 1048576, plan / 1048576, peak / plan}'
  done
  rm -rf "$d"
}
q=recipes/quickstart.toml
for size1 in ${*:-S L}; do
  experts=$([ "$size1" = S ] && echo 384 || echo 512)
  for stage in 0 1 2 3; do probe "zero$stage" $size1 2 1 $q --set parallel.zero_stage=$stage; done
  for stage in 2 3; do probe "zero$stage recompute" $size1 2 1 $q --set parallel.zero_stage=$stage --set parallel.activation_checkpointing='"full"'; done
  probe "zero2 offload opt" $size1 2 1 $q --set parallel.zero_stage=2 --set parallel.offload='"optimizer"'
  probe "zero3 offload opt" $size1 2 1 $q --set parallel.zero_stage=3 --set parallel.offload='"optimizer"'
  probe "zero3 offload opt+par" $size1 2 1 $q --set parallel.zero_stage=3 --set parallel.offload='"optimizer+params"'
  probe "tensor2" $size1 1 1 $q --set parallel.tensor=2 --set parallel.zero_stage=0
  probe "pipeline2" $size1 1 2 $q --set parallel.pipeline=2 --set parallel.zero_stage=0
  # Four ranks (on two cores): tensor and pipeline beside data 2, at the stages they take.
  for stage in 1 3; do probe "data2 x tensor2 zero$stage" $size1 2 1 $q --set parallel.tensor=2 --set parallel.zero_stage=$stage --set hardware.devices_per_node=4; done
  for stage in 1 2; do probe "data2 x pipeline2 zero$stage" $size1 2 2 $q --set parallel.pipeline=2 --set parallel.zero_stage=$stage --set hardware.devices_per_node=4; done
  probe "moe zero2" $size1 2 1 "$moe" --set parallel.zero_stage=2 --set model.moe.intermediate=$experts
  probe "moe expert2 zero2" $size1 2 1 "$moe" --set parallel.zero_stage=2 --set parallel.expert=2 --set model.moe.intermediate=$experts
done
