#!/usr/bin/env bash
# Checkpoints, restarts, resharding and hooks on GPUs (NCCL), in one device call: builds with
# scripts/gpu_build.sh and runs its CUDA tests, then on the small check model in bf16:
# an uninterrupted 2-GPU ZeRO-2 run; the same with rank 1 SIGKILLed at step 5 and `dsrun resume`;
# with run.max_restarts = 1; resumed on 1 GPU at ZeRO-3 (resharding); an lr hook on 2 GPUs; export.
# Prints each run's losses and the largest difference from the uninterrupted run. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
# The CPU-rank tests are slow here (every rank loads the CUDA libtorch) and run in CI anyway:
# by default only the CUDA and NCCL tests; GPU_CTEST="-j 8" runs everything.
read -ra ctest_args <<<"${GPU_CTEST:--R CUDA}"
scripts/gpu_build.sh "${ctest_args[@]}" > "$out/build_and_tests.log" 2>&1
echo "build+tests exit $?"
grep -E "tests passed|tests failed|\(Failed\)|\(SEGFAULT\)|Not Run" "$out/build_and_tests.log" | head -20
[ -x build-gpu/dsrun ] || { tail -60 "$out/build_and_tests.log"; exit 1; }
db=/tmp/gpu_resume.db
rm -f "$db"*
small=recipes/gpu/small_gpu_check.toml
S="--set precision.dtype=bf16 --set hardware.devices_per_node=$gpus --set run.steps=8 --set schedule.warmup_steps=2 --set checkpoint.every=2"
two="--set parallel.data_parallel=2 --set parallel.zero_stage=2"
id_of() { grep -o "^run [0-9a-f]\{8\}" "$1" | head -1 | cut -c5-; }
step() { echo "== $1"; shift; "$@" > "$out/step.log" 2>&1; echo "exit $?"; cat "$out/step.log" >> "$out/runs.log"; }
step "uninterrupted" build-gpu/dsrun run $small $S $two --set run.name=ref --db "$db"
ref=$(id_of "$out/step.log")
DSRUN_TEST_CRASH_AT=1:5 step "crash at step 5" build-gpu/dsrun run $small $S $two --set run.name=crash --db "$db"
crash=$(id_of "$out/step.log")
step "resume" build-gpu/dsrun resume "$crash" --db "$db"
DSRUN_TEST_CRASH_AT=1:5 step "max_restarts" build-gpu/dsrun run $small $S $two --set run.max_restarts=1 --set run.name=restart --db "$db"
restart=$(id_of "$out/step.log")
DSRUN_TEST_CRASH_AT=1:5 step "crash again" build-gpu/dsrun run $small $S $two --set run.name=reshard --db "$db"
reshard=$(id_of "$out/step.log")
step "resume on 1 GPU at ZeRO-3" build-gpu/dsrun resume "$reshard" --set parallel.data_parallel=1 --set parallel.zero_stage=3 --db "$db"
printf 'function lr(step, ctx) return 1e-3 / math.sqrt(step) end\nfunction on_step(ctx) if ctx.step == 6 then return {stop = "hook stop on GPU"} end end\n' > /tmp/gpu_hook.lua
step "hooks on 2 GPUs" build-gpu/dsrun run $small $S $two --set run.name=hooks --set hooks.script=\"/tmp/gpu_hook.lua\" --db "$db"
step "export" build-gpu/dsrun export "$ref" --to "$out/export" --dtype bf16 --db "$db"
python3 - "$db" "$ref" "$crash" "$restart" "$reshard" <<'PY' | tee "$out/summary.txt"
import sqlite3, sys
db, ref, *others = sys.argv[1:]
c = sqlite3.connect(db)
def losses(r): return [v for (v,) in c.execute("select value from metrics where run_id=? and key='loss' order by step", (r,))]
base = losses(ref)
print("uninterrupted", ref, ["%.6f" % x for x in base])
for name, r in zip(["resume", "max_restarts", "reshard 2->1 ZeRO-3"], others):
    l = losses(r)
    status = c.execute("select status from runs where id=?", (r,)).fetchone()[0]
    d = max((abs(a - b) / abs(b) for a, b in zip(l, base)), default=float("nan"))
    print(f"{name:22s} {r} {status:9s} rows {len(l)}  max rel diff {d:.3g}  bitwise {l == base}")
for kind, msg in c.execute("select kind, message from events where kind in ('restart','resumed','hook_stop','checkpoint') order by id"):
    print(" ", kind, msg[:120])
PY
ls -la "$out/export" 2>/dev/null
