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
run() { build-gpu/dsrun run $big --db "$db" "${one[@]}" "$@" >> "$out/runs.log" 2>&1; echo "run $* -> $?"; }
run --set parallel.zero_stage=2 --set run.name=offload-none-zero2
run --set parallel.zero_stage=2 --set parallel.offload=optimizer --set run.name=offload-optimizer-zero2
run --set parallel.zero_stage=3 --set parallel.offload=optimizer+params --set run.name=offload-params-zero3
python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
# What the host step can reach here: a copy of 2 GiB of fp32 on all cores, read + write.
python3 - <<'PY' | tee -a "$out/summary.txt"
import time, torch
torch.set_num_threads(torch.get_num_threads())
a = torch.ones(512 * 2**20); b = torch.empty_like(a)
for _ in range(2): b.copy_(a)
t = time.perf_counter(); n = 5
for _ in range(n): b.copy_(a)
dt = (time.perf_counter() - t) / n
print(f"host memory probe: copy {a.numel()*4/2**30:.1f} GiB in {dt*1e3:.1f} ms = {2*a.numel()*4/dt/1e9:.1f} GB/s (read+write), {torch.get_num_threads()} threads")
PY
grep -E "host memory|verdict|fits" "$out/runs.log" | head -20
tail -20 "$out/runs.log"
