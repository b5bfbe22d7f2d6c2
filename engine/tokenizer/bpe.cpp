// The BPE model (see bpe.hpp). Merging follows the `tokenizers` crate: the lowest-ranked adjacent
// pair merges first, the leftmost among equals, with a heap so long words stay O(n log n).
#include "engine/tokenizer/bpe.hpp"

#include "engine/common/error.hpp"
#include "engine/tokenizer/unicode.hpp"

#include <xxhash.h>

#include <atomic>
#include <cstdio>
#include <queue>

namespace dsrun {
namespace {

Error model_error(const std::string& where, const std::string& message, const std::string& hint) {
  ErrorContext c;
  c.key = where;
  c.hint = hint;
  return Error(message, c);
}

// Per thread, per model: words seen before. Bounded so a corpus of unique words cannot grow it
// without end; words longer than kMaxCachedWord bytes are not cached.
constexpr size_t kMaxCachedWord = 64;
constexpr size_t kMaxCacheEntries = 1 << 18;

struct WordCache {
  uint64_t model = 0;
  std::unordered_map<std::string, std::vector<uint32_t>> words;
};

}  // namespace

Bpe::Bpe(BpeOptions options, const std::string& where) : options_(std::move(options)) {
  static std::atomic<uint64_t> next_key{1};
  cache_key_ = next_key++;
  uint32_t max_id = 0;
  for (const auto& [token, id] : options_.vocab) max_id = std::max(max_id, id);
  id_to_token_.resize(options_.vocab.empty() ? 0 : size_t(max_id) + 1);
  std::vector<bool> seen(id_to_token_.size());
  for (auto& [token, id] : options_.vocab) {
    if (seen[id]) throw model_error(where + ".vocab", "id " + std::to_string(id) + " is given to two tokens", "each id once");
    seen[id] = true;
    id_to_token_[id] = std::move(token);
  }
  has_id_ = seen;
  size_t capacity = 16;
  while (capacity < id_to_token_.size() * 2) capacity *= 2;  // load factor at most 1/2
  slots_.assign(capacity, Slot{0, kEmpty});
  slot_mask_ = capacity - 1;
  for (uint32_t id = 0; id < id_to_token_.size(); ++id) {
    if (seen[id]) insert_token(id);
  }
  options_.vocab.clear();
  options_.vocab.shrink_to_fit();

  const size_t prefix = options_.continuing_subword_prefix.size();
  merges_.reserve(options_.merges.size());
  for (size_t rank = 0; rank < options_.merges.size(); ++rank) {
    const auto& [a, b] = options_.merges[rank];
    const auto where_merge = where + ".merges[" + std::to_string(rank) + "]";
    const auto ia = token_id(a), ib = token_id(b);
    if (!ia || !ib) throw model_error(where_merge, "merge \"" + a + " " + b + "\" names a token missing from the vocabulary", "fix the tokenizer.json");
    std::string merged = a + (prefix > 0 && b.compare(0, prefix, options_.continuing_subword_prefix) == 0 ? b.substr(prefix) : b);
    const auto im = token_id(merged);
    if (!im) throw model_error(where_merge, "merge result \"" + merged + "\" is missing from the vocabulary", "fix the tokenizer.json");
    // A pair listed twice keeps its first (lowest) rank, as the crate's map insertion does not.
    merges_.emplace(pair_key(*ia, *ib), Merge{static_cast<uint32_t>(rank), *im});
  }
  options_.merges.clear();
  options_.merges.shrink_to_fit();
  if (options_.unk_token) {
    unk_id_ = token_id(*options_.unk_token);
    if (!unk_id_) throw model_error(where + ".unk_token", "unk_token \"" + *options_.unk_token + "\" is not in the vocabulary", "add it or set unk_token to null");
  }
}

void Bpe::insert_token(uint32_t id) {
  const uint64_t h = XXH3_64bits(id_to_token_[id].data(), id_to_token_[id].size());
  for (uint64_t i = h & slot_mask_;; i = (i + 1) & slot_mask_) {
    if (slots_[i].id == kEmpty) {
      slots_[i] = {static_cast<uint32_t>(h >> 32), id};
      return;
    }
  }
}

std::optional<uint32_t> Bpe::token_id(std::string_view token) const {
  const uint64_t h = XXH3_64bits(token.data(), token.size());
  const auto tag = static_cast<uint32_t>(h >> 32);
  for (uint64_t i = h & slot_mask_;; i = (i + 1) & slot_mask_) {
    const Slot& slot = slots_[i];
    if (slot.id == kEmpty) return std::nullopt;
    if (slot.hash == tag && id_to_token_[slot.id] == token) return slot.id;
  }
}

const std::string* Bpe::token(uint32_t id) const {
  return id < id_to_token_.size() && has_id_[id] ? &id_to_token_[id] : nullptr;
}

void Bpe::encode_word(std::string_view word, std::vector<uint32_t>& ids) const {
  if (options_.ignore_merges) {
    if (const auto id = token_id(word)) {
      ids.push_back(*id);
      return;
    }
  }
  if (word.size() > kMaxCachedWord) {
    merge_word(word, ids);
    return;
  }
  thread_local WordCache cache;
  if (cache.model != cache_key_) {
    cache.words.clear();
    cache.model = cache_key_;
  }
  const auto it = cache.words.find(std::string(word));
  if (it != cache.words.end()) {
    ids.insert(ids.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t first = ids.size();
  merge_word(word, ids);
  if (cache.words.size() < kMaxCacheEntries) cache.words.emplace(std::string(word), std::vector<uint32_t>(ids.begin() + first, ids.end()));
}

void Bpe::merge_word(std::string_view word, std::vector<uint32_t>& ids) const {
  struct Symbol {
    uint32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  // One symbol per character (with the subword prefix / word suffix where the model has them).
  std::string piece;
  bool unk_pending = false;  // the last symbol is an unknown token that may absorb the next (fuse_unk)
  for (size_t i = 0; i < word.size();) {
    int len;
    unicode::decode_at(word, i, &len);
    piece.clear();
    if (i > 0) piece += options_.continuing_subword_prefix;
    piece.append(word.substr(i, len));
    if (i + len == word.size()) piece += options_.end_of_word_suffix;
    const auto push = [&](uint32_t id) {
      const int n = static_cast<int>(symbols.size());
      symbols.push_back({id, n - 1, -1, true});
      if (n > 0) symbols[n - 1].next = n;
    };
    if (const auto id = token_id(piece)) {
      push(*id);
      unk_pending = false;
    } else {
      bool handled = false;
      if (options_.byte_fallback) {
        std::vector<uint32_t> bytes;
        char name[8];
        for (const char byte : piece) {  // the crate falls back on the bytes of the piece, prefix included
          std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned char>(byte));
          const auto id = token_id(name);
          if (!id) break;
          bytes.push_back(*id);
        }
        if (bytes.size() == piece.size()) {
          for (uint32_t id : bytes) push(id);
          handled = true;
          unk_pending = false;
        }
      }
      if (!handled && unk_id_) {
        if (!(options_.fuse_unk && unk_pending)) push(*unk_id_);
        unk_pending = true;
      }
      // Without an unknown token the crate drops the character; so does dsrun.
    }
    i += len;
  }

  struct Candidate {
    uint32_t rank;
    int pos;
    uint32_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  const auto consider = [&](int left) {
    if (left < 0) return;
    const int right = symbols[left].next;
    if (right < 0) return;
    const auto it = merges_.find(pair_key(symbols[left].id, symbols[right].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.merged});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.merged != top.merged) continue;  // stale: a neighbour changed
    left.id = top.merged;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    consider(left.prev);
    consider(top.pos);
  }
  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

}  // namespace dsrun
