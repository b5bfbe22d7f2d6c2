#!/usr/bin/env bash
# Several GPUs of one host (issue 45): one build, `dsrun probe` of the node's collectives, then
# every layout beside its plan (under the probed template) and beside PyTorch's own stack (FSDP2 +
# DTensor tensor parallelism + per-block torch.compile, bench/fsdp_reference_gpu.py) in the same
# command; bench/gpu_multi_summary.py prints the tables of docs/benchmarks.md.
# Usage (device, .device carried; scripts/gpu_kit.sh):
#   bash bench/gpu_multi.sh PHASE...   phases, in order:
#     probe    dsrun probe (1B recipe, every GPU): writes /tmp/probed.toml and $out/probed.toml
#     dp       the ~1B decoder at ZeRO 0-3 on 1, 2 and every GPU (micro 8 x 2048 per GPU)
#     peer1b   the FSDP2 peer of the ~1B on every GPU
#     layouts  DeepSeek-LLM-7B's shape (30 layers, seq 4096): the plan's own pick, ZeRO-3, tensor 2 and 4
#     pipelines  the same shape under pipeline 2 and 4 (1F1B, interleaved) and tensor 2 x pipeline 2
#     peer7b   the FSDP2 peer of the 7B shape: FSDP over every GPU, and tensor 2 x FSDP
#     moe      recipes/gpu/deepseek_moe_h100.toml under expert 1, 2 and every GPU (data parallel too);
#              (MOE_EP: the expert degrees, default "1 2 GPUS"), and expert over every GPU with the shared
#              experts before the exchange, and expert 2 and every GPU with every pair's row travelling
#              (execution.tokens_once_per_rank = false); MOE_TRACE=1 traces expert over every GPU too ($out/moe_trace.txt)
#     fp8      DeepSeek-LLM-7B's shape in FP8 (issue 49): bf16 and tensorwise with every degree "auto" (the
#              plan's pick), under ZeRO-3 over every GPU and tensor 2; rowwise and blockwise under ZeRO-3
#              (FP8_LAYOUT_SCALINGS, default "rowwise blockwise"); FP8_MORE=0: the first two of each only
#     one-micro  pipelines with one micro-batch a step (pipeline 2 x data 2, pipeline 4; on 2 GPUs pipeline 2),
#              bounded: they run
#     ckpt     synchronous and asynchronous saves of the ~1B on every GPU (CKPT_EVERY, CKPT_STEPS)
#     faults   SIGKILL of rank 2 mid-run (restart, resume), SIGSTOP of rank 1 (named), too many GPUs
#   Env: STEPS (default 12 for the 1B, 8 for the 7B shape), GPU_TESTS (ctest regex after the build),
#   PROBED (a probed template to plan under where this machine has run no probe phase, e.g.
#   templates/hardware/4x-nvidia-h200-probed.toml on 4 H200).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -8
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-NCCL}"
[ -f /tmp/probed.toml ] || [ -z "${PROBED:-}" ] || cp "$PROBED" /tmp/probed.toml
db=/tmp/multi.db
one_b=recipes/gpu/deepseek_1b_h200.toml
seven_b=recipes/gpu/deepseek7b_h100x4.toml
moe=recipes/gpu/deepseek_moe_h100.toml
steps=${STEPS:-12}
gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
common=(--db "$db" --set checkpoint.at_end=false --set checkpoint.every=0 --set hardware.host_memory_gib=$gib)

# with_probed RECIPE: a recipe that is RECIPE with the probed template as its last base.
with_probed() {
  local f=/tmp/probed_$(basename "$1")
  [ -f /tmp/probed.toml ] || { echo "$1"; return; }
  printf 'base = ["%s/%s", "/tmp/probed.toml"]\n' "$PWD" "$1" > "$f"
  echo "$f"
}

# run NAME RECIPE SETS...: a dsrun run, its log in $out/runs.log.
run() {
  local name=$1 recipe=$2 t0=$(date +%s)
  shift 2
  build-gpu/dsrun run "$(with_probed "$recipe")" "${common[@]}" "$@" --set run.name=\""$name"\" >> "$out/runs.log" 2>&1
  echo "run $name -> $? in $(( $(date +%s) - t0 )) s"
}

# max_step NAME: the newest step with a loss of the run named NAME (0 before any).
max_step() {
  python3 -c "import sqlite3, sys; r = sqlite3.connect(sys.argv[1]).execute(\"SELECT max(m.step) FROM metrics m JOIN runs r ON r.id = m.run_id WHERE r.name = ? AND m.key = 'loss'\", (sys.argv[2],)).fetchone(); print(r[0] or 0)" "$db" "$1" 2>/dev/null || echo 0
}

