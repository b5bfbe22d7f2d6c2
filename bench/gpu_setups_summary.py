"""Tables for docs/benchmarks.md from bench/gpu_setups.sh's stores.

    python3 bench/gpu_setups_summary.py nodes STORE.db      per run: its nodes, the mean step time after
        warm-up against the plan's, the largest loss difference from the one-node run of the same layout
    python3 bench/gpu_setups_summary.py fp16 STORE.db       each 1b-DTYPE-Ngpu[-TAG] run beside 1b-bf16-Ngpu: the loss at the last step and
        averaged over the last 20, the largest gap along the way (20-step means), the skipped steps and
        the loss scale's history (every change, with its step)
    python3 bench/gpu_setups_summary.py resnet STORE.db PEER.json   images/s and test accuracy beside the peer's
"""
import json
import sqlite3
import statistics
import sys


def series(db, run_id, key):
    return {s: v for s, v in db.execute("SELECT step, value FROM metrics WHERE run_id=? AND key=? ORDER BY step", (run_id, key))}


def runs(db):
    return list(db.execute("SELECT id, name, status, plan_json FROM runs ORDER BY created_at"))


def planned_step(plan_json):
    try:
        return json.loads(plan_json or "{}")["speed"]["step_seconds"]
    except (ValueError, KeyError, TypeError):
        return float("nan")


def nodes(db):
    losses = {}
    print(f"{'run':22s} {'status':9s} {'nodes':5s} {'step s':>8s} {'planned':>8s} {'meas/plan':>9s} {'max |dloss|':>11s}")
    for run_id, name, status, plan_json in runs(db):
        steps = [v for s, v in series(db, run_id, "step_seconds").items() if s > 5]
        loss = series(db, run_id, "loss")
        losses[name] = loss
        count = db.execute("SELECT count(*) FROM run_nodes WHERE run_id=?", (run_id,)).fetchone()[0]
        planned = planned_step(plan_json)
        mean = statistics.mean(steps) if steps else float("nan")
        ref = losses.get(name.replace("two-nodes", "one-node")) if "two-nodes" in name else None
        diff = max((abs(loss[s] - ref[s]) for s in loss if s in ref), default=float("nan")) if ref else float("nan")
        print(f"{name:22s} {status:9s} {count:5d} {mean:8.4f} {planned:8.4f} {mean / planned if planned == planned and planned else float('nan'):9.3f} {diff:11.5f}")


def fp16(db):
    """Every run named 1b-DTYPE-Ngpu[-TAG] against 1b-bf16-Ngpu (the same GPUs; the last of a name wins)."""
    by_name = {name: run_id for run_id, name, _, _ in runs(db)}
    mean = lambda d, ss: statistics.mean(d[s] for s in ss)
    for name, run_id in sorted(by_name.items()):
        parts = name.split("-")
        if len(parts) not in (3, 4) or parts[0] != "1b":
            continue
        st = [v for s, v in series(db, run_id, "step_seconds").items() if s > 10]
        print(f"{name}: {statistics.mean(st) if st else float('nan'):.4f} s/step")
        reference = f"1b-bf16-{parts[2]}"
        if name == reference or reference not in by_name:
            continue
        bf, fp = series(db, by_name[reference], "loss"), series(db, run_id, "loss")
        last = max(s for s in fp if s in bf)
        window = [s for s in fp if s in bf and s > last - 20]
        print(f"  loss at step {last}: bf16 {bf[last]:.4f}, {parts[1]} {fp[last]:.4f} ({100 * (fp[last] / bf[last] - 1):+.2f}%)")
        print(f"  mean of the last 20 steps: bf16 {mean(bf, window):.4f}, {parts[1]} {mean(fp, window):.4f} ({100 * (mean(fp, window) / mean(bf, window) - 1):+.2f}%)")
        gaps = []
        for begin in range(1, last + 1, 20):
            ss = [s for s in range(begin, begin + 20) if s in bf and s in fp]
            if ss:
                gaps.append((begin, mean(fp, ss) / mean(bf, ss) - 1))
        worst = max(gaps, key=lambda g: abs(g[1]))
        print(f"  20-step means along the run: largest gap {100 * worst[1]:+.2f}% (steps {worst[0]}-{worst[0] + 19}); "
              + ", ".join(f"{s}: {100 * g:+.2f}%" for s, g in gaps))
        scale = series(db, run_id, "loss_scale")
        if not scale:
            continue
        skipped = series(db, run_id, "skipped_steps")
        changes, previous = [], None
        for s, v in sorted(scale.items()):
            if v != previous:
                changes.append(f"step {s}: {v:g}")
                previous = v
        retried = series(db, run_id, "overflow_retries")  # (absent before overflow_retries existed)
        print(f"  overflow-skipped steps: {int(max(skipped.values(), default=0))}; steps run again after an overflow: "
              f"{int(max(retried.values(), default=0))}; loss scale: " + "; ".join(changes))


def resnet(db, peer_file):
    peer = json.load(open(peer_file)) if peer_file else {}
    for run_id, name, status, plan_json in runs(db):
        plan = json.loads(plan_json)
        steps = series(db, run_id, "step_seconds")
        total = len(steps)
        timed = [v for s, v in steps.items() if s > total // 10]
        dt = statistics.mean(timed)
        images = plan["batch"]["global"] if "global" in plan["batch"] else plan["batch"].get("global_batch")
        acc = series(db, run_id, "val_accuracy")
        acc_last = acc[max(acc)] if acc else float("nan")
        loss = series(db, run_id, "loss")
        print(f"dsrun {name} ({status}): {total} steps, {dt * 1000:.2f} ms/step (plan {planned_step(plan_json) * 1000:.2f}), "
              f"{images / dt:,.0f} images/s, test accuracy {100 * acc_last:.2f}%, final loss {loss[max(loss)]:.4f}")
        if peer:
            print(f"torchvision + DDP peer: {peer['steps']} steps, {peer['step_seconds'] * 1000:.2f} ms/step, {peer['images_per_second']:,.0f} images/s, "
                  f"test accuracy {100 * peer['accuracy']:.2f}%, final loss {peer['final_loss']:.4f} (torch {peer['torch']}, torchvision {peer['torchvision']})")
            print(f"dsrun / peer: {images / dt / peer['images_per_second']:.3f}x images/s; accuracy {100 * (acc_last - peer['accuracy']):+.2f} points")


if __name__ == "__main__":
    mode, store = sys.argv[1], sqlite3.connect(sys.argv[2])
    {"nodes": lambda: nodes(store), "fp16": lambda: fp16(store),
     "resnet": lambda: resnet(store, sys.argv[3] if len(sys.argv) > 3 else "")}[mode]()
