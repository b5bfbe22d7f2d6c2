#!/usr/bin/env bash
# fp16 with dynamic loss scaling and ZeRO-3 parameter offload on one GPU (docs/benchmarks.md).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -x build-gpu/dsrun ] || scripts/gpu_build.sh -j 8 -R "parameter counts|AdamW" > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
db=/tmp/paths.db
small=recipes/gpu/small_gpu_check.toml
run() { build-gpu/dsrun run $small --db "$db" --set hardware.devices_per_node=1 --set parallel.data_parallel=1 "$@" >> "$out/paths_runs.log" 2>&1; echo "run $* -> $?"; }
run --set precision.dtype=fp32 --set parallel.zero_stage=0 --set run.name=check-fp32-ref
run --set precision.dtype=fp16 --set parallel.zero_stage=0 --set run.name=check-fp16-zero0
run --set precision.dtype=fp16 --set parallel.zero_stage=3 --set run.name=check-fp16-zero3
run --set precision.dtype=fp16 --set parallel.zero_stage=0 --set precision.loss_scale.initial_power=40 --set run.name=check-fp16-overflowing-start
run --set precision.dtype=bf16 --set parallel.zero_stage=3 --set parallel.offload=optimizer+params --set run.name=check-bf16-zero3-offload-params
run --set precision.dtype=fp32 --set parallel.zero_stage=3 --set parallel.offload=optimizer+params --set run.name=check-fp32-zero3-offload-params
python3 bench/gpu_summary.py "$db" | tee "$out/paths_summary.txt"
python3 - "$db" <<'PY' | tee -a "$out/paths_summary.txt"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
for (run_id, name) in db.execute("SELECT id, name FROM runs WHERE name LIKE 'check-fp16%'"):
    scale = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='loss_scale' ORDER BY step", (run_id,))]
    skipped = db.execute("SELECT value FROM metrics_latest WHERE run_id=? AND key='skipped_steps'", (run_id,)).fetchone()
    print(f"{name}: loss scale first {scale[:4]} last {scale[-1:]} skipped steps {skipped[0] if skipped else None}")
PY
tail -20 "$out/paths_runs.log"
