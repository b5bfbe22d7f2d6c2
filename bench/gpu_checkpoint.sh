#!/usr/bin/env bash
# The training step's pause per checkpoint with checkpoint.async off and on, side by side in one
# call (issue 29), and the disk's write bandwidth: the ~1B decoder (recipes/gpu/deepseek_1b_h200.toml,
# 12 GB a checkpoint) and the 7B offload recipe (recipes/rtx4090x3_deepseek7b.toml: ZeRO-3,
# optimizer+params offload) cut to 4 layers so that two of its checkpoints fit the 64 GiB disk.
# Each pair trains the same steps; the summary prints each save's pause, the async/sync ratio, the
# write bandwidth, the plan's pause, and how far apart the two trajectories are (bitwise on CPU ranks,
# where the tests check it; GPU kernels such as attention's backward are not deterministic).
# Usage (device): bash bench/gpu_checkpoint.sh [1b|7b|both]    with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-CUDA: the offload}"
which=${1:-both}
db=$out/checkpoint.db
ck=/tmp/checkpoints   # checkpoint.dir, emptied between runs: the disk holds few of these
df -h /tmp | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# run_pair NAME RECIPE SETS...: the recipe with checkpoint.async false, then true.
run_pair() {
  local name=$1 recipe=$2
  shift 2
  for async in false true; do
    rm -rf "$ck"
    mkdir -p "$ck"
    build-gpu/dsrun run "$recipe" --db "$db" "$@" --set checkpoint.dir=\""$ck"\" --set checkpoint.keep_last=1 \
      --set checkpoint.async=$async --set run.name="$name-async-$async" > "$out/$name-async-$async.log" 2>&1
    echo "$name async=$async: exit $?"
    grep -E "training pauses|checkpoint staging" "$out/$name-async-$async.log" | head -2
  done
  rm -rf "$ck"
}

if [ "$which" = 1b ] || [ "$which" = both ]; then
  # Saves further apart than a write takes (~25 s at this disk's ~0.5 GB/s), so that no save waits for the last.
  run_pair 1b recipes/gpu/deepseek_1b_h200.toml --set run.steps=${STEPS_1B:-210} --set checkpoint.every=${EVERY_1B:-70} --set checkpoint.at_end=false \
    --set hardware.disk_write_gbs=${DISK_GBS:-0.5}
fi
if [ "$which" = 7b ] || [ "$which" = both ]; then
  host_gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
  run_pair 7b-offload-4-layers recipes/rtx4090x3_deepseek7b.toml --set model.layers=4 \
    --set hardware.devices_per_node=1 --set parallel.data_parallel=1 --set hardware.memory_gib=79 --set hardware.host_memory_gib=$host_gib \
    --set hardware.peak_tflops_bf16=989 --set hardware.host_link_bandwidth_gbs=54 --set hardware.host_memory_bandwidth_gbs=75 \
    --set batch.global=2 --set batch.micro=2 --set data.kind=\"synthetic\" --set run.steps=${STEPS_7B:-120} --set schedule.warmup_steps=2 \
    --set checkpoint.every=${EVERY_7B:-60} --set checkpoint.at_end=false --set hardware.disk_write_gbs=${DISK_GBS:-0.5}
fi

python3 - "$db" <<'PY' | tee -a "$out/summary.txt"
import json, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
def series(run_id, key):
    return [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key=? ORDER BY step", (run_id, key))]
runs = {name: (rid, status, json.loads(plan)) for rid, name, status, plan in db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at")}
for model in sorted({n.rsplit("-async-", 1)[0] for n in runs}):
    pair = {a: runs.get(f"{model}-async-{a}") for a in ("false", "true")}
    if not all(pair.values()):
        continue
    pauses = {}
    for a, (rid, status, plan) in pair.items():
        p, w, bw = series(rid, "checkpoint_pause_s"), series(rid, "checkpoint_write_s"), series(rid, "checkpoint_write_MBps")
        step = series(rid, "step_seconds")
        disk = plan.get("checkpoint_disk", {})
        pauses[a] = sum(p) / len(p) if p else float("nan")
        print(f"{model} async={a:5s} {status:8s} saves={len(p)} pause per save " + ", ".join(f"{x:.2f}" for x in p) + " s; write " +
              ", ".join(f"{x:.1f}" for x in w) + " s at " + ", ".join(f"{x:.0f}" for x in bw) + f" MB/s; checkpoint {disk.get('bytes', 0) / 1e9:.1f} GB;" +
              f" plan pause {disk.get('pause_seconds', float('nan')):.2f} s; median step {sorted(step)[len(step) // 2] if step else float('nan'):.3f} s")
    a, b = series(pair["false"][0], "loss"), series(pair["true"][0], "loss")
    diff = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("nan"))
    waits = series(pair["true"][0], "checkpoint_wait_s")
    print(f"{model}: async pause / sync pause = {pauses['true'] / pauses['false']:.3f}; async saves waited for the previous write " +
          ", ".join(f"{x:.2f}" for x in waits) + f" s; losses: bitwise {a == b}, max rel diff {diff:.2e} (GPU kernels are not deterministic run to run)")
PY
