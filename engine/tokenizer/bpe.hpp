// The byte-pair-encoding model of tokenizer.json: a vocabulary, ranked merges, and the word cache.
// Given one pre-token, it yields the ids the `tokenizers` crate's BPE model yields.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dsrun {

struct BpeOptions {
  std::vector<std::pair<std::string, uint32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // rank = position
  std::optional<std::string> unk_token;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  bool fuse_unk = false;
  bool byte_fallback = false;   // unknown characters as <0xXX> byte tokens
  bool ignore_merges = false;   // a word that is in the vocabulary is one token, merges or not
};

class Bpe {
 public:
  // `where` names the model for errors ("model" in tokenizer.json).
  Bpe(BpeOptions options, const std::string& where);
  // Appends the ids of one pre-token. Thread-safe; results for short words are cached per thread.
  void encode_word(std::string_view word, std::vector<uint32_t>& ids) const;
  std::optional<uint32_t> token_id(std::string_view token) const;
  const std::string* token(uint32_t id) const;  // nullptr outside the vocabulary
  int64_t size() const { return static_cast<int64_t>(id_to_token_.size()); }

 private:
  struct Merge {
    uint32_t rank;
    uint32_t merged;
  };
  static uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t(a) << 32) | b; }
  void merge_word(std::string_view word, std::vector<uint32_t>& ids) const;

  BpeOptions options_;
  // Token -> id: open addressing over (hash, id) slots, strings compared in id_to_token_ (short
  // ones inline there): two cache misses a lookup, where std::unordered_map took three.
  struct Slot {
    uint32_t hash;
    uint32_t id;  // kEmpty when free
  };
  static constexpr uint32_t kEmpty = UINT32_MAX;
  void insert_token(uint32_t id);
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  std::vector<Slot> slots_;
  uint64_t slot_mask_ = 0;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<uint32_t> unk_id_;
  uint64_t cache_key_;  // tells per-thread caches of different models apart
};

}  // namespace dsrun
