#!/usr/bin/env bash
# One GPU: the ~1B decoder without offload, with ZeRO-2 + optimizer offload and with ZeRO-3 +
# optimizer+params offload, side by side in one call: step time, host peak RSS and device memory
# against the plan, and a host memory-bandwidth probe (docs/benchmarks.md, issue 14).
# Usage (device): bash bench/gpu_offload.sh        with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
nproc
build_and_test "${GPU_TESTS:-host step|deferred model|AdamW|SGD|CUDA: ZeRO}"
db=/tmp/offload.db
big=recipes/gpu/deepseek_1b_h200.toml
one=(--set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set run.steps=${STEPS:-12} --set batch.global=8)
# What the host step and the copies can reach here, measured first and given to the plan as this
# machine's host facts: a copy of 2 GiB of fp32 on all cores (read + write), and pinned copies of
# 1 GiB each way over PCIe.
python3 - <<'PY' | tee "$out/probe.txt"
import time, torch
torch.set_num_threads(torch.get_num_threads())
a = torch.ones(512 * 2**20); b = torch.empty_like(a)
for _ in range(2): b.copy_(a)
t = time.perf_counter(); n = 5
for _ in range(n): b.copy_(a)
dt = (time.perf_counter() - t) / n
# A copy moves 12 bytes per 8 it is credited with (the destination is read before it is written):
# the host step updates in place and moves what it is credited with, so the plan gets the traffic.
print(f"host_memory_gbs {1.5*2*a.numel()*4/dt/1e9:.1f}  # memory traffic of a copy of {a.numel()*4/2**30:.1f} GiB in {dt*1e3:.1f} ms ({2*a.numel()*4/dt/1e9:.1f} GB/s read+write as credited), {torch.get_num_threads()} threads")
h = torch.empty(2**28, pin_memory=True); d = torch.empty(2**28, device="cuda")
def timed(f):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(5): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / 5
down = timed(lambda: h.copy_(d, non_blocking=True)); up = timed(lambda: d.copy_(h, non_blocking=True))
print(f"host_link_gbs {min(h.numel()*4/down, h.numel()*4/up)/1e9:.1f}  # pinned down {h.numel()*4/down/1e9:.1f} GB/s, up {h.numel()*4/up/1e9:.1f} GB/s")
PY
host_gbs=$(awk '/^host_memory_gbs/ {print $2}' "$out/probe.txt")
link_gbs=$(awk '/^host_link_gbs/ {print $2}' "$out/probe.txt")
facts=(--set hardware.host_memory_bandwidth_gbs=${host_gbs:-100} --set hardware.host_link_bandwidth_gbs=${link_gbs:-50})
run() { build-gpu/dsrun run $big --db "$db" "${one[@]}" "${facts[@]}" "$@" >> "$out/runs.log" 2>&1; echo "run $* -> $?"; }
run --set parallel.zero_stage=2 --set run.name=offload-none-zero2
run --set parallel.zero_stage=2 --set parallel.offload=optimizer --set run.name=offload-optimizer-zero2
run --set parallel.zero_stage=2 --set parallel.offload=optimizer --set parallel.delayed_update=true --set run.name=offload-optimizer-zero2-delayed
run --set parallel.zero_stage=3 --set parallel.offload=optimizer+params --set run.name=offload-params-zero3
run --set parallel.zero_stage=3 --set parallel.offload=optimizer+params --set parallel.delayed_update=true --set run.name=offload-params-zero3-delayed
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
cat "$out/probe.txt" >> "$out/summary.txt"
grep -E "host memory|verdict|fits" "$out/runs.log" | head -20
tail -20 "$out/runs.log"
