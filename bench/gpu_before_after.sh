#!/usr/bin/env bash
# One GPU, two builds: the same short runs with the tree as carried (build-gpu/) and an earlier tree
# (build-before/src, from `git archive REV`), alternating on one warm machine, so a refactor's cost
# is read beside the noise of runs of one build (issue 47: the dense, MoE and offload benchmarks).
# Prepare (here): rm -rf build-before && mkdir -p build-before/src && git archive REV | tar -x -C build-before/src
#   then carry [".device", "build-before"] for `build` only: a carried path replaces the machine's
#   copy, its build-gpu/ included, so the `runs` calls that follow (within the machine's idle
#   window) carry [".device"] alone.
# Usage (device): bash bench/gpu_before_after.sh build     both builds, side by side (8 cores each)
#                 bash bench/gpu_before_after.sh runs      dense 1B, MoE, 7B with optimizer offload
# Env: STEPS (20), ROUNDS (2: before, after, before, after), WHICH (dense moe offload).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part=${1:-runs}
before=build-before/src
[ -d "$before" ] || { echo "no $before: see the header"; exit 1; }
ln -sfn "$PWD/.device" "$before/.device"

if [ "$part" = build ]; then
  t0=$(date +%s)
  scripts/gpu_build.sh -j 8 -R "parameter counts" > "$out/build_after.log" 2>&1 &
  (cd "$before" && scripts/gpu_build.sh -j 8 -R "parameter counts" > "$out/build_before.log" 2>&1) &
  wait
  echo "both builds in $(( $(date +%s) - t0 )) s"
  for b in build-gpu/dsrun "$before/build-gpu/dsrun"; do [ -x "$b" ] && echo "built $b" || echo "MISSING $b"; done
  tail -3 "$out/build_after.log" "$out/build_before.log"
  exit 0
fi

steps=${STEPS:-20} rounds=${ROUNDS:-2}
db=/tmp/before_after.db
host_gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
one=(--set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set run.steps=$steps --set checkpoint.every=0 --set checkpoint.at_end=false)
# build (after|before), then what the run is; the run's name says both.
run() {
  local which=$1 name=$2
  shift 2
  local bin=build-gpu/dsrun
  [ "$which" = before ] && bin=$before/build-gpu/dsrun
  "$bin" run "$@" --db "$db" "${one[@]}" --set run.name="$name-$which" >> "$out/runs.log" 2>&1
  echo "$name-$which -> $?"
}
for round in $(seq "$rounds"); do
  for which in before after; do
    for w in ${WHICH:-dense moe offload}; do
      case $w in
        dense) run $which dense-1b-s2048 recipes/gpu/deepseek_1b_h200.toml --set model.max_seq_len=2048 ;;
        moe) run $which moe-16b-5l recipes/gpu/deepseek_moe_h100.toml --set batch.global=4 --set batch.micro=4 --set batch.seq_len=2048 --set model.max_seq_len=2048 ;;
        offload) run $which offload-7b-zero3 recipes/rtx4090x3_deepseek7b.toml --set hardware.memory_gib=79 --set hardware.host_memory_gib=$host_gib \
                   --set hardware.peak_tflops_bf16=989 --set hardware.host_link_bandwidth_gbs=54 --set hardware.host_memory_bandwidth_gbs=75 \
                   --set batch.global=2 --set batch.micro=2 --set data.kind=\"synthetic\" --set schedule.warmup_steps=5 ;;
      esac
    done
  done
done
python3 - "$db" <<'PY' | tee "$out/summary.txt"
import sqlite3, statistics, sys
db = sqlite3.connect(sys.argv[1])
rows = {}
for run_id, name, status in db.execute("SELECT id, name, status FROM runs ORDER BY created_at"):
    steps = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='step_seconds' AND step > 5 ORDER BY step", (run_id,))]
    tps = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='tokens_per_second' AND step > 5 ORDER BY step", (run_id,))]
    shape, which = name.rsplit("-", 1)
    rows.setdefault(shape, {}).setdefault(which, []).append((status, statistics.mean(steps) if steps else float("nan"), statistics.mean(tps) if tps else float("nan")))
print(f"{'run':22s} {'build':7s} mean step s (steps 6-)    tokens/s     spread of one build   after/before")
for shape, builds in rows.items():
    means = {w: statistics.mean(r[1] for r in rs) for w, rs in builds.items()}
    for which, rs in builds.items():
        spread = (max(r[1] for r in rs) - min(r[1] for r in rs)) / means[which] * 100 if len(rs) > 1 else 0
        ratio = means.get("after", float("nan")) / means.get("before", float("nan"))
        print(f"{shape:22s} {which:7s} " + " ".join(f"{r[1]:.4f}({r[0][:4]})" for r in rs) + f"   {statistics.mean(r[2] for r in rs):12,.0f}   {spread:5.2f}%   {ratio:.4f}")
PY
grep -E "error|Error|out of memory" "$out/runs.log" | head -10
