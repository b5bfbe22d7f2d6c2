// One shard's files (.tokens, .docs, then .json, the mark of a finished shard), written atomically
// in order from units tokenized on every thread and appended in order.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/input.hpp"

namespace dsrun::prepare_detail {

struct ShardResult {
  int64_t documents = 0, tokens = 0, bytes = 0, skipped = 0;
  int64_t blank = 0;  // --line-documents: blank lines, not documents
  int64_t cut_documents = 0, cut_pieces = 0;  // tokenized in pieces (not recorded: a summary of this run's work)
  std::vector<std::string> skipped_examples;
  json record;
  bool reused = false;
};

inline std::string shard_name(size_t k) {
  char name[32];
  std::snprintf(name, sizeof name, "shard-%05zu", k);
  return name;
}

inline std::string hex64(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// The 1-based line number at byte `offset` of a plain file (read only when a line is reported),
// counted a block at a time: the file before a late chunk may be larger than memory.
inline int line_at(const std::string& path, int64_t offset) {
  int line = 1;
  for (int64_t at = 0; at < offset;) {
    const int64_t end = std::min(offset, at + (int64_t(1) << 22));
    const std::string block = read_range(path, at, end);
    line += static_cast<int>(std::count(block.begin(), block.end(), '\n'));
    at = end;
  }
  return line;
}

// Text a thread takes at once: a run of whole lines, or a piece of one long document. Small, so that
// the units in flight bound memory whatever the documents (the tokenizer's working memory is many
// bytes per byte of text); large enough that handing one over costs nothing.
constexpr size_t kUnitBytes = Tokenizer::kPieceBytes;

// A unit of work, cut by the producer from a chunk's text, tokenized by any thread, appended to its
// shard in order.
struct Unit {
  enum class Kind {
    lines,  // whole lines: JSON lines, or --line-documents lines (each a document)
    piece,  // a piece of one document cut at safe cuts, or the whole document (first and last)
    skip,   // a document or line skipped before tokenizing (`why`)
  };
  Kind kind = Kind::lines;
  std::shared_ptr<class ShardBuilder> shard;
  size_t index = 0;  // its place among the shard's units
  size_t piece = 0;  // the chunk piece (file and range) it comes from
  std::string text;
  int line = 1;                // the line of text[0] (or of the document), counted from 1 at the chunk piece's start
  bool first = true, last = true;  // piece: the first / last piece of its document
  bool aborts_document = false;    // skip: drops a document some of whose pieces came before
  std::string why;                 // skip
  int64_t progress = 0;            // input bytes it accounts for, for progress reports
};

// What a unit adds to its shard.
struct UnitIds {
  Unit::Kind kind = Unit::Kind::lines;
  bool first = true, last = true, aborts_document = false;
  std::vector<uint32_t> ids;
  std::vector<uint64_t> ends;  // lines: document ends within ids
  int64_t skipped = 0;         // lines: lines skipped
  int64_t blank = 0;           // lines: blank lines of --line-documents (no document)
  std::vector<std::string> examples;  // "file:line: why"
  bool refused = false;        // piece: the tokenizer refused it (examples says why), so its document is dropped
};

// Error for a system call on a shard file, worded as write_file_atomic words its own.
inline Error shard_file_error(const std::string& what, const std::string& path) {
  ErrorContext c;
  c.file = path;
  return Error(what + ": " + std::strerror(errno), c);
}

// One shard being written: the units' ids are appended in unit order to a temporary .tokens file
// as they come (so a document of gigabytes is never held), a document that the tokenizer refuses
// part-way is cut off again, and when every unit is in, the .tokens, .docs and .json files are put
// in place in that order (the .json marks the shard finished). The temporary file is removed if the
// shard is never finished.
class ShardBuilder {
 public:
  ShardBuilder(const std::string& out, size_t k, Chunk chunk, int token_bytes, int64_t vocab_size)
      : k_(k), base_(path_join(out, shard_name(k))), chunk_(std::move(chunk)), token_bytes_(token_bytes), vocab_size_(vocab_size) {
    tmp_ = base_ + ".tokens.tmp." + std::to_string(::getpid());  // a name remove_stale_files knows
    fd_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw shard_file_error("cannot create file", tmp_);
    first_lines_.assign(chunk_.pieces.size(), 0);
  }
  ~ShardBuilder() {
    if (fd_ >= 0) ::close(fd_);
    if (!finished_) ::unlink(tmp_.c_str());
  }
  ShardBuilder(const ShardBuilder&) = delete;
  ShardBuilder& operator=(const ShardBuilder&) = delete;

  size_t number() const { return k_; }
  const Piece& piece(size_t i) const { return chunk_.pieces[i]; }

  // The absolute line number of `relative` (1 at the piece's start) in piece i of a plain file, whose
  // first line is counted once, when the first line is reported.
  int absolute_line(size_t i, int relative, const std::string& path) {
    std::lock_guard<std::mutex> lock(lines_mutex_);
    if (first_lines_[i] == 0) {
      const Piece& p = chunk_.pieces[i];
      first_lines_[i] = p.first_line > 0 ? p.first_line : line_at(path, p.begin);
    }
    return first_lines_[i] + relative - 1;
  }

  // Unit `index`'s ids, in any order. Appends every unit now in order; returns how many, and whether
  // this call completed the shard (then the caller runs finish()).
  std::pair<size_t, bool> deliver(size_t index, UnitIds ids) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.emplace(index, std::move(ids));
    size_t appended = 0;
    for (auto it = waiting_.find(next_); it != waiting_.end(); it = waiting_.find(next_)) {
      append(it->second);
      waiting_.erase(it);
      ++next_;
      ++appended;
    }
    return {appended, complete_locked()};
  }

  // The producer has issued all `units` units of the chunk, whose end and text size are now known.
  // True when this call completed the shard.
  bool close(size_t units, int64_t end_of_last_piece, int64_t text_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    units_ = units;
    chunk_.pieces.back().end = end_of_last_piece;
    text_bytes_ = text_bytes;
    return complete_locked();
  }
  const Chunk& chunk() const { return chunk_; }

  // Puts the shard's files in place: .tokens, .docs, then the record `identity` + counts (.json).
  ShardResult finish(const json& identity) {
    std::string header = token_shard_bytes({}, token_bytes_);  // the format's header, count patched in (docs/data.md)
    for (int b = 0; b < 8; ++b) header[16 + b] = static_cast<char>((tokens_ >> (8 * b)) & 0xFF);
    const int64_t file_bytes = static_cast<int64_t>(header.size() + tokens_ * static_cast<uint64_t>(token_bytes_));
    if (::ftruncate(fd_, file_bytes) != 0) throw shard_file_error("cannot write file", tmp_);  // drops ids of a document cut off last
    write_at(header.data(), header.size(), 0);
    XXH3_state_t* state = XXH3_createState();
    if (!state) throw std::bad_alloc();
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owner(state, &XXH3_freeState);
    XXH3_64bits_reset(state);
    std::string block(std::min<int64_t>(file_bytes, int64_t(1) << 22), '\0');
    for (int64_t at = 0; at < file_bytes;) {
      const ssize_t n = ::pread(fd_, block.data(), static_cast<size_t>(std::min<int64_t>(file_bytes - at, static_cast<int64_t>(block.size()))), at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw shard_file_error("cannot read back file", tmp_);
      XXH3_64bits_update(state, block.data(), static_cast<size_t>(n));
      at += n;
    }
    const uint64_t tokens_hash = XXH3_64bits_digest(state);
    if (::fsync(fd_) != 0) throw shard_file_error("cannot flush file", tmp_);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw shard_file_error("cannot flush file", tmp_);
    if (::rename(tmp_.c_str(), (base_ + ".tokens").c_str()) != 0) throw shard_file_error("cannot rename into place", base_ + ".tokens");
    finished_ = true;
    sync_directory(parent_directory(base_));
    const std::string docs = document_index_bytes(ends_);
    write_file_atomic(base_ + ".docs", docs);
    const std::string name = shard_name(k_);
    ShardResult r;
    r.documents = static_cast<int64_t>(ends_.size());
    r.tokens = static_cast<int64_t>(tokens_);
    r.bytes = text_bytes_;
    r.skipped = skipped_;
    r.blank = blank_;
    r.skipped_examples = examples_;
    r.cut_documents = cut_documents_;
    r.cut_pieces = cut_pieces_;
    r.record = {{"identity", identity},
                {"documents", r.documents},
                {"tokens", r.tokens},
                {"input_bytes", r.bytes},
                {"skipped_lines", r.skipped},
                {"blank_lines", r.blank},
                {"tokens_file", name + ".tokens"},
                {"tokens_file_bytes", file_bytes},
                {"tokens_xxh3", hex64(tokens_hash)},
                {"docs_file", name + ".docs"},
                {"docs_file_bytes", static_cast<int64_t>(docs.size())},
                {"docs_xxh3", hex64(XXH3_64bits(docs.data(), docs.size()))}};
    if (!r.skipped_examples.empty()) r.record["skipped_examples"] = r.skipped_examples;  // for a prepare that keeps this shard
    write_file_atomic(base_ + ".json", r.record.dump(1, ' ', false, json::error_handler_t::replace) + "\n");  // (file names need not be UTF-8)
    return r;
  }

 private:
  bool complete_locked() {
    if (claimed_ || units_ == SIZE_MAX || next_ != units_) return false;
    claimed_ = true;
    return true;
  }

  void write_at(const char* data, size_t size, int64_t offset) {
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, offset + static_cast<int64_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw shard_file_error("cannot write file", tmp_);
      done += static_cast<size_t>(n);
    }
  }

  void write_ids(const std::vector<uint32_t>& ids) {
    for (uint32_t t : ids) {
      if (t >= vocab_size_) throw input_error(base_ + ".tokens", 0, "token " + std::to_string(t) + " is outside the vocabulary", "report it: the tokenizer produced it");
    }
    const std::string bytes = token_shard_bytes(ids, token_bytes_);
    write_at(bytes.data() + kTokenShardHeaderBytes, bytes.size() - kTokenShardHeaderBytes,
             static_cast<int64_t>(kTokenShardHeaderBytes + tokens_ * static_cast<uint64_t>(token_bytes_)));
    tokens_ += ids.size();
  }

  void count_skip(const std::vector<std::string>& examples, int64_t count) {
    skipped_ += count;
    for (const std::string& e : examples) {
      if (examples_.size() < 5) examples_.push_back(e);
    }
  }

  void append(const UnitIds& u) {
    switch (u.kind) {
      case Unit::Kind::lines: {
        const uint64_t base = tokens_;
        write_ids(u.ids);
        for (uint64_t e : u.ends) ends_.push_back(base + e);
        count_skip(u.examples, u.skipped);
        blank_ += u.blank;
        break;
      }
      case Unit::Kind::piece:
        if (u.first) {
          document_start_ = tokens_;
          document_dropped_ = false;
        }
        if (document_dropped_) break;  // a later piece of a document refused already
        if (u.refused) {  // the document's earlier pieces are cut off again: no document is half there
          tokens_ = document_start_;
          document_dropped_ = true;
          count_skip(u.examples, 1);
          break;
        }
        write_ids(u.ids);
        if (u.last) ends_.push_back(tokens_);
        if (!(u.first && u.last)) {
          cut_pieces_ += 1;
          cut_documents_ += u.first ? 1 : 0;
        }
        break;
      case Unit::Kind::skip:
        if (u.aborts_document) {
          if (!document_dropped_) {
            tokens_ = document_start_;
            count_skip(u.examples, 1);
          }
          document_dropped_ = false;
        } else {
          count_skip(u.examples, 1);
        }
        break;
    }
  }

  const size_t k_;
  const std::string base_;
  Chunk chunk_;
  const int token_bytes_;
  const int64_t vocab_size_;
  std::string tmp_;
  int fd_ = -1;
  bool finished_ = false;

  std::mutex mutex_;  // everything below
  std::map<size_t, UnitIds> waiting_;  // delivered before the units ahead of them
  size_t next_ = 0, units_ = SIZE_MAX;
  bool claimed_ = false;
  uint64_t tokens_ = 0, document_start_ = 0;
  bool document_dropped_ = false;
  std::vector<uint64_t> ends_;
  int64_t skipped_ = 0, blank_ = 0, text_bytes_ = 0, cut_documents_ = 0, cut_pieces_ = 0;
  std::vector<std::string> examples_;

  std::mutex lines_mutex_;
  std::vector<int> first_lines_;  // 0: not counted yet
};

}  // namespace dsrun::prepare_detail
