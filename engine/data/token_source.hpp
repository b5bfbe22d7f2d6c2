// Token corpora read in place, as memory maps: dsrun's own shards (with `dsrun prepare`'s manifest
// or loose), Megatron-LM's indexed dataset, llm.c's and nanoGPT's .bin files, and weighted mixtures.
#pragma once

#include "engine/recipe/kinds.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dsrun {

class Error;
struct DataOptions;
// An error about a data file: names the file, the key data.path, and how to fix it.
Error data_error(const std::string& path, const std::string& what, const std::string& hint);


// dsrun's shard format, written by `dsrun prepare` and read here: a 32-byte header ("DSRUNTOK",
// u32 version 1, u32 bytes per token 2 or 4, u64 token count, u64 zero), then little-endian tokens.
constexpr size_t kTokenShardHeaderBytes = 32;
std::string token_shard_bytes(const std::vector<uint32_t>& tokens, int bytes_per_token);
// The document index beside a shard: "DSRUNDOC", u32 version 1, u32 0, u64 count, u64 0, then
// count u64 end offsets (in tokens, within the shard).
std::string document_index_bytes(const std::vector<uint64_t>& ends);

struct TokenCorpusOptions {
  std::vector<std::string> paths;   // one source each: a file, a Megatron prefix, or a directory
  std::vector<double> weights;      // mixture weights, one per path (empty: equal)
  std::string val_path;             // validation source; empty: the tail of each file
  TokenFormat format = TokenFormat::Auto;
  int token_width = 0;              // nanoGPT's headerless files: 2 or 4 bytes a token
  int64_t document_token = -1;      // llm.c/nanoGPT: the token between documents; -1: the format's default
  double val_fraction = 0.05;       // per file, rounded to whole documents
  int64_t vocab = 0;                // tokens at or above it are an error naming the file
  int64_t seq_len = 0;              // a window is seq_len + 1 tokens (inputs and shifted targets)
  uint64_t seed = 0;
  bool shuffle = true;
};

// The corpus a recipe's [data] names, as every rank and `dsrun plan` open it.
TokenCorpusOptions token_corpus_options(const DataOptions& data, int64_t vocab, int64_t seq_len, uint64_t seed);

// Where one window's tokens came from: document starts inside it (offsets > 0), for masking.
struct Window {
  std::vector<int64_t> tokens;           // seq_len + 1
  std::vector<int32_t> document_starts;  // ascending offsets in (0, seq_len]
};

// The corpus as windows of seq_len + 1 tokens. Training window g is fixed by (seed, g): each
// source's windows in a seeded permutation computed per index (no table), sources interleaved by
// their weights in a fixed pattern, so resuming needs only the step. Nothing held grows with the
// corpus except the list of files; tokens are read from the maps when a window is asked for.
class TokenCorpus {
 public:
  explicit TokenCorpus(const TokenCorpusOptions& options);
  ~TokenCorpus();
  void train_window(int64_t g, Window& out) const;
  void val_window(int64_t i, Window& out) const;  // in order, wrapping around
  int64_t train_windows() const;                  // one epoch, all sources
  int64_t val_windows() const;
  // What rank 0 reports as the data event: sources, tokens, how validation was cut, and warnings.
  std::string describe() const;
  // "source: why" for each source whose validation share is far (over 2x) from data.val_fraction;
  // describe() carries them too.
  std::vector<std::string> warnings() const;
  // Every file mapped, in a fixed order (sources, then data.val_path): tokens, then their index.
  std::vector<std::string> files() const;

  struct Source;

 private:
  TokenCorpusOptions options_;
  std::vector<std::unique_ptr<Source>> sources_;
  std::unique_ptr<Source> val_source_;             // data.val_path, when given
  std::vector<uint16_t> blend_;                    // source of each position in a block
  std::vector<int64_t> blend_rank_, blend_count_;  // index among that source's positions; positions per source
};

}  // namespace dsrun
