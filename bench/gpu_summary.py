"""Summarises the GPU runs of bench/gpu_check.sh from dsrun's store: loss agreement, memory
measured against the plan, speed against the plan."""
import json
import sqlite3
import sys

db = sqlite3.connect(sys.argv[1])
runs = db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at").fetchall()


def series(run_id, key):
    return [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key=? ORDER BY step", (run_id, key))]


def latest(run_id, key):
    row = db.execute("SELECT value FROM metrics_latest WHERE run_id=? AND key=?", (run_id, key)).fetchone()
    return row[0] if row else None


reference = {}
for run_id, name, status, plan_json in runs:
    plan = json.loads(plan_json)
    losses = series(run_id, "loss")
    line = f"{name:32s} {status:9s} steps={len(losses):3d}"
    if name.startswith("check-"):
        dtype = name.split("-")[1]
        ref = reference.setdefault(dtype, losses)
        if losses and len(losses) == len(ref):
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            line += f" max rel diff vs 1-GPU ZeRO-0 {worst:.2e}"
        line += f" final loss {losses[-1]:.4f}" if losses else ""
    measured = latest(run_id, "memory/rank0/model_state_bytes")
    predicted = latest(run_id, "memory/rank0/predicted_model_state_bytes")
    peak = latest(run_id, "memory/rank0/peak_allocated_bytes")
    if measured and predicted:
        line += f" | states {measured / 2**30:.3f} GiB vs plan {predicted / 2**30:.3f} GiB ({100 * (measured / predicted - 1):+.1f}%)"
    if peak:
        # The allocator never sees the runtime (CUDA context, NCCL): compare without it.
        total = plan["memory_per_rank"]["total"] - plan["memory_per_rank"]["runtime"]
        line += f" | peak allocated {peak / 2**30:.2f} GiB vs plan {total / 2**30:.2f} GiB ({100 * (peak / total - 1):+.1f}%)"
    rss = latest(run_id, "memory/rank0/peak_rss_bytes")
    host = latest(run_id, "memory/rank0/predicted_host_bytes")
    if rss and host:
        line += f" | host peak RSS {rss / 2**30:.2f} GiB vs plan {host / 2**30:.2f} GiB ({100 * (rss / host - 1):+.1f}%)"
    steps = series(run_id, "step_seconds")
    if len(steps) > 5:
        dt = sum(steps[5:]) / len(steps[5:])
        tps = plan["batch"]["tokens_per_step"] / dt
        mfu = plan["speed"]["model_flops_per_step"] / (dt * plan["speed"]["peak_flops"] * plan["topology"]["world_size"])
        plan_step = plan["speed"]["step_seconds"]
        line += f" | {dt:.4f} s/step, {tps:.0f} tokens/s, MFU {100 * mfu:.1f}% (plan {plan_step:.4f} s/step, {100 * (plan_step / dt - 1):+.1f}%)"
        if name.startswith("offload-"):
            reference.setdefault("offload", dt)
            plan_s = plan["speed"]["step_seconds"]
            line += f" | x{dt / reference['offload']:.2f} of no offload, plan {100 * (plan_s / dt - 1):+.1f}%"
            # Where the time goes: until the gradients' norm, and the host update beside it.
            for key, label in (("backward_end_seconds", "to norm"), ("host_update_seconds", "host update"), ("host_update_wait_seconds", "compute waited")):
                values = series(run_id, key)[5:]
                if values:
                    line += f" | {label} {sum(values) / len(values):.4f} s"
            host = series(run_id, "host_update_seconds")[5:]
            if host and plan["speed"].get("optimizer_seconds"):
                line += f" (plan host step {plan['speed']['optimizer_seconds']:.4f} s)"
    print(line)
