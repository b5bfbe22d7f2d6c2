#!/usr/bin/env bash
# Run HERE (Debian bookworm, with apt). Writes data/kernel_docs/documentation.jsonl.zst: the Linux
# kernel's English documentation (Documentation/**/*.rst and *.txt of Debian's linux-source-6.1,
# translations left out), one file a document: 26.5 MB of text, 8.03 M Llama 2 tokens. The
# fortunes are 0.8 M tokens, so 300 steps of 16 K tokens see them 6 times: loss parity between
# precisions needs text a run reads once (bench/gpu_fp8.sh parity with PARITY_CORPUS=kernel_docs).
# Carry data/kernel_docs to the GPU machine (about 6 MB). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
out=data/kernel_docs/documentation.jsonl.zst
[ -f "$out" ] && { echo "kernel_docs_corpus: $out is there"; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work" "$out.tmp"' EXIT
(cd "$work" && apt-get download -qq linux-source-6.1)  # as root apt warns it cannot drop to _apt here: harmless
dpkg-deb -x "$work"/linux-source-6.1_*.deb "$work/deb"
tar -xJf "$work"/deb/usr/src/linux-source-6.1.tar.xz -C "$work" --wildcards 'linux-source-6.1/Documentation/*'
mkdir -p data/kernel_docs
# Sorted paths: the same documents in the same order on every machine.
rm -f "$out.tmp"  # an interrupted run's (zstd -o refuses to overwrite)
python3 - "$work/linux-source-6.1/Documentation" <<'PY' | zstd -q -19 -T0 -o "$out.tmp"
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
for path in sorted(p for p in root.rglob("*") if p.suffix in (".rst", ".txt") and "translations" not in p.parts):
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if text:
        print(json.dumps({"text": text}, ensure_ascii=False))
PY
mv "$out.tmp" "$out"
echo "kernel_docs_corpus: $(du -h "$out" | cut -f1) in $out"
