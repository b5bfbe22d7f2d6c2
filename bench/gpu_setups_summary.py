"""Tables for docs/benchmarks.md from bench/gpu_setups.sh's store: per run, its nodes, the mean
step time after warm-up against the plan's, and the largest loss difference from the one-node run
of the same layout."""
import json
import sqlite3
import statistics
import sys

db = sqlite3.connect(sys.argv[1])
runs = list(db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at"))
losses = {}
print(f"{'run':22s} {'status':9s} {'nodes':5s} {'step s':>8s} {'planned':>8s} {'meas/plan':>9s} {'max |dloss|':>11s}")
for run_id, name, status, plan_json in runs:
    steps = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='step_seconds' AND step > 5", (run_id,))]
    loss = {s: v for s, v in db.execute("SELECT step, value FROM metrics WHERE run_id=? AND key='loss'", (run_id,))}
    losses[name] = loss
    nodes = db.execute("SELECT count(*) FROM run_nodes WHERE run_id=?", (run_id,)).fetchone()[0]
    planned = float("nan")
    try:
        planned = json.loads(plan_json or "{}")["speed"]["step_seconds"]
    except (ValueError, KeyError, TypeError):
        pass
    mean = statistics.mean(steps) if steps else float("nan")
    ref = losses.get(name.replace("two-nodes", "one-node")) if "two-nodes" in name else None
    diff = max((abs(loss[s] - ref[s]) for s in loss if s in ref), default=float("nan")) if ref else float("nan")
    print(f"{name:22s} {status:9s} {nodes:5d} {mean:8.4f} {planned:8.4f} {mean / planned if planned == planned and planned else float('nan'):9.3f} {diff:11.5f}")
