#!/usr/bin/env bash
# Checkpoint save and restore speed on this machine: a ~58M-parameter decoder (AdamW: 12 bytes a
# parameter, ~0.7 GB per checkpoint) on 1 and 2 CPU ranks, ZeRO-1. Save: the seconds rank 0 reports
# (write + fsync + checksum of every shard, manifest, marker). Restore: a rollback's start-up time
# minus a fresh start's (read + verify + re-cut + publish), and the read bandwidth the resume records.
# Export: `dsrun export` wall time. Then the pause per save with checkpoint.async off and on.
# Results go in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
db=$work/bench.db
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(df -h "$work" | tail -1 | awk '{print $1}'), $(date -u +%F)"
model="--set model.hidden=512 --set model.layers=8 --set model.heads=8 --set model.kv_heads=8 --set model.intermediate=1376 --set model.vocab=32000"
for ranks in 1 2; do
  ./build/dsrun run tests/recipes/tiny_train.toml --db "$db" $model --set batch.seq_len=32 --set batch.global=2 --set batch.micro=1 \
    --set run.steps=3 --set schedule.warmup_steps=1 --set parallel.data_parallel=$ranks --set parallel.zero_stage=1 >/dev/null
  id=$(sqlite3 "$db" "SELECT id FROM runs ORDER BY created_at DESC LIMIT 1")
  sqlite3 "$db" "SELECT printf('ranks %d: save %s', $ranks, message) FROM events WHERE run_id = '$id' AND kind = 'checkpoint'"
  start=$(date +%s.%N)
  ./build/dsrun rollback "$id" --to-step 3 --db "$db" --set run.steps=4 >/dev/null
  end=$(date +%s.%N)
  child=$(sqlite3 "$db" "SELECT id FROM runs ORDER BY created_at DESC LIMIT 1")
  sqlite3 "$db" "SELECT printf('ranks %d: restore: start-up %.2f s from the checkpoint vs %.2f s fresh (difference: read, verify, re-cut); rollback command %.2f s in all',
      $ranks, (SELECT value FROM metrics WHERE run_id = '$child' AND key = 'startup_seconds'),
      (SELECT value FROM metrics WHERE run_id = '$id' AND key = 'startup_seconds'), $end - $start)"
  start=$(date +%s.%N)
  ./build/dsrun export "$id" --to "$work/export$ranks" --db "$db" >/dev/null
  end=$(date +%s.%N)
  echo "ranks $ranks: export (fp32, $(du -h "$work/export$ranks/model.safetensors" | cut -f1)): $(echo "$end - $start" | bc) s"
done
# The pause per save (checkpoint_pause_s) with checkpoint.async off and on: 2 ranks, ZeRO-1, 8 steps,
# a save every 2 (the first save also allocates the staging buffer).
for async in false true; do
  ./build/dsrun run tests/recipes/tiny_train.toml --db "$db" $model --set batch.seq_len=32 --set batch.global=2 --set batch.micro=1 \
    --set run.steps=8 --set schedule.warmup_steps=1 --set parallel.data_parallel=2 --set parallel.zero_stage=1 \
    --set checkpoint.every=2 --set checkpoint.keep_last=1 --set checkpoint.async=$async >/dev/null
  id=$(sqlite3 "$db" "SELECT id FROM runs ORDER BY created_at DESC LIMIT 1")
  sqlite3 "$db" "SELECT printf('async %s: pause per save %s s; written in %s s at %s MB/s; median step %.3f s', '$async',
      (SELECT group_concat(printf('%.3f', value), ', ') FROM metrics WHERE run_id = '$id' AND key = 'checkpoint_pause_s'),
      (SELECT group_concat(printf('%.2f', value), ', ') FROM metrics WHERE run_id = '$id' AND key = 'checkpoint_write_s'),
      (SELECT group_concat(printf('%.0f', value), ', ') FROM metrics WHERE run_id = '$id' AND key = 'checkpoint_write_MBps'),
      (SELECT value FROM metrics WHERE run_id = '$id' AND key = 'step_seconds' ORDER BY value LIMIT 1 OFFSET 4))"
done
