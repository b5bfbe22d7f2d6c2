#!/usr/bin/env bash
# `dsrun probe` on this CPU machine, then CPU runs each against two plans: the shipped cpu template's
# and the probed template's (the same recipe with the probed template as its last base). Prints the
# probe's time and template, and per run: measured s/step (mean of steps 6 on), both plans' s/step
# and their errors. Results go in docs/benchmarks.md ("Probed facts").
# Usage: bench/probe_plan.sh [steps, default 30]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
db=$work/bench.db
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
start=$(date +%s.%N)
./build/dsrun probe recipes/quickstart.toml --name cpu-probed -o "$work/cpu-probed.toml" --disk "$work" 2>"$work/probe.log"
echo "probe: $(echo "$(date +%s.%N) - $start" | bc | xargs printf '%.1f') s"
grep -E "probed|^#   " "$work/cpu-probed.toml"

# name | --set arguments
cases=(
  "quickstart 2 ranks ZeRO-2|--set parallel.data_parallel=2 --set parallel.zero_stage=2"
  "quickstart 2 ranks ZeRO-0|--set parallel.data_parallel=2 --set parallel.zero_stage=0"
  "quickstart 1 rank|--set parallel.data_parallel=1 --set parallel.zero_stage=0"
  "wider: hidden 256, 4 layers, seq 256|--set parallel.data_parallel=2 --set parallel.zero_stage=2 --set model.hidden=256 --set model.intermediate=688 --set model.heads=8 --set model.kv_heads=8 --set batch.seq_len=256 --set batch.micro=4 --set batch.global=8"
)
common=(--set run.steps="$steps" --set schedule.warmup_steps=2 --set eval.every=0 --set checkpoint.every=0 --set checkpoint.at_end=false
        --set data.kind=synthetic --set data.path='""' --set logging.progress=false --set logging.tensorboard=false)
printf 'base = ["%s/recipes/quickstart.toml", "%s/cpu-probed.toml"]\n' "$PWD" "$work" > "$work/probed.toml"
printf '%-40s %10s %22s %22s\n' "run" "measured" "plan (shipped cpu)" "plan (probed)"
for c in "${cases[@]}"; do
  name=${c%%|*}
  read -r -a sets <<< "${c#*|}"
  ./build/dsrun run recipes/quickstart.toml --db "$db" "${common[@]}" "${sets[@]}" > "$work/run.log" 2>&1 || { tail -20 "$work/run.log"; exit 1; }
  id=$(sqlite3 "$db" "SELECT id FROM runs ORDER BY created_at DESC LIMIT 1")
  measured=$(sqlite3 "$db" "SELECT avg(value) FROM metrics WHERE run_id = '$id' AND key = 'step_seconds' AND step > 5")
  shipped=$(./build/dsrun plan recipes/quickstart.toml "${common[@]}" "${sets[@]}" --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['speed']['step_seconds'])")
  probed=$(./build/dsrun plan "$work/probed.toml" "${common[@]}" "${sets[@]}" --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['speed']['step_seconds'])")
  python3 - "$name" "$measured" "$shipped" "$probed" <<'PY'
import sys
name, m, s, p = sys.argv[1], *map(float, sys.argv[2:])
f = lambda plan: f"{plan:.4f} s ({100 * (plan - m) / m:+.0f}%)"
print(f"{name:40s} {m:8.4f} s {f(s):>22s} {f(p):>22s}")
PY
done
