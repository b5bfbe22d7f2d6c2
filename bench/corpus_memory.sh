#!/usr/bin/env bash
# Rank memory against corpus size: the tiny decoder trains 3 steps on 2 CPU ranks over a nanoGPT
# .bin of 10 million tokens and one of 2 billion (4 GB, generated), side by side. Prints each
# rank's anonymous resident memory (its own; mapped token files are the page cache's), its mapped
# file pages, the plan's host total, and launch-to-ready time. Needs ~4.1 GB free in $TMPDIR.
# usage: bash bench/corpus_memory.sh [BIG_TOKENS]   (default 2000000000)
set -euo pipefail
cd "$(dirname "$0")/.."
big=${1:-2000000000}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
export DSRUN_DB="$work/runs.db"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem/ {print $2}') GiB; $(date -u +%F)"
# Random u16 tokens: every id of a 65,536 vocabulary, no document structure needed here.
head -c $((10000000 * 2)) /dev/urandom > "$work/small.bin"
start=$(date +%s.%N)
head -c $((big * 2)) /dev/urandom > "$work/big.bin"
echo "generated $big tokens ($(stat -c %s "$work/big.bin") bytes) in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.0f", e - s }') s"
for corpus in small big; do
  cat > "$work/$corpus.toml" <<EOF
base = ["hardware/cpu", "models/deepseek-tiny"]
[run]
name = "corpus-memory-$corpus"
steps = 3
[model]
vocab = 65536
tie_embeddings = true
[parallel]
data_parallel = 2
[precision]
dtype = "fp32"
[batch]
global = 8
micro = 4
seq_len = 128
[schedule]
warmup_steps = 1
[data]
kind = "tokens"
path = "$corpus.bin"
format = "nanogpt"
token_width = 2
[logging]
progress = false
EOF
  ./build/dsrun run "$work/$corpus.toml" > "$work/$corpus.out" 2>&1 || { cat "$work/$corpus.out"; exit 1; }
  run=$(sed -n 's/^run \([0-9a-f]*\) finished.*/\1/p' "$work/$corpus.out")
  ./build/dsrun show "$run" > "$work/$corpus.show"
  metric() { grep -m1 "$1" "$work/$corpus.show" | awk '{print $2}'; }
  printf '%-6s %12s tokens: rank0 anon %s MB, rank1 anon %s MB, rank0 file-backed pages (libraries and the map) %s MB, peak RSS %s MB, plan host total %s MB, launch to ready %s s\n' \
    "$corpus" "$(( $(stat -c %s "$work/$corpus.bin") / 2 ))" \
    "$(metric 'memory/rank0/anon_rss_bytes' | awk '{printf "%.1f", $1/1e6}')" "$(metric 'memory/rank1/anon_rss_bytes' | awk '{printf "%.1f", $1/1e6}')" \
    "$(metric 'memory/rank0/file_rss_bytes' | awk '{printf "%.1f", $1/1e6}')" "$(metric 'memory/rank0/peak_rss_bytes' | awk '{printf "%.1f", $1/1e6}')" \
    "$(metric 'memory/rank0/predicted_host_bytes' | awk '{printf "%.1f", $1/1e6}')" "$(metric 'launch_to_ready_seconds' | awk '{printf "%.2f", $1}')"
done
