#!/usr/bin/env bash
# `dsrun history` on a large store: 10,000 runs and 10 million metric rows (500 steps of
# loss and val_loss per run), built with the sqlite3 shell; then the plain listing, a filtered
# query over config and metrics, a sort by a metric, and a CSV export, each timed by hyperfine-like
# repetition (best of 5). Goal: under 300 ms. Results go in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
db=$work/big.db
runs=${RUNS:-10000}
steps=${STEPS:-500}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
if [ ! -f "$db" ]; then
  # One real (tiny) run creates the store with the current schema.
  ./build/dsrun run tests/recipes/tiny_train.toml --db "$db" --set run.steps=3 --set checkpoint.at_end=false >/dev/null
  start=$(date +%s.%N)
  sqlite3 "$db" <<SQL
PRAGMA journal_mode = WAL;
PRAGMA synchronous = OFF;
BEGIN;
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < $runs)
INSERT INTO runs(id, name, status, created_at, started_at, ended_at, recipe_text, config_toml, model, hardware, zero_stage, world_size, config_json)
SELECT printf('%08x', i), 'run' || i, CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'finished' END, 1.7e9 + i, 1.7e9 + i, 1.7e9 + i + 60,
       'x', 'x', CASE WHEN i % 3 = 0 THEN 'deepseek-tiny' ELSE 'deepseek-7b' END, 'cpu', i % 4, 2,
       json_object('optimizer.lr', 1e-5 * (1 + i % 100), 'batch.micro', 1 + i % 8)
FROM n;
WITH RECURSIVE s(j) AS (SELECT 1 UNION ALL SELECT j + 1 FROM s WHERE j < $steps)
INSERT INTO metrics(run_id, key, step, value, time)
SELECT r.id, k.key, s.j, (CASE k.key WHEN 'loss' THEN 5.0 ELSE 5.2 END) / (1 + s.j * 0.01) + (r.rowid % 97) * 0.001, 1.7e9
FROM runs r CROSS JOIN s CROSS JOIN (SELECT 'loss' AS key UNION ALL SELECT 'val_loss') k WHERE r.recipe_text = 'x';
COMMIT;
SQL
  end=$(date +%s.%N)
  echo "built $runs runs, $(sqlite3 "$db" 'SELECT count(*) FROM metrics') metric rows in $(echo "$end - $start" | bc) s ($(du -h "$db" | cut -f1))"
fi
time_best() {
  local best=999
  for _ in 1 2 3 4 5; do
    local s e t
    s=$(date +%s%N); "$@" >/dev/null; e=$(date +%s%N)
    t=$(( (e - s) / 1000000 ))
    [ "$t" -lt "$best" ] && best=$t
  done
  echo "$best ms"
}
echo "history (newest 50):                  $(time_best ./build/dsrun history --db "$db")"
echo "history --where (config and metric):  $(time_best ./build/dsrun history --db "$db" --where 'optimizer.lr > 5e-4 and metrics.val_loss < 0.9 and status = finished')"
echo "history --sort metrics.loss --asc:     $(time_best ./build/dsrun history --db "$db" --sort metrics.loss --asc)"
echo "history --model tiny --limit 1000 --csv: $(time_best ./build/dsrun history --db "$db" --model tiny --limit 1000 --csv)"
