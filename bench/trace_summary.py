#!/usr/bin/env python3
"""Where a step goes, from a dsrun trace (DSRUN_PROFILE=DIR, engine/train/trainer.cpp) or any
torch profiler Chrome trace: GPU kernels and CPU operators summed by name, the most time first,
how much of the traced wall time the GPU was busy, and where it idled (gaps with no kernel, copy or
memset, by size, the largest with what ran on either side).
Usage: python3 bench/trace_summary.py TRACE.json [ROWS]"""
import json
import sys
from collections import defaultdict


def main():
    path, rows = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    sums = {"kernel": defaultdict(float), "cpu_op": defaultdict(float)}
    busy_spans = []  # (start, end, name): kernels, copies and memsets, what the idle report counts as busy
    calls = {"kernel": defaultdict(int), "cpu_op": defaultdict(int)}
    begin, end = float("inf"), 0.0
    for e in events:
        cat, dur = e.get("cat", ""), e.get("dur")
        if dur is not None and cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            busy_spans.append((e["ts"], e["ts"] + dur, e["name"]))
        if dur is None or cat not in sums:
            continue
        sums[cat][e["name"]] += dur
        calls[cat][e["name"]] += 1
        begin, end = min(begin, e["ts"]), max(end, e["ts"] + dur)
    wall = max(end - begin, 1e-9)
    busy = sum(sums["kernel"].values())
    print(f"traced {wall / 1e3:.1f} ms; GPU kernels {busy / 1e3:.1f} ms ({100 * busy / wall:.0f}% of it), "
          f"{sum(calls['kernel'].values())} launches; CPU operators {sum(calls['cpu_op'].values())} calls")
    for cat in ("kernel", "cpu_op"):
        print(f"\n{cat}: total ms, calls, name (self and children alike for operators)")
        for name, t in sorted(sums[cat].items(), key=lambda kv: -kv[1])[:rows]:
            print(f"  {t / 1e3:9.2f} {calls[cat][name]:7d}  {name[:110]}")
    print_gaps(sorted(busy_spans))


def print_gaps(spans):
    """The GPU's idle time (no kernel, copy or memset on any stream), bucketed by gap length, and the
    largest gaps with what ran on either side."""
    gaps, reach, last = [], None, None
    for start, stop, name in spans:
        if reach is not None and start > reach:
            gaps.append((start - reach, last, name))
        if reach is None or stop > reach:
            reach, last = stop, name
    buckets = [(0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))]
    print(f"\nGPU idle (no kernel, copy or memset): {sum(g for g, _, _ in gaps) / 1e3:.2f} ms in {len(gaps)} gaps")
    for lo, hi in buckets:
        inside = [g for g, _, _ in gaps if lo <= g < hi]
        print(f"  {lo:>5}-{hi:<6} us: {len(inside):6d} gaps, {sum(inside) / 1e3:8.2f} ms")
    print("largest: us, after -> before")
    for g, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {g:9.1f}  {before[:60]} -> {after[:60]}")


if __name__ == "__main__":
    main()
