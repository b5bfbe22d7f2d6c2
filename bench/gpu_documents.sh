#!/usr/bin/env bash
# What data.separate_documents costs on a GPU: the ~1B decoder (recipes/gpu/deepseek_1b_h200.toml,
# bf16, seq 2048) on a nanoGPT-layout corpus of documents of 50-1,000 tokens, trained with samples
# crossing documents (flash attention, fused rotary) and with separate documents (masked
# memory-efficient attention, rotary by position in document), side by side in one call.
# Usage (device): bash bench/gpu_documents.sh      with .device carried (scripts/gpu_kit.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -x build-gpu/dsrun ] || build_and_test "separate documents"
python3 - <<'PY'
import array, random
random.seed(1)
tokens = array.array("H")
while len(tokens) < 20_000_000:
    n = random.randint(50, 1000)
    tokens.extend(random.randrange(1, 32000) for _ in range(n - 1))
    tokens.append(0)  # closes the document
open("/tmp/documents.bin", "wb").write(tokens.tobytes())
PY
db=/tmp/documents.db; rm -f "$db"
for separate in false true; do
  build-gpu/dsrun run recipes/gpu/deepseek_1b_h200.toml --db "$db" --set run.steps=${STEPS:-20} --set data.kind=tokens \
    --set data.path=/tmp/documents.bin --set data.format=nanogpt --set data.token_width=2 --set data.document_token=0 \
    --set data.separate_documents=$separate --set run.name=documents-separate-$separate >> "$out/runs.log" 2>&1
  echo "separate_documents=$separate -> exit $?"
  build-gpu/dsrun --db "$db" show documents-separate-$separate | grep -E "tokens_per_second|peak_allocated_bytes|predicted_total_bytes|mfu|loss " | head -8
done
