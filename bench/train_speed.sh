#!/usr/bin/env bash
# dsrun's step time against the same tiny model in Python PyTorch (Debian's python3-torch 1.13,
# the same libtorch), 1 and 2 ranks, same batch; plus launch-to-first-step and the quickstart's
# steps/s. Needs: apt-get install python3-torch. Results go in docs/benchmarks.md.
# Usage: bench/train_speed.sh [steps, default 30]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
db=$(mktemp -d)/bench.db
py=/usr/bin/python3
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
for ranks in 1 2; do
  for stage in 0 2; do
    ./build/dsrun run recipes/quickstart.toml --db "$db" \
      --set run.steps="$steps" --set schedule.warmup_steps=2 --set eval.every=0 --set checkpoint.every=0 \
      --set data.kind=synthetic --set data.path='""' --set logging.progress=false \
      --set parallel.data_parallel="$ranks" --set parallel.zero_stage="$stage" --set batch.micro=8 >/dev/null
    id=$(sqlite3 "$db" "SELECT id FROM runs ORDER BY created_at DESC LIMIT 1")
    sqlite3 "$db" "SELECT printf('dsrun ranks %d ZeRO-%d: %.4f s/step (mean of steps 6-$steps), first step %.2f s after launch',
        $ranks, $stage, avg(value),
        (SELECT m.time - r.started_at FROM metrics m JOIN runs r ON r.id = m.run_id WHERE m.run_id = '$id' AND m.key = 'loss' AND m.step = 1))
      FROM metrics WHERE run_id = '$id' AND key = 'step_seconds' AND step > 5"
  done
  # The same thread settings dsrun's launcher gives its ranks.
  OMP_NUM_THREADS=$(( $(nproc) / ranks )) OPENBLAS_NUM_THREADS=1 "$py" bench/python_reference.py --ranks "$ranks" --steps "$steps"
done
