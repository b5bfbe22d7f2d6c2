#!/usr/bin/env bash
# Dense decoders on one GPU (issue 32): the ~1B decoder (recipes/gpu/deepseek_1b_h200.toml, bf16)
# at sequence 2048, 8192 and 32768, on synthetic tokens and on a corpus of documents of mixed
# length (uniform 64-1984 tokens, mean 1024) trained across documents and with separate documents
# (the variable-length flash kernel); at 2048 also with whole logits (batch.loss_chunk_tokens = 0)
# to show what the fused projection and loss buys. Every run against its plan (step and memory).
# The reference, Hugging Face transformers' Llama + torch.compile of the same shape, runs in the
# second part (REFERENCE=1), on the same warm machine: bash bench/gpu_dense.sh reference.
# Usage (device): bash bench/gpu_dense.sh [runs|reference|profile]   with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part=${1:-runs}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
steps=${STEPS:-20}
db=/tmp/dense.db
big=recipes/gpu/deepseek_1b_h200.toml
one=(--set parallel.data_parallel=1 --set hardware.devices_per_node=1 --set run.steps=$steps --set model.max_seq_len=32768
     --set checkpoint.every=0 --set checkpoint.at_end=false)  # (a 10.5 GiB checkpoint per run would fill the disk)
run() { build-gpu/dsrun run $big --db "$db" "${one[@]}" "$@" >> "$out/runs.log" 2>&1; echo "run $* -> $?"; }
corpus=(--set data.kind=tokens --set data.path=/tmp/documents.bin --set data.format=nanogpt --set data.token_width=2 --set data.document_token=0)

if [ "$part" = runs ]; then
  [ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-cuda|documents|loss|fused}"
  python3 - <<'PY'
import numpy as np
rng = np.random.default_rng(1)
lengths = rng.integers(64, 1985, size=40_000)  # mean 1024 tokens; ~41 M tokens
tokens = rng.integers(1, 32000, size=int(lengths.sum()), dtype=np.uint16)
tokens[np.cumsum(lengths) - 1] = 0  # each document's last token closes it
tokens.tofile("/tmp/documents.bin")
print(f"corpus: {len(lengths)} documents, {tokens.size} tokens, mean {lengths.mean():.0f}")
PY
  rm -f "$db"
  # seq 2048, micro 8: the headline, then whole logits, then documents across and separate.
  run --set batch.global=8 --set run.name=s2048-synthetic
  run --set batch.global=8 --set batch.loss_chunk_tokens=0 --set run.name=s2048-synthetic-whole-logits
  for c in 4096 16384; do run --set batch.global=8 --set batch.loss_chunk_tokens=$c --set run.name=s2048-synthetic-chunk$c; done
  run --set batch.global=8 "${corpus[@]}" --set data.separate_documents=false --set run.name=s2048-documents-across
  run --set batch.global=8 "${corpus[@]}" --set data.separate_documents=true --set run.name=s2048-documents-separate
  # Long sequences: micro batch and recomputation as the plan chooses.
  for s in 8192 32768; do
    g=$(( 16384 / s > 0 ? 16384 / s : 1 )); [ $s -eq 32768 ] && g=1
    long=(--set batch.seq_len=$s --set batch.global=$g --set batch.micro=auto --set parallel.activation_checkpointing=auto)
    run "${long[@]}" --set run.name=s$s-synthetic
    run "${long[@]}" "${corpus[@]}" --set data.separate_documents=false --set run.name=s$s-documents-across
    run "${long[@]}" "${corpus[@]}" --set data.separate_documents=true --set run.name=s$s-documents-separate
  done
  python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
  build-gpu/dsrun plan $big "${one[@]}" --set batch.seq_len=32768 --set batch.global=1 --set batch.micro=auto --set parallel.activation_checkpointing=auto \
    "${corpus[@]}" --set data.separate_documents=true > "$out/plan_s32768_documents.txt" 2>&1
  tail -40 "$out/runs.log"
elif [ "$part" = reference ]; then
  # dsrun's three synthetic runs again, beside the reference in the same call (same card).
  [ -x build-gpu/dsrun ] || build_and_test "documents|loss"
  rm -f "$db"
  run --set batch.global=8 --set run.name=s2048-synthetic
  for s in 8192 32768; do
    g=$(( 16384 / s > 0 ? 16384 / s : 1 )); [ $s -eq 32768 ] && g=1
    run --set batch.seq_len=$s --set batch.global=$g --set batch.micro=auto --set parallel.activation_checkpointing=auto --set run.name=s$s-synthetic
  done
  python3 bench/gpu_summary.py "$db" | tee "$out/summary.txt"
  ref() { python3 bench/python_reference_gpu.py --steps $steps "$@" 2>&1 | tail -1 | tee -a "$out/reference.txt"; }
  ref --hf --compile --micro 8 --seq 2048
  ref --hf --compile --micro 2 --seq 8192
  ref --hf --compile --micro 1 --seq 32768
  ref --compile --micro 8 --seq 2048
else  # profile: where dsrun's step goes at 2048 (bench/trace_summary.py), and the compiled reference's kernels
  [ -x build-gpu/dsrun ] || build_and_test "documents|loss"
  DSRUN_PROFILE=/tmp/trace:6:7 build-gpu/dsrun run $big --db /tmp/profile.db "${one[@]}" --set batch.global=8 --set run.steps=8 --set run.name=profile >> "$out/runs.log" 2>&1
  echo "profiled run exit $?"
  python3 bench/trace_summary.py /tmp/trace/trace_rank0.json 45 > "$out/profile_summary.txt"
  [ -n "${NO_REFERENCE:-}" ] || python3 bench/python_reference_gpu.py --steps 10 --compile --micro 8 --seq 2048 --profile "$out/profile_compiled_reference.txt" 2>&1 | tail -1
fi
