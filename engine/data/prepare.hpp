// `dsrun prepare`: text, JSON-lines and their .gz/.zst forms to token shards, a document index
// and a manifest (written last), tokenized on every core; a killed prepare resumes; one prepare at
// a time per output directory (a lock file in it). docs/data.md.
#pragma once

#include "engine/data/prepare_directory.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dsrun {

struct PrepareOptions {
  std::vector<std::string> inputs;   // files and directories
  std::string tokenizer;             // tokenizer.json, tokenizer.model, or a directory
  std::string out;                   // the shard directory
  std::string field = "text";        // the JSON-lines field holding a document
  bool line_documents = false;       // plain text: each line is a document (default: each file)
  bool strict = false;               // a bad JSON line is fatal (default: skipped and counted)
  int threads = 0;                   // 0: every core
  int64_t shard_bytes = 64 << 20;    // input bytes per shard (whole files for compressed input)
  // The most text held whole: a JSON line (parsed whole), or a document the tokenizer cannot cut
  // into pieces (no safe cut in it, or a tokenizer without safe cuts). Longer ones are skipped and
  // counted (--strict: an error), so memory never depends on one line or document.
  int64_t max_document_bytes = int64_t(256) << 20;
};

struct PrepareSummary {
  int64_t documents = 0, tokens = 0, input_bytes = 0, skipped_lines = 0;
  int64_t blank_lines = 0;  // --line-documents: blank lines, skipped (not documents)
  int shards = 0, shards_reused = 0;
  int stale_files_removed = 0;  // shard files of an earlier, larger prepare (and temporary files of a killed one)
  int token_bytes = 0;
  int threads = 0;  // that tokenized
  // Documents tokenized now in several pieces at once (longer than a piece, about 1 MiB), and
  // their pieces; not counted for shards kept from an earlier run.
  int64_t cut_documents = 0, cut_pieces = 0;
  std::vector<std::string> skipped_examples;  // "file:line: why", the first few
  std::vector<std::string> skipped_directories;  // "dir: why": output directories met while walking the inputs
};

// Progress reports: shards done, shards in all, input bytes done, input bytes in all.
using PrepareProgress = std::function<void(int, int, int64_t, int64_t)>;

PrepareSummary prepare_corpus(const PrepareOptions& options, const PrepareProgress& progress);



}  // namespace dsrun
