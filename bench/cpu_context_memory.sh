#!/usr/bin/env bash
# Context parallelism on CPU ranks: peak resident memory of every rank against the plan's host
# total, side by side with data parallelism over the same ranks (issue 66). The 27.5 M-parameter
# decoder (hidden 512, 8 layers, 8 heads, intermediate 1536) of tests/recipes/tiny_train.toml at
# sequence 1024, micro 2, global 12, 3 steps: data 2 (whole sequences), context 2 and context 4
# (one replica, each sequence split), context 2 with ZeRO-3 and full recomputation.
# usage: bash bench/cpu_context_memory.sh      (about 16 minutes on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem/ {print $2}') GiB; $(date -u +%F)"
printf "%-34s %-5s %9s %9s %7s\n" layout rank "peak MiB" "plan MiB" ratio
model=(--set run.steps=3 --set model.hidden=512 --set model.layers=8 --set model.heads=8 --set model.kv_heads=8 --set model.intermediate=1536
       --set batch.micro=2 --set batch.seq_len=1024 --set model.max_seq_len=1024 --set hardware.devices_per_node=4)
probe() {  # NAME SETS...: one run, a row per rank
  local name=$1 d
  shift
  d=$(mktemp -d)
  ./build/dsrun run tests/recipes/tiny_train.toml --db "$d/runs.db" "${model[@]}" "$@" > "$d/out.txt" 2>&1 || { echo "$name: failed"; tail -5 "$d/out.txt"; return; }
  local id
  id=$(grep -o '^run [0-9a-f]*' "$d/out.txt" | head -1 | cut -c5-)
  sqlite3 -separator ' ' "$d/runs.db" "select substr(a.key, 12, instr(substr(a.key, 12), '/') - 1), a.value / 1048576, b.value / 1048576 from metrics a join metrics b
      on a.run_id = b.run_id and b.key = replace(a.key, 'peak_rss_bytes', 'predicted_host_bytes') where a.run_id = '$id' and a.key like 'memory/rank%/peak_rss_bytes' order by a.key" |
    while read -r rank peak plan; do printf "%-34s %-5s %9.1f %9.1f %7.3f\n" "$name" "$rank" "$peak" "$plan" "$(echo "$peak / $plan" | bc -l)"; done
  rm -rf "$d"
}
probe "data 2, ZeRO-1" --set parallel.zero_stage=1 --set parallel.data_parallel=2
probe "context 2, ZeRO-1" --set parallel.zero_stage=1 --set parallel.data_parallel=1 --set parallel.context=2
probe "context 4, ZeRO-1" --set parallel.zero_stage=1 --set parallel.data_parallel=1 --set parallel.context=4
probe "context 2, ZeRO-3, recomputation" --set parallel.zero_stage=3 --set parallel.data_parallel=1 --set parallel.context=2 --set parallel.activation_checkpointing=\"full\"
