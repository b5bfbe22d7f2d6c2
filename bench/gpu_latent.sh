#!/usr/bin/env bash
# DeepSeek-V2/V3 on one GPU (issue 63): build, the latent-attention tests (CUDA included), and the
# check against transformers' DeepseekV3ForCausalLM both ways (bench/hf_deepseek_v3_check.py).
#   bash bench/gpu_latent.sh [check] [speed]
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
