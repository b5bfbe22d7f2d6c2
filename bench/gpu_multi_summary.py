"""The tables of bench/gpu_multi.sh from dsrun's store: every run beside its plan (step time, the
device peak and host peak RSS of every rank), throughput per GPU, losses, and the FSDP2 peer's lines.

    python3 bench/gpu_multi_summary.py STORE.db [PEER.txt]
Step time: the mean of the steps after the first third (warm-up: allocator, NCCL, autotuning).
Device peak: each rank's peak allocated bytes against the plan's total less its runtime term (the
CUDA context and NCCL, which the allocator never sees); host: each rank's peak RSS against the
plan's host memory per rank. The worst rank is shown (largest error either way).
"""
import json
import sqlite3
import sys

db = sqlite3.connect(sys.argv[1])
GiB = 2**30


def series(run_id, key):
    return [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key=? ORDER BY step", (run_id, key))]


def latest_by_rank(run_id, name):
    rows = db.execute("SELECT key, value FROM metrics_latest WHERE run_id=? AND key LIKE ?", (run_id, f"memory/rank%/{name}")).fetchall()
    return {int(k.split("/")[1][4:]): v for k, v in rows}


def worst(measured, planned):
    """(rank, measured, planned, error) of the rank furthest from its plan."""
    rows = [(r, measured[r], planned[r], measured[r] / planned[r] - 1) for r in measured if planned.get(r)]
    return max(rows, key=lambda x: abs(x[3])) if rows else None


def pct(x):
    return f"{100 * x:+.1f}%"


details = []  # every rank's memory against its own stage's plan, and MoE routing per layer, after the table
print("| run | layout | ranks | s/step (plan) | tokens/s | per GPU | MFU | device peak, worst rank (plan) | host RSS, worst rank (plan) | loss at end |")
print("|---|---|---|---|---|---|---|---|---|---|")
one_gpu = {}
for run_id, name, status, plan_json in db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at").fetchall():
    plan = json.loads(plan_json)
    top = plan["topology"]
    world = top["world_size"]
    lay = plan["layout"]
    layout = f"dp{top['data_parallel']} tp{top['tensor_parallel']} pp{top['pipeline_parallel']}"
    if top.get("expert_parallel", 1) > 1:
        layout += f" ep{top['expert_parallel']}"
    layout += f" z{lay.get('parallel.zero_stage', '?')} m{lay.get('batch.micro', '?')}"
    if top["pipeline_parallel"] > 1:
        layout += f" {lay.get('parallel.pipeline_schedule', '')}"
        if lay.get("parallel.virtual_stages", 1) > 1:
            layout += f"x{lay['parallel.virtual_stages']}"
    ac = lay.get("parallel.activation_checkpointing", "none")
    if ac != "none":
        layout += f" ac={ac}"
    steps = series(run_id, "step_seconds")
    losses = series(run_id, "loss")
    if len(steps) < 3:
        print(f"| {name} | {layout} | {world} | {status}, {len(steps)} steps | | | | | | |")
        continue
    timed = steps[len(steps) // 3:]
    dt = sum(timed) / len(timed)
    plan_dt = plan["speed"]["step_seconds"]
    tps = plan["batch"]["tokens_per_step"] / dt
    mfu = plan["speed"]["model_flops_per_step"] / (dt * plan["speed"]["peak_flops"] * world)
    if world == 1:
        one_gpu.setdefault(name.split("-")[0], tps)
    scaling = ""
    base = one_gpu.get(name.split("-")[0])
    if base and world > 1:
        scaling = f" ({100 * tps / world / base:.1f}% of 1 GPU)"
    runtime = plan["memory_per_rank"]["runtime"]
    planned_device = {r: v - runtime for r, v in latest_by_rank(run_id, "predicted_total_bytes").items()}
    device = worst(latest_by_rank(run_id, "peak_allocated_bytes"), planned_device)
    host = worst(latest_by_rank(run_id, "peak_rss_bytes"), latest_by_rank(run_id, "predicted_host_bytes"))
    dev_s = f"rank {device[0]}: {device[1] / GiB:.2f} GiB ({device[2] / GiB:.2f}, {pct(device[3])})" if device else ""
    host_s = f"rank {host[0]}: {host[1] / GiB:.2f} GiB ({host[2] / GiB:.2f}, {pct(host[3])})" if host else ""
    ranks = sorted(latest_by_rank(run_id, "peak_rss_bytes"))
    rss, planned_host = latest_by_rank(run_id, "peak_rss_bytes"), latest_by_rank(run_id, "predicted_host_bytes")
    alloc = latest_by_rank(run_id, "peak_allocated_bytes")
    details.append(f"{name}: " + "; ".join(
        f"rank {r} device {alloc.get(r, 0) / GiB:.2f} ({planned_device.get(r, 0) / GiB:.2f}) host {rss[r] / GiB:.2f} ({planned_host.get(r, 0) / GiB:.2f})" for r in ranks))
    loads = sorted({k for (k,) in db.execute("SELECT DISTINCT key FROM metrics WHERE run_id=? AND key LIKE 'expert_load/%'", (run_id,))}, key=lambda k: int(k.split("/")[1]))
    if loads:
        per_layer = []
        for k in loads:
            v = series(run_id, k)[len(steps) // 3:]
            per_layer.append(f"{k.split('/')[1]}: {sum(v) / max(1, len(v)):.2f}")
        details.append(f"{name} routing (busiest expert's tokens over the mean, per MoE layer, mean of the timed steps): " + ", ".join(per_layer))
    pauses = series(run_id, "checkpoint_pause_s")
    if pauses:
        name += f" (pause per save {', '.join(f'{x:.3f}' for x in pauses)} s)"
    print(f"| {name} | {layout} | {world} | {dt:.4f} ({plan_dt:.4f}, {pct(plan_dt / dt - 1)}) | {tps:,.0f} | {tps / world:,.0f}{scaling} | {100 * mfu:.1f}% | "
          f"{dev_s} | {host_s} | {losses[-1]:.4f} |")

print("\nEvery rank, device peak allocated and host peak RSS in GiB (its own stage's plan):")
for line in details:
    print("- " + line)

if len(sys.argv) > 2:
    try:
        print("\nPyTorch peer (FSDP2 + DTensor + per-block torch.compile):")
        print(open(sys.argv[2]).read())
    except OSError:
        pass
