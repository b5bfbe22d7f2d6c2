// The data commands: `dsrun tokenize` (text to ids and back, one JSON array per line) and
// `dsrun prepare` (a corpus to token shards).
// They read and write files only; no store, no ranks.
#pragma once

#include <string>

namespace dsrun {

struct TokenizeArgs {
  std::string tokenizer;     // tokenizer.json, tokenizer.model, or a directory holding one
  std::string file = "-";    // "-" is standard input
  bool special = false;      // add the post-processor's tokens (BOS/EOS)
  bool decode = false;       // read arrays of ids, print text
  bool skip_special = false; // --decode: leave special tokens out
  int threads = 0;           // 0: every core
  bool stats = false;        // throughput on standard error
};

int command_tokenize(const TokenizeArgs& args);

struct PrepareOptions;
int command_prepare(const PrepareOptions& options);

}  // namespace dsrun