# signal_rank SIGNAL RANK: to the dsrun-rank process whose environment says RANK.
signal_rank() {
  for p in $(pgrep -f dsrun-rank); do
    tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "RANK=$2" && kill -$1 $p && echo "SIG$1 to rank $2 (pid $p) at $(date +%T)" && return 0
  done
  return 1
}

# peer NAME NPROC ARGS...: the FSDP2 peer; its summary line goes to $out/peer.txt.
peer() {
  local name=$1 n=$2 t0=$(date +%s)
  shift 2
  python3 -m torch.distributed.run --standalone --nproc-per-node "$n" bench/fsdp_reference_gpu.py "$@" > "$out/peer-$name.log" 2>&1
  echo "peer $name -> $? in $(( $(date +%s) - t0 )) s"
  grep "^fsdp2 " "$out/peer-$name.log" | sed "s/^/$name: /" | tee -a "$out/peer.txt"
}

for phase in "$@"; do
  echo "=== $phase ($(date +%T))"
  case $phase in
    probe)
      t0=$(date +%s)
      build-gpu/dsrun probe $one_b --set hardware.devices_per_node=$gpus --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) \
        --set hardware.name="\"${gpus}x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)\"" -o /tmp/probed.toml --disk /tmp 2> "$out/probe.log" ||
        { tail -30 "$out/probe.log"; rm -f /tmp/probed.toml; }
      echo "probe: $(( $(date +%s) - t0 )) s"
      [ -f /tmp/probed.toml ] && cp /tmp/probed.toml "$out/probed.toml" && grep -E "_gbs|collective_ranks|efficiency" /tmp/probed.toml ;;
    dp)
      for n in 1 2 $gpus; do
        stages="0 1 2 3"; [ $n = 1 ] && stages=2
        for z in $stages; do
          run dp-${n}gpu-zero$z $one_b --set run.steps=$steps --set hardware.devices_per_node=$n --set parallel.data_parallel=$n \
            --set batch.global=$((8 * n)) --set parallel.zero_stage=$z
        done
      done ;;
    peer1b) peer 1b-fsdp$gpus $gpus --model 1b --micro 8 --seq 2048 --steps $steps --compile ;;
    layouts)
      s7=${STEPS:-8}
      sets=(--set run.steps=$s7 --set parallel.zero_stage=auto --set batch.micro=auto --set parallel.activation_checkpointing=auto)
      build-gpu/dsrun plan "$(with_probed $seven_b)" --set hardware.host_memory_gib=$gib > "$out/plan-7b-auto.txt" 2>&1
      build-gpu/dsrun plan "$(with_probed $seven_b)" --set hardware.host_memory_gib=$gib --layouts > "$out/layouts-7b.txt" 2>&1
      head -40 "$out/layouts-7b.txt"
      run 7b-auto $seven_b "${sets[@]}"
      run 7b-zero3 $seven_b "${sets[@]}" --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.data_parallel=$gpus --set parallel.zero_stage=3
      run 7b-tp2 $seven_b "${sets[@]}" --set parallel.tensor=2 --set parallel.pipeline=1 --set parallel.data_parallel=$((gpus / 2))
      run 7b-tp4 $seven_b "${sets[@]}" --set parallel.tensor=4 --set parallel.pipeline=1 --set parallel.data_parallel=$((gpus / 4)) ;;
    pipelines)
      s7=${STEPS:-8}
      sets=(--set run.steps=$s7 --set parallel.zero_stage=auto --set batch.micro=auto --set parallel.activation_checkpointing=auto)
      run 7b-pp2 $seven_b "${sets[@]}" --set parallel.tensor=1 --set parallel.pipeline=2 --set parallel.data_parallel=$((gpus / 2)) --set parallel.pipeline_schedule=1f1b
      run 7b-pp4 $seven_b "${sets[@]}" --set parallel.tensor=1 --set parallel.pipeline=4 --set parallel.data_parallel=$((gpus / 4)) --set parallel.pipeline_schedule=1f1b
      run 7b-pp4-interleaved $seven_b "${sets[@]}" --set parallel.tensor=1 --set parallel.pipeline=4 --set parallel.data_parallel=$((gpus / 4)) \
        --set parallel.pipeline_schedule=interleaved --set parallel.virtual_stages=2
      run 7b-tp2-pp2 $seven_b "${sets[@]}" --set parallel.tensor=2 --set parallel.pipeline=2 --set parallel.data_parallel=$((gpus / 4)) ;;
    peer7b)
      peer 7b-fsdp$gpus $gpus --model 7b --micro 2 --accumulation $((16 / (2 * gpus))) --seq 4096 --steps ${STEPS:-8} --warmup 3 --compile --grad-sync every
      peer 7b-tp2-fsdp$((gpus / 2)) $gpus --model 7b --tensor 2 --micro 4 --accumulation $((16 / (4 * gpus / 2))) --seq 4096 --steps ${STEPS:-8} --warmup 3 --compile --grad-sync every ;;
    moe)
      run moe-ep1-dp1 $moe --set run.steps=$steps
      for ep in ${MOE_EP:-1 2 $gpus}; do
        run moe-ep$ep-dp$gpus $moe --set run.steps=$steps --set hardware.devices_per_node=$gpus --set parallel.data_parallel=$gpus \
          --set parallel.expert=$ep --set batch.global=$((4 * gpus))
      done
      # Expert over every GPU with the shared experts computed before the exchange, not beside it
      # (execution.shared_experts_beside_dispatch = false): what the overlap gives.
      run moe-ep$gpus-dp$gpus-shared-first $moe --set run.steps=$steps --set hardware.devices_per_node=$gpus --set parallel.data_parallel=$gpus \
        --set parallel.expert=$gpus --set batch.global=$((4 * gpus)) --set execution.shared_experts_beside_dispatch=false
      # Every (token, choice) pair's row travelling (execution.tokens_once_per_rank = false), at expert 2 and
      # over every GPU: what sending each token once per rank gives.
      for ep in $(printf '%s\n' 2 $gpus | sort -u); do
        run moe-ep$ep-dp$gpus-every-pair $moe --set run.steps=$steps --set hardware.devices_per_node=$gpus --set parallel.data_parallel=$gpus \
          --set parallel.expert=$ep --set batch.global=$((4 * gpus)) --set execution.tokens_once_per_rank=false
      done
      # MOE_TRACE=1: expert over every GPU once more under torch's profiler (steps 6-7, rank 0's
      # trace summarised into $out/moe_trace.txt): the all-to-alls beside the compute.
      if [ -n "${MOE_TRACE:-}" ]; then
        rm -rf /tmp/moe_trace
        DSRUN_PROFILE=/tmp/moe_trace:6:7 run moe-ep$gpus-traced $moe --set run.steps=8 --set hardware.devices_per_node=$gpus --set parallel.data_parallel=$gpus \
          --set parallel.expert=$gpus --set batch.global=$((4 * gpus))
        python3 bench/trace_summary.py /tmp/moe_trace/trace_rank0.json 30 > "$out/moe_trace.txt" 2>&1; head -50 "$out/moe_trace.txt"
      fi ;;
    fp8)
      s7=${STEPS:-8}
      sets=(--set run.steps=$s7 --set parallel.zero_stage=auto --set batch.micro=auto --set parallel.activation_checkpointing=auto)
      zero3=(--set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.data_parallel=$gpus --set parallel.zero_stage=3)
      tp2=(--set parallel.tensor=2 --set parallel.pipeline=1 --set parallel.data_parallel=$((gpus / 2)))
      for fp8 in none tensorwise; do
        build-gpu/dsrun plan "$(with_probed $seven_b)" --set hardware.host_memory_gib=$gib --set precision.fp8=\"$fp8\" --layouts > "$out/layouts-7b-$fp8.txt" 2>&1
        grep -A3 "chosen automatically" "$out/layouts-7b-$fp8.txt"
        run 7b-auto-$fp8 $seven_b "${sets[@]}" --set precision.fp8=\"$fp8\"
        run 7b-zero3-$fp8 $seven_b "${sets[@]}" "${zero3[@]}" --set precision.fp8=\"$fp8\"
        [ "${FP8_MORE:-1}" = 1 ] && run 7b-tp2-$fp8 $seven_b "${sets[@]}" "${tp2[@]}" --set precision.fp8=\"$fp8\"
      done
      if [ "${FP8_MORE:-1}" = 1 ]; then
        for fp8 in ${FP8_LAYOUT_SCALINGS:-rowwise blockwise}; do
          run 7b-zero3-$fp8 $seven_b "${sets[@]}" "${zero3[@]}" --set precision.fp8=\"$fp8\"
        done
      fi ;;
    one-micro)
      # Pipelines with one micro-batch a step (fewer than stages), which stopped NCCL's set-up with
      # "Message truncated" (pipeline 2 x data 2) or hung (pipeline 4) until the stages opened their
      # connections both ways at start: this phase checks that they run (the ~1B, 3 steps each, bounded).
      # NAME:PIPELINE:DATA:MICRO:GLOBAL; on 2 GPUs pipeline 2 alone.
      shapes="pp2-dp2:2:2:8:16 pp4:4:1:16:16"; [ "$gpus" -lt 4 ] && shapes="pp2:2:1:8:8"
      for shape in $shapes; do
        IFS=: read -r name pp dp micro global <<< "$shape"
        t0=$(date +%s)
        timeout 120 env NCCL_DEBUG=WARN build-gpu/dsrun run "$(with_probed $one_b)" "${common[@]}" --set run.steps=3 --set schedule.warmup_steps=1 \
          --set hardware.devices_per_node=$gpus --set parallel.pipeline=$pp --set parallel.data_parallel=$dp --set parallel.tensor=1 \
          --set batch.micro=$micro --set batch.global=$global --set run.name=\"one-micro-$name\" > "$out/one-micro-$name.log" 2>&1
        echo "one micro-batch a step, $name -> $? in $(( $(date +%s) - t0 )) s"
        grep -hiE "truncated|mismatch|error" "$out/one-micro-$name.log" | head -3
      done ;;
    ckpt)
      for async in false true; do
        rm -rf /tmp/ck; mkdir -p /tmp/ck
        # Saves further apart than a save's write (about 11 s on the 4-H200 machine's disk), so that
        # an asynchronous save never waits for the one before it (the plan says when it would).
        build-gpu/dsrun run "$(with_probed $one_b)" --db "$db" --set hardware.host_memory_gib=$gib --set run.steps=${CKPT_STEPS:-160} --set hardware.devices_per_node=$gpus \
          --set parallel.data_parallel=$gpus --set batch.global=$((8 * gpus)) --set checkpoint.every=${CKPT_EVERY:-75} --set checkpoint.at_end=false --set checkpoint.keep_last=1 \
          --set checkpoint.dir=\"/tmp/ck\" --set checkpoint.async=$async --set run.name=\"ckpt-async-$async\" > "$out/ckpt-$async.log" 2>&1
        echo "ckpt async=$async -> $?"; grep -E "training pauses|staging" "$out/ckpt-$async.log" | head -2
      done ;;
    faults)
      # Rank 2 killed at step 6 of 16: one restart from the newest checkpoint (every 3 steps).
      rm -rf /tmp/ckf; mkdir -p /tmp/ckf
      build-gpu/dsrun run "$(with_probed recipes/gpu/small_gpu_check.toml)" --db "$db" --set run.steps=16 --set hardware.devices_per_node=$gpus \
        --set parallel.data_parallel=$gpus --set run.max_restarts=1 --set checkpoint.every=3 --set checkpoint.dir=\"/tmp/ckf\" \
        --set run.name=\"fault-sigkill\" > "$out/fault-kill.log" 2>&1 &
      bg=$!; done_signal=
      for i in $(seq 1 300); do
        sleep 0.5
        [ -z "$done_signal" ] && [ "$(max_step fault-sigkill)" -ge 6 ] && signal_rank KILL 2 && done_signal=1
        kill -0 $bg 2>/dev/null || break
      done
      wait $bg; echo "fault-sigkill -> $?"
      grep -iE "rank 2|restart|resum" "$out/fault-kill.log" | head -8
      # Rank 1 stopped at step 4: named within run.step_timeout_s (20 s).
      build-gpu/dsrun run "$(with_probed recipes/gpu/small_gpu_check.toml)" --db "$db" --set run.steps=2000 --set hardware.devices_per_node=$gpus \
        --set parallel.data_parallel=$gpus --set run.step_timeout_s=20 --set checkpoint.at_end=false --set run.name=\"fault-sigstop\" > "$out/fault-stop.log" 2>&1 &
      bg=$!; stopped=
      for i in $(seq 1 300); do
        sleep 0.5
        [ -z "$stopped" ] && [ "$(max_step fault-sigstop)" -ge 4 ] && signal_rank STOP 1 && stopped=$(date +%s)
        kill -0 $bg 2>/dev/null || break
      done
      wait $bg; echo "fault-sigstop -> $?"
      [ -n "$stopped" ] && echo "ended $(( $(date +%s) - stopped )) s after the stop (run.step_timeout_s = 20)"
      grep -iE "rank 1|SIGSTOP|no progress" "$out/fault-stop.log" | head -4
      # More GPUs than the machine shows: refused before launch, naming the key.
      build-gpu/dsrun run $one_b --db "$db" --set hardware.devices_per_node=$((gpus * 2)) --set parallel.data_parallel=$((gpus * 2)) \
        --set batch.global=$((16 * gpus)) > "$out/fault-gpus.log" 2>&1
      echo "too many GPUs -> $?"; grep -E "not running|devices_per_node" "$out/fault-gpus.log" | head -2 ;;
    *) echo "unknown phase $phase" ;;
  esac
done
python3 bench/gpu_multi_summary.py "$db" "$out/peer.txt" | tee "$out/summary.txt"
