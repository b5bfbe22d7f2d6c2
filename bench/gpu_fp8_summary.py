"""The tables of bench/gpu_fp8.sh from dsrun's store: every run beside its plan and beside the bf16 run
of the same shape, and the loss parity of the parity-* runs.

    python3 bench/gpu_fp8_summary.py STORE.db [CURVES.csv]
Step time: the mean of the steps after the first third. Speed-up: the bf16 run of the same name
("-none") over this one. Parity: the mean loss of the last 10 steps against bf16's, and the largest
gap of 25-step means along the way; CURVES.csv gets every parity run's loss per step.
"""
import json
import sqlite3
import statistics
import sys

db = sqlite3.connect(sys.argv[1])
GiB = 2**30


def series(run_id, key):
    return dict(db.execute("SELECT step, value FROM metrics WHERE run_id=? AND key=? ORDER BY step", (run_id, key)).fetchall())


def latest(run_id, name):
    rows = db.execute("SELECT value FROM metrics_latest WHERE run_id=? AND key LIKE ?", (run_id, f"memory/rank%/{name}")).fetchall()
    return max((v for (v,) in rows), default=float("nan"))


runs = db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at").fetchall()
by_name = {name: (run_id, status, json.loads(plan_json)) for run_id, name, status, plan_json in runs}
print("| run | s/step (plan, error) | tokens/s | vs bf16 | MFU of bf16 peak | device peak (plan) | reserved (plan) |")
print("|---|---|---|---|---|---|---|")
step_of = {}
for name, (run_id, status, plan) in by_name.items():
    if name.startswith("parity-"):
        continue
    steps = list(series(run_id, "step_seconds").values())
    if len(steps) < 3:
        print(f"| {name} | {status}, {len(steps)} steps | | | | | |")
        continue
    dt = statistics.mean(steps[len(steps) // 3:])
    step_of[name] = dt
    plan_dt = plan["speed"]["step_seconds"]
    tps = plan["batch"]["tokens_per_step"] / dt
    mfu = plan["speed"]["model_flops_per_step"] / (dt * plan["speed"]["peak_flops"])
    ref = step_of.get(name.rsplit("-", 1)[0] + "-none")
    versus = f"{ref / dt:.3f}x" if ref and not name.endswith("-none") else ""
    runtime = plan["memory_per_rank"]["runtime"]
    # Over the whole run (the ranks report again at the end); reserved counts what a CUDA graph's pool keeps.
    peak, reserved = latest(run_id, "peak_allocated_bytes"), latest(run_id, "peak_reserved_bytes")
    planned = latest(run_id, "predicted_total_bytes") - runtime
    print(f"| {name} | {dt:.4f} ({plan_dt:.4f}, {100 * (dt / plan_dt - 1):+.1f}%) | {tps:,.0f} | {versus} | {100 * mfu:.1f}% | "
          f"{peak / GiB:.2f} GiB ({planned / GiB:.2f}, {100 * (peak / planned - 1):+.1f}%) | {reserved / GiB:.2f} GiB ({100 * (reserved / planned - 1):+.1f}%) |")

parity = {name: series(run_id, "loss") for name, (run_id, _, _) in by_name.items() if name.startswith("parity-")}
# One group per seed: parity-<scaling> (the run's seed) and parity-s<SEED>-<scaling>, each against its own bf16.
groups = sorted({name.rsplit("-", 1)[0] for name in parity})
ref = {}
gaps_by_scaling = {}
for group in groups:
    if group + "-none" not in parity:
        continue
    ref = parity[group + "-none"]
    last = max(ref)
    tail = [s for s in ref if s > last - 10]
    base = statistics.mean(ref[s] for s in tail)
    print(f"\n{group}: loss parity over {last} steps (mean of the last 10 steps; largest gap of 25-step means):")
    for name, loss in parity.items():
        if name.rsplit("-", 1)[0] != group or not [s for s in loss if s in ref]:
            continue
        final = statistics.mean(loss[s] for s in tail if s in loss)
        gaps = []
        for start in range(1, last + 1, 25):
            ss = [s for s in range(start, start + 25) if s in loss and s in ref]
            if ss:
                gaps.append(statistics.mean(loss[s] for s in ss) / statistics.mean(ref[s] for s in ss) - 1)
        worst = max(gaps, key=abs)
        gaps_by_scaling.setdefault(name.rsplit("-", 1)[1], []).append(final / base - 1)
        print(f"  {name}: {final:.4f} ({100 * (final / base - 1):+.2f}% of bf16's {base:.4f}); largest gap {100 * worst:+.2f}%")
bf16_finals = {g: statistics.mean(list(parity[g + "-none"].values())[-10:]) for g in groups if g + "-none" in parity}
if len(bf16_finals) > 1:
    spread = (max(bf16_finals.values()) / min(bf16_finals.values()) - 1) * 100
    print(f"\nbf16 alone over {len(bf16_finals)} seeds: last-10 means {', '.join(f'{v:.4f}' for v in bf16_finals.values())} (spread {spread:.2f}%)")
    for scaling, gaps in gaps_by_scaling.items():
        if scaling != "none":
            print(f"  {scaling}: mean gap over seeds {100 * statistics.mean(gaps):+.2f}% ({', '.join(f'{100 * g:+.2f}%' for g in gaps)})")
if parity:
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            names = list(parity)
            f.write("step," + ",".join(names) + "\n")
            for s in sorted(set().union(*parity.values())):
                f.write(f"{s}," + ",".join(f"{parity[n].get(s, float('nan')):.5f}" for n in names) + "\n")
