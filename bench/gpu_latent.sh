#!/usr/bin/env bash
# DeepSeek-V2/V3 on one GPU (issue 63): build, the latent-attention tests (CUDA included), and the
# check against transformers' DeepseekV3ForCausalLM both ways (bench/hf_deepseek_v3_check.py).
#   bash bench/gpu_latent.sh [check] [fromhf] [speed] [v2lite] [chunks]
#   (v2lite: MICROS="4 8", TRACE=1 for dsrun's profile; chunks: CHUNKS="655 2048 8192", ACCUM_CHUNK)
source "$(dirname "$0")/gpu_env.sh"
build_and_test "${LATENT_TESTS:-latent attention|MTP|DeepseekV|E4M3|init_from reads}"
for phase in "${@:-check}"; do
  case "$phase" in
    check)
      d=$out/hf_check; rm -rf "$d"; mkdir -p "$d"
      python3 bench/hf_deepseek_v3_check.py make "$d" 2>&1 | tail -5
      DSRUN_HF_CHECK=$d build-gpu/tests/dsrun_engine_tests "[hf]" -s 2>&1 | grep -E "loss|bf16|passed|failed|FAILED" | head -20
      python3 bench/hf_deepseek_v3_check.py load "$d" 2>&1 | tail -4
      echo "hf check (transformers loads dsrun's export) exit $?"
      # dsrun init --from-hf on the config.json transformers wrote, then its plan
      build-gpu/dsrun init "$d/fromhf" --template quickstart --from-hf "$d/hf" 2>&1 | tail -12
      sed -n '/# The model/,$p' "$d/fromhf.toml"
      build-gpu/dsrun plan "$d/fromhf.toml" --db /tmp/fromhf.db > "$out/fromhf_plan.txt" 2>&1; echo "plan of the init --from-hf recipe exit $?"
      ;;
    fromhf)  # dsrun init --from-hf on the config.json transformers 5 writes, then its plan
      d=$out/hf_check; rm -rf "$d"; mkdir -p "$d"
      python3 bench/hf_deepseek_v3_check.py make "$d" 2>&1 | tail -1
      build-gpu/dsrun init "$d/fromhf" --template quickstart --from-hf "$d/hf" 2>&1 | tail -12
      sed -n '/# The model/,$p' "$d/fromhf.toml"
      build-gpu/dsrun plan "$d/fromhf.toml" --db /tmp/fromhf.db > "$out/fromhf_plan.txt" 2>&1; echo "plan of the init --from-hf recipe exit $?"
      ;;
    chunks)  # the V2-Lite shape's step against the loss chunk (vocab 102400) and accumulation; the peer accumulating alike
      db=/tmp/chunks.db; rm -f "$db"*
      r=recipes/gpu/deepseek_v2_lite_h100.toml
      for chunk in ${CHUNKS-655 2048 8192}; do
        build-gpu/dsrun run $r --db "$db" --set run.steps=${STEPS:-15} --set batch.loss_chunk_tokens=$chunk --set run.name=v2lite-chunk$chunk >> "$out/runs.log" 2>&1
        echo "dsrun chunk $chunk exit $?"
      done
      if [ -z "${CHUNKS-x}" ]; then  # CHUNKS="": the recipe's own (the plan's) chunk
        build-gpu/dsrun run $r --db "$db" --set run.steps=${STEPS:-15} --set run.name=v2lite-default >> "$out/runs.log" 2>&1; echo "dsrun default exit $?"
      fi
      for moments in fp32 bf16; do
        build-gpu/dsrun run $r --db "$db" --set run.steps=${STEPS:-15} --set batch.global=16 --set optimizer.state_dtype=$moments \
          ${ACCUM_CHUNK:+--set batch.loss_chunk_tokens=$ACCUM_CHUNK} --set run.name=v2lite-accum4-$moments >> "$out/runs.log" 2>&1
        echo "dsrun accumulation 4 $moments moments exit $?"
      done
      python3 bench/gpu_summary.py "$db" | tee "$out/summary_chunks.txt"
      grep -E "error|Error|out of memory" "$out/runs.log" | head -5
      [ -n "${NO_HF:-}" ] || timeout 300 python3 bench/hf_deepseek_v3_speed.py --steps ${STEPS:-15} --micro 4 --accumulation 4 2>&1 | grep -vi warn | tail -2
      ;;
    v2lite)  # DeepSeek-V2-Lite's shape (5 layers) against transformers' DeepseekV3 + torch.compile, same tokens per step
      db=/tmp/v2lite.db; rm -f "$db"*
      r=recipes/gpu/deepseek_v2_lite_h100.toml
      for micro in ${MICROS:-4}; do
        common=(--db "$db" --set run.steps=${STEPS:-20} --set batch.global=$micro --set batch.micro=$micro)
        build-gpu/dsrun run $r "${common[@]}" --set run.name=v2lite-m$micro-fp32moments >> "$out/runs.log" 2>&1; echo "dsrun micro $micro exit $?"
        build-gpu/dsrun run $r "${common[@]}" --set optimizer.state_dtype=bf16 --set run.name=v2lite-m$micro-bf16moments >> "$out/runs.log" 2>&1
        echo "dsrun micro $micro bf16 moments exit $?"
        timeout 400 python3 bench/hf_deepseek_v3_speed.py --steps ${STEPS:-20} --micro $micro 2>&1 | grep -vi warn | tail -3
      done
      python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
      grep -E "error|Error|out of memory" "$out/runs.log" | head -5
      if [ -n "${TRACE:-}" ]; then
        DSRUN_PROFILE=/tmp/trace:6:7 build-gpu/dsrun run $r --db /tmp/trace.db --set run.steps=8 --set run.name=traced > "$out/traced.log" 2>&1; echo "traced exit $?"
        python3 bench/trace_summary.py /tmp/trace/trace_rank0.json 40 > "$out/dsrun_trace.txt"; head -60 "$out/dsrun_trace.txt"
      fi
      ;;
    speed)  # DeepSeek-V2-Lite's shape (DeepSeek-MoE 16B's with latent attention), 5 layers, against MHA of the same width
      db=/tmp/latent.db; rm -f "$db"*
      steps=${STEPS:-20} micro=${MICRO:-4} seq=${SEQ:-2048}
      common=(--db "$db" --set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set run.steps=$steps --set batch.global=$micro
              --set batch.micro=$micro --set batch.seq_len=$seq --set model.max_seq_len=$seq)
      build-gpu/dsrun run recipes/gpu/deepseek_moe_h100.toml "${common[@]}" --set run.name=mha-s$seq-m$micro >> "$out/runs.log" 2>&1
      echo "mha run exit $?"
      build-gpu/dsrun run recipes/gpu/deepseek_moe_h100.toml "${common[@]}" --set model.attention=mla --set model.mla.q_lora_rank=0 \
        --set model.mla.kv_lora_rank=512 --set run.name=mla-v2lite-s$seq-m$micro >> "$out/runs.log" 2>&1
      echo "mla run exit $?"
      python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
      grep -E "error|Error|out of memory" "$out/runs.log" | head -5
      ;;
  esac
done
