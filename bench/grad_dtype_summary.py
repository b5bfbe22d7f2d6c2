"""The table of bench/gpu_grad_dtype.sh from dsrun's stores: each run's final loss (the mean of its
last 20 steps), step time (the mean after the first third), device peak and planned peak; then each
variant over its seeds (mean and spread) against fp32 and against bf16 at one micro-batch.

    python3 bench/grad_dtype_summary.py STORE.db [STORE.db ...] [CURVES.csv]
"""
import json
import sqlite3
import statistics
import sys

GiB = 2**30
stores = [a for a in sys.argv[1:] if a.endswith(".db")]
curves = next((a for a in sys.argv[1:] if a.endswith(".csv")), None)
runs = {}
for path in stores:
    db = sqlite3.connect(path)
    for run_id, name, status, plan_json in db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at"):
        loss = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='loss' ORDER BY step", (run_id,))]
        step = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='step_seconds' ORDER BY step", (run_id,))]
        peak = max((v for (v,) in db.execute("SELECT value FROM metrics_latest WHERE run_id=? AND key LIKE 'memory/rank%/peak_allocated_bytes'", (run_id,))), default=float("nan"))
        plan = json.loads(plan_json) if plan_json else {}
        planned = plan.get("memory_per_rank", {}).get("total", float("nan"))
        runs[name] = dict(status=status, loss=loss, step=step, peak=peak, planned=planned, grad=plan.get("execution", {}).get("grad_dtype", "?"))

print("| run | status | gradients | final loss (last 20) | s/step | device peak GiB (plan) |")
print("|---|---|---|---|---|---|")
for name, r in runs.items():
    final = statistics.mean(r["loss"][-20:]) if r["loss"] else float("nan")
    r["final"] = final
    step = statistics.mean(r["step"][len(r["step"]) // 3:]) if r["step"] else float("nan")
    r["s_step"] = step
    print(f"| {name} | {r['status']} | {r['grad']} | {final:.4f} | {step:.4f} | {r['peak'] / GiB:.2f} ({r['planned'] / GiB:.2f}) |")

variants = {}
for name, r in runs.items():
    variants.setdefault(name.rsplit("-s", 1)[0], {})[name.rsplit("-s", 1)[1]] = r
def mean_final(v):
    return statistics.mean(r["final"] for r in variants[v].values())
print()
print("| variant | seeds | final loss mean | spread (max - min) | vs fp32 | vs bf16-a1 | s/step |")
print("|---|---|---|---|---|---|---|")
for v, by_seed in variants.items():
    finals = [r["final"] for r in by_seed.values()]
    mean = statistics.mean(finals)
    vs = lambda ref: f"{100 * (mean / mean_final(ref) - 1):+.2f}%" if ref in variants and ref != v else ""
    print(f"| {v} | {','.join(sorted(by_seed))} | {mean:.4f} | {max(finals) - min(finals):.4f} | {vs('fp32')} | {vs('bf16-a1')} |"
          f" {statistics.mean(r['s_step'] for r in by_seed.values()):.4f} |")
# Per seed, each variant against bf16-a1 of the same seed: the pairing removes the seeds' spread.
print()
for v, by_seed in variants.items():
    if v == "bf16-a1" or "bf16-a1" not in variants:
        continue
    gaps = [f"s{s}: {100 * (r['final'] / variants['bf16-a1'][s]['final'] - 1):+.2f}%" for s, r in sorted(by_seed.items()) if s in variants["bf16-a1"]]
    print(f"{v} against bf16-a1, seed by seed: {', '.join(gaps)}")
if curves:
    with open(curves, "w") as f:
        names = list(runs)
        f.write("step," + ",".join(names) + "\n")
        for i in range(max(len(r["loss"]) for r in runs.values())):
            f.write(f"{i + 1}," + ",".join(f"{runs[n]['loss'][i]:.5f}" if i < len(runs[n]["loss"]) else "" for n in names) + "\n")
