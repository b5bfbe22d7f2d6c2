#!/usr/bin/env node
// Writes one corpus of token documents in the on-disk formats of other training projects, so
// dsrun's readers can be tested against a writer that shares no code with them.
//
// usage: node write_token_formats.cjs INPUT.json OUTDIR
//   INPUT.json: {"documents": [[ids...], ...], "eos": N}   (ids without separators)
//
// Layouts were checked against these sources (facts only; no code was copied):
//  - Megatron-LM .bin/.idx: NVIDIA/Megatron-LM megatron/core/datasets/indexed_dataset.py
//    (_INDEX_HEADER, DType, _IndexWriter, _IndexReader, IndexedDatasetBuilder), and
//    tools/preprocess_data.py (Encoder.encode with --append-eod; one add_document per document).
//    .idx, all little-endian, packed with no padding:
//      9 bytes "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code (uint16 = 8, int32 = 4)
//      | u64 sequence_count | u64 document_count (= number of documents + 1)
//      | int32[sequence_count] sequence lengths in tokens
//      | int64[sequence_count] sequence pointers: byte offsets into .bin
//      | int64[document_count] document_indices: 0, then the sequence count after each document
//    .bin: the tokens of all sequences back to back in the dtype, no header.
//  - llm.c: karpathy/llm.c dev/data/data_common.py (HEADERS_INFO, write_datafile),
//    dev/data/fineweb.py (eot put BEFORE each document), llmc/dataloader.h (the C reader: on
//    master it accepts only magic 20240520 / version 1 / uint16; on the llama3 branch it also
//    accepts 20240801 / version 7 / uint32, and checks file size = 1024 + ntok * token size),
//    train_llama3.py (_load_data_shard asserts 20240801 and version 7).
//    File: int32[256] header {magic, version, ntok, 0...} then ntok tokens.
//  - nanoGPT: karpathy/nanoGPT data/openwebtext/prepare.py (eot APPENDED to each document,
//    np.memmap uint16, no header) and train.py (reads it back as np.memmap uint16).
//    nanogpt_u32.bin is the same layout widened to uint32; upstream nanoGPT itself only has uint16.
'use strict';
const fs = require('fs');
const path = require('path');

function die(msg) { console.error(`write_token_formats: ${msg}`); process.exit(1); }

const [inputPath, outDir] = process.argv.slice(2);
if (!inputPath || !outDir) die('usage: node write_token_formats.cjs INPUT.json OUTDIR');
const input = JSON.parse(fs.readFileSync(inputPath, 'utf8'));
const docs = input.documents;
const eos = input.eos;
const isId = (x) => Number.isInteger(x) && x >= 0 && x < 2 ** 32;
if (!Array.isArray(docs) || docs.length === 0) die('"documents" must be a non-empty array');
if (!isId(eos)) die('"eos" must be a token id');
docs.forEach((d, i) => {
  if (!Array.isArray(d) || !d.every(isId)) die(`document ${i} is not an array of token ids`);
  // Megatron's preprocess_data.py appends eod only to non-empty documents while nanoGPT appends
  // it always, so an empty document would make the "same" stream differ between formats.
  if (d.length === 0) die(`document ${i} is empty`);
});

// The two streams the formats carry: eos after each document (Megatron, nanoGPT) or before it (llm.c).
const after = docs.flatMap((d) => [...d, eos]);
const before = docs.flatMap((d) => [eos, ...d]);
const maxId = after.reduce((m, v) => Math.max(m, v), 0); // no spread: it overflows the stack on big corpora
// Every output is required, and three of them are uint16: check before anything is written.
if (maxId > 0xffff) die(`token id ${maxId} does not fit uint16 (megatron_u16, llmc_gpt2, nanogpt_u16)`);

// Token arrays as raw little-endian bytes; refuse rather than silently wrap ids that do not fit.
const TYPES = {
  uint16: { size: 2, max: 0xffff, put: (b, v, o) => b.writeUInt16LE(v, o) },
  int32: { size: 4, max: 0x7fffffff, put: (b, v, o) => b.writeInt32LE(v, o) },
  uint32: { size: 4, max: 0xffffffff, put: (b, v, o) => b.writeUInt32LE(v, o) },
};
function tokenBytes(ids, type) {
  const t = TYPES[type];
  if (maxId > t.max) die(`token id ${maxId} does not fit ${type}`);
  const b = Buffer.alloc(ids.length * t.size);
  ids.forEach((v, i) => t.put(b, v, i * t.size));
  return b;
}

fs.mkdirSync(outDir, { recursive: true });
const out = (name, buf) => fs.writeFileSync(path.join(outDir, name), buf);

// Megatron: one sequence per document (no --split-sentences), eod appended to each.
const MEGATRON_CODE = { uint16: 8, int32: 4 }; // DType enum values in indexed_dataset.py
function writeMegatron(prefix, type) {
  out(`${prefix}.bin`, tokenBytes(after, type));
  const n = docs.length;
  const lengths = docs.map((d) => d.length + 1);
  const head = Buffer.alloc(9 + 8 + 1 + 8 + 8);
  head.write('MMIDIDX\0\0', 0, 'latin1');
  head.writeBigUInt64LE(1n, 9); // version
  head.writeUInt8(MEGATRON_CODE[type], 17);
  head.writeBigUInt64LE(BigInt(n), 18); // sequence_count
  head.writeBigUInt64LE(BigInt(n + 1), 26); // document_count: document_indices starts with 0
  const lens = Buffer.alloc(4 * n);
  const ptrs = Buffer.alloc(8 * n);
  const docIdx = Buffer.alloc(8 * (n + 1)); // [0, 1, ..., n]: sequence count after each document
  let byte = 0;
  lengths.forEach((len, i) => {
    lens.writeInt32LE(len, 4 * i);
    ptrs.writeBigInt64LE(BigInt(byte), 8 * i);
    byte += len * TYPES[type].size;
    docIdx.writeBigInt64LE(BigInt(i + 1), 8 * (i + 1));
  });
  out(`${prefix}.idx`, Buffer.concat([head, lens, ptrs, docIdx]));
}
writeMegatron('megatron_u16', 'uint16');
writeMegatron('megatron_i32', 'int32');

// llm.c: 256 little-endian int32 header {magic, version, token count, zeros}, then the tokens.
function writeLlmc(name, magic, version, type) {
  if (before.length >= 2 ** 31) die('llm.c stores the token count as int32');
  const head = Buffer.alloc(256 * 4);
  head.writeInt32LE(magic, 0);
  head.writeInt32LE(version, 4);
  head.writeInt32LE(before.length, 8);
  out(name, Buffer.concat([head, tokenBytes(before, type)]));
}
writeLlmc('llmc_gpt2.bin', 20240520, 1, 'uint16');
writeLlmc('llmc_llama3.bin', 20240801, 7, 'uint32');

// nanoGPT: the bare token array, no header (the reader infers the count from the file size).
out('nanogpt_u16.bin', tokenBytes(after, 'uint16'));
out('nanogpt_u32.bin', tokenBytes(after, 'uint32'));

let end = 0;
const documentEndsAfter = docs.map((d) => (end += d.length + 1));
out('expected.json', JSON.stringify({
  stream_eos_after: after, stream_eos_before: before, document_ends_after: documentEndsAfter,
}) + '\n');
console.log(`wrote ${docs.length} documents, ${after.length} tokens, to ${outDir}`);
