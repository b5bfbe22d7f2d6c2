// `dsrun prepare` (see prepare.hpp). The input is cut into chunks (byte ranges at line ends, or
// whole files) before any tokenizing, so shard k is a pure function of chunk k and the tokenizer:
// that is what lets a killed prepare keep the shards it finished. A chunk's text is read as a
// stream and cut into units of about a megabyte (runs of whole lines, or pieces of one long
// document at the tokenizer's safe cuts, which give the ids of the whole), tokenized on every
// thread and appended to the shard in order, so memory is bounded by the units in flight and a
// document of gigabytes uses every core. Each shard is three files written atomically in order
// (.tokens, .docs, then .json, the mark of a finished shard); the manifest is written last, so a
// directory without one is never taken as a finished corpus. One prepare at a time writes to a
// directory (flock on its lock file); an input file that changes while it is read is an error,
// not a corpus of old and new text.
#include "engine/data/prepare.hpp"
#include "engine/data/prepare_directory.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/data/token_source.hpp"
#include "engine/tokenizer/tokenizer.hpp"

#include <nlohmann/json.hpp>
#include <sys/file.h>
#include <sys/stat.h>
#include <xxhash.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <new>
#include <optional>
#include <cctype>
#include <condition_variable>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace dsrun {
namespace {

using json = nlohmann::json;

Error input_error(const std::string& file, int line, const std::string& what, const std::string& hint) {
  ErrorContext c;
  c.file = file;
  c.line = line;
  c.hint = hint;
  return Error(what, c);
}

enum class Compression { none, gzip, zstd };

struct InputFile {
  std::string path;
  Compression compression = Compression::none;
  bool json_lines = false;
  int64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;  // not in a shard's identity; only to see a change while the file is read
};

int64_t nanoseconds(const struct timespec& t) { return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec; }

// After a file was read: the file must be as it was when the inputs were listed, or the corpus
// would mix old and new text. Size, modification time and status-change time (which no tool can
// set back, so a file put back with its old modification time is caught too).
void check_unchanged(const InputFile& f, int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw input_error(f.path, 0, std::string("cannot stat: ") + std::strerror(errno), "check the file");
  std::string what;
  if (st.st_size != f.size) what = "changed size from " + std::to_string(f.size) + " to " + std::to_string(st.st_size) + " bytes";
  else if (nanoseconds(st.st_mtim) != f.mtime_ns) what = "was rewritten (same size, a new modification time)";
  else if (nanoseconds(st.st_ctim) != f.ctime_ns) what = "was replaced or rewritten (a new status-change time)";
  if (!what.empty()) {
    throw input_error(f.path, 0, what + " while dsrun prepare was reading it: its shards would mix old and new text",
                      "run the same command again once nothing writes to the inputs (finished shards are kept)");
  }
}

// At most `limit` bytes of `text`, cut at a character boundary, saying how long it was.
std::string excerpt(const std::string& text, size_t limit = 300) {
  if (text.size() <= limit) return text;
  size_t cut = limit;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(0, cut) + "... (" + std::to_string(text.size()) + " bytes in all)";
}

// A stretch of one input file: bytes of a plain file, or of a compressed file's text.
struct Piece {
  size_t file;
  int64_t begin, end;
  int first_line = 0;  // the line number at `begin` when known (streamed text); else counted when needed
};

struct Chunk {
  std::vector<Piece> pieces;
  int64_t bytes = 0;
};

// The output directory, to keep it out of the inputs: a prepare run again with -o inside an input
// directory would otherwise read its own shards as text.
struct OutputDirectory {
  bool exists = false;
  dev_t device = 0;
  ino_t inode = 0;
};

void collect(const std::string& path, std::vector<std::string>& out, const OutputDirectory& output, bool named,
             std::vector<std::string>& skipped) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw input_error(path, 0, "input not found", "check the path");
  if (S_ISDIR(st.st_mode)) {
    const bool is_output = output.exists && st.st_dev == output.device && st.st_ino == output.inode;
    const std::vector<std::string> names = list_directory(path);
    if (is_output || holds_prepare_output(path, names)) {
      const std::string what = is_output ? "the output directory (-o)" : "the output of another dsrun prepare";
      if (named) throw input_error(path, 0, "the input is " + what + ": its shards are not text", "name the text files or directories, and write the shards outside them");
      skipped.push_back(path + ": " + what + ", not read as input");
      return;
    }
    for (const std::string& name : names) {
      if (name.empty() || name[0] == '.' || ends_with(name, ".dat")) continue;
      const std::string child = path_join(path, name);
      struct stat cst {};
      if (::lstat(child.c_str(), &cst) != 0) continue;
      if (S_ISDIR(cst.st_mode) || S_ISREG(cst.st_mode)) collect(child, out, output, false, skipped);  // links are skipped, as in data directories
    }
  } else if (S_ISREG(st.st_mode)) {
    out.push_back(path);
  } else {
    throw input_error(path, 0, "input is not a regular file or a directory", "name text, .jsonl, .gz or .zst files");
  }
}

InputFile describe_input(const std::string& path) {
  InputFile f;
  f.path = path;
  std::string base = path;
  if (ends_with(base, ".gz")) {
    f.compression = Compression::gzip;
    base.resize(base.size() - 3);
  } else if (ends_with(base, ".zst")) {
    f.compression = Compression::zstd;
    base.resize(base.size() - 4);
  }
  f.json_lines = ends_with(base, ".jsonl") || ends_with(base, ".ndjson");
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw input_error(path, 0, "cannot stat input", "check the path");
  f.size = st.st_size;
  f.mtime_ns = nanoseconds(st.st_mtim);
  f.ctime_ns = nanoseconds(st.st_ctim);
  return f;
}

// Bytes [begin, end) of a plain file; with `input`, checked unchanged after reading.
std::string read_range(const std::string& path, int64_t begin, int64_t end, const InputFile* input = nullptr) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw input_error(path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
  std::string out(static_cast<size_t>(end - begin), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + done, out.size() - done, begin + static_cast<int64_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      if (input) {
        try {
          check_unchanged(*input, fd);  // a file that shrank: say that it changed
        } catch (...) {
          ::close(fd);
          throw;
        }
      }
      ::close(fd);
      throw input_error(path, 0, n < 0 ? std::string("cannot read: ") + std::strerror(err) : "the file shrank while being read", "check the file");
    }
    done += static_cast<size_t>(n);
  }
  if (input) {
    try {
      check_unchanged(*input, fd);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }
  ::close(fd);
  return out;
}

// A compressed file's text, block by block, so that a file larger than memory can be read.
class Decompressor {
 public:
  explicit Decompressor(const InputFile& f) : f_(f) {
    fd_ = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw input_error(f.path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
    if (f.compression == Compression::gzip) {
      // zlib reads what is not gzip as plain bytes: a .gz of random bytes would be tokenized as text.
      unsigned char magic[2] = {0, 0};
      const ssize_t got = ::pread(fd_, magic, 2, 0);
      if (got != 2 || magic[0] != 0x1f || magic[1] != 0x8b) {
        ::close(fd_);
        throw input_error(f.path, 0, got < 2 ? "is empty or shorter than a gzip header" : "is not gzip data (it does not start with gzip's 1f 8b)",
                          "download it again, or rename it without .gz if it is plain text");
      }
      gz_ = ::gzdopen(fd_, "rb");  // closes fd_ on gzclose
      if (!gz_) {
        ::close(fd_);
        throw input_error(f.path, 0, "cannot open gzip file", "check the file");
      }
      ::gzbuffer(gz_, 1 << 17);
    } else {
      file_ = ::fdopen(fd_, "rb");  // closes fd_ on fclose
      if (!file_) {
        ::close(fd_);
        throw input_error(f.path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
      }
      zstd_ = ZSTD_createDCtx();
      in_.resize(ZSTD_DStreamInSize());
    }
  }
  ~Decompressor() {
    if (gz_) ::gzclose(gz_);
    if (file_) std::fclose(file_);
    if (zstd_) ZSTD_freeDCtx(zstd_);
  }
  Decompressor(const Decompressor&) = delete;
  Decompressor& operator=(const Decompressor&) = delete;

  // Appends up to about a megabyte of text to `out`; false once the file is done.
  bool read(std::string& out) {
    const size_t start = out.size();
    if (gz_) {
      out.resize(start + (1 << 20));
      const int n = ::gzread(gz_, out.data() + start, 1 << 20);
      if (n < 0) {
        int code = 0;
        throw input_error(f_.path, 0, std::string("corrupt gzip data: ") + ::gzerror(gz_, &code), "download the file again");
      }
      out.resize(start + static_cast<size_t>(n));
      int code = Z_OK;
      const char* why = ::gzerror(gz_, &code);
      if (n == 0 && code != Z_OK)  // zlib reports a cut-off stream here, not as n < 0
        throw input_error(f_.path, 0, std::string(code == Z_BUF_ERROR ? "truncated gzip data: " : "corrupt gzip data: ") + why, "download the file again");
      if (n == 0) check_unchanged(f_, fd_);
      return n > 0;
    }
    while (out.size() - start < (1 << 20)) {
      if (in_pos_ == in_size_ && !pending_) {
        in_size_ = std::fread(in_.data(), 1, in_.size(), file_);
        in_pos_ = 0;
        consumed_ += static_cast<int64_t>(in_size_);
        if (in_size_ == 0) {
          if (std::ferror(file_)) throw input_error(f_.path, 0, std::string("cannot read: ") + std::strerror(errno), "check the file");
          check_unchanged(f_, fd_);
          if (last_ != 0) throw input_error(f_.path, 0, "truncated zstd data", "download the file again");
          return out.size() > start;
        }
      }
      ZSTD_inBuffer in{in_.data(), in_size_, in_pos_};
      const size_t at = out.size();
      out.resize(at + ZSTD_DStreamOutSize());
      ZSTD_outBuffer o{out.data() + at, ZSTD_DStreamOutSize(), 0};
      last_ = ZSTD_decompressStream(zstd_, &o, &in);
      if (ZSTD_isError(last_)) throw input_error(f_.path, 0, std::string("corrupt zstd data: ") + ZSTD_getErrorName(last_), "download the file again");
      out.resize(at + o.pos);
      in_pos_ = in.pos;
      // A full output buffer: more may come without more input, unless the frame just ended
      // (last_ == 0: decoded and flushed). Asked again with no input after its end, zstd would
      // answer with the size of the next frame's header, which is not a cut-off frame: a text of
      // a multiple of 128 KiB ends exactly so.
      pending_ = o.pos == o.size && last_ != 0;
    }
    return true;
  }
  // Compressed bytes read so far (progress).
  int64_t consumed() const { return gz_ ? static_cast<int64_t>(::gzoffset(gz_)) : consumed_; }

 private:
  const InputFile& f_;
  gzFile gz_ = nullptr;
  std::FILE* file_ = nullptr;
  ZSTD_DCtx* zstd_ = nullptr;
  std::string in_;
  size_t in_pos_ = 0, in_size_ = 0, last_ = 0;
  bool pending_ = false;
  int64_t consumed_ = 0;
  int fd_ = -1;  // owned by gz_ or file_
};

// The offset of the first line start at or after `at` (the file's size if none).
int64_t next_line_start(const std::string& path, int64_t at, int64_t size) {
  while (at < size) {
    const int64_t end = std::min(size, at + 4096);
    const std::string block = read_range(path, at, end);
    const size_t nl = block.find('\n');
    if (nl != std::string::npos) return at + static_cast<int64_t>(nl) + 1;
    at = end;
  }
  return size;
}

// In input order: chunks fixed now (plain files, and compressed files read as one document), and
// compressed files of lines, cut into chunks as they are decompressed (stream_file).
struct PlannedChunk {
  Chunk chunk;
  int stream_file = -1;
};

std::vector<PlannedChunk> make_chunks(const std::vector<InputFile>& files, const PrepareOptions& o) {
  std::vector<PlannedChunk> chunks;
  Chunk current;
  const auto flush = [&] {
    if (!current.pieces.empty()) chunks.push_back({std::move(current), -1});
    current = Chunk{};
  };
  for (size_t i = 0; i < files.size(); ++i) {
    const InputFile& f = files[i];
    const bool by_lines = f.json_lines || o.line_documents;
    if (f.compression != Compression::none && by_lines) {
      flush();
      chunks.push_back({Chunk{}, static_cast<int>(i)});
      continue;
    }
    if (f.compression != Compression::none || !by_lines || f.size <= o.shard_bytes) {
      if (current.bytes > 0 && current.bytes + f.size > o.shard_bytes) flush();
      current.pieces.push_back({i, 0, f.size});
      current.bytes += f.size;
      continue;
    }
    flush();
    for (int64_t begin = 0; begin < f.size;) {
      const int64_t end = next_line_start(f.path, std::min(f.size, begin + o.shard_bytes), f.size);
      chunks.push_back({Chunk{{{i, begin, end}}, end - begin}, -1});
      begin = end;
    }
  }
  flush();
  return chunks;
}

struct ShardResult {
  int64_t documents = 0, tokens = 0, bytes = 0, skipped = 0;
  int64_t cut_documents = 0, cut_pieces = 0;  // tokenized in pieces (not recorded: a summary of this run's work)
  std::vector<std::string> skipped_examples;
  json record;
  bool reused = false;
};

std::string shard_name(size_t k) {
  char name[32];
  std::snprintf(name, sizeof name, "shard-%05zu", k);
  return name;
}

std::string hex64(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// The 1-based line number at byte `offset` of a plain file (read only when a line is reported),
// counted a block at a time: the file before a late chunk may be larger than memory.
int line_at(const std::string& path, int64_t offset) {
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
  std::vector<std::string> examples;  // "file:line: why"
  bool refused = false;        // piece: the tokenizer refused it (examples says why), so its document is dropped
};

// Error for a system call on a shard file, worded as write_file_atomic words its own.
Error shard_file_error(const std::string& what, const std::string& path) {
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
    r.skipped_examples = examples_;
    r.cut_documents = cut_documents_;
    r.cut_pieces = cut_pieces_;
    r.record = {{"identity", identity},
                {"documents", r.documents},
                {"tokens", r.tokens},
                {"input_bytes", r.bytes},
                {"skipped_lines", r.skipped},
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
  int64_t skipped_ = 0, text_bytes_ = 0, cut_documents_ = 0, cut_pieces_ = 0;
  std::vector<std::string> examples_;

  std::mutex lines_mutex_;
  std::vector<int> first_lines_;  // 0: not counted yet
};

// Cuts the text of one chunk piece, fed in blocks of any size, into units: runs of whole lines of
// about kUnitBytes (JSON lines, --line-documents), or the pieces of a document cut at the
// tokenizer's safe cuts (a text file read as one document; a line of --line-documents longer than a
// unit). What must be held whole, a JSON line (it is parsed whole) or a document with no safe cut,
// may be max_document bytes; a longer one is skipped (a skip unit) and read past without being held.
class Splitter {
 public:
  enum class Mode { document, lines, json_lines };
  Splitter(Mode mode, const Tokenizer& tokenizer, size_t max_document, std::function<void(Unit&&)> emit)
      : mode_(mode), tokenizer_(tokenizer), max_document_(max_document), emit_(std::move(emit)) {
    if (mode_ == Mode::document) start_document(1);
  }

  void feed(std::string_view text) {
    if (mode_ == Mode::document) {
      take(text, false);
      return;
    }
    for (size_t i = 0; i < text.size();) {
      const size_t newline = text.find('\n', i);
      const bool line_ends = newline != std::string_view::npos;
      const std::string_view part = text.substr(i, (line_ends ? newline : text.size()) - i);
      if (long_line_) {
        take(part, line_ends);
      } else if (partial_.size() + part.size() > kUnitBytes) {  // a long line: units of its own
        flush_lines();
        long_line_ = true;
        start_document(line_);
        const std::string head = std::move(partial_);
        partial_.clear();
        take(head, false);
        take(part, line_ends);
      } else if (!line_ends) {
        partial_.append(part);
      } else {
        if (batch_.empty()) batch_line_ = line_;
        batch_ += partial_;
        partial_.clear();
        batch_.append(part);
        batch_ += '\n';
        if (batch_.size() >= kUnitBytes) flush_lines();
      }
      if (!line_ends) break;
      long_line_ = false;
      ++line_;
      i = newline + 1;
    }
  }

  // The end of the piece's text.
  void finish() {
    if (mode_ == Mode::document || long_line_) {
      take({}, true);
    } else if (!partial_.empty()) {  // a last line without '\n'
      if (batch_.empty()) batch_line_ = line_;
      batch_ += partial_;
      partial_.clear();
    }
    long_line_ = false;
    flush_lines();
  }

  // Whether the rest of a document-mode piece is not needed: its document was skipped.
  bool skipping_document() const { return mode_ == Mode::document && dropping_; }

 private:
  void flush_lines() {
    if (batch_.empty()) return;
    Unit u;
    u.kind = Unit::Kind::lines;
    u.text = std::move(batch_);
    u.line = batch_line_;
    batch_.clear();
    emit_(std::move(u));
  }

  void start_document(int line) {
    held_.clear();
    document_line_ = line;
    started_ = false;
    dropping_ = false;
    scanned_ = 0;
  }

  // More of the current document (or long line); `ends`: it ends after this.
  void take(std::string_view part, bool ends) {
    // A JSON line is parsed whole; a document is cut where the tokenizer can cut.
    const bool cuttable = mode_ != Mode::json_lines && tokenizer_.can_cut();
    // A unit's worth at a time, so that what is held is checked against max_document_ before it
    // grows past it (a string doubling from max_document_ would hold twice that for a moment).
    while (!part.empty() && !dropping_) {
      const std::string_view slice = part.substr(0, kUnitBytes);
      part.remove_prefix(slice.size());
      if (held_.size() + slice.size() > max_document_) {
        drop();
        break;
      }
      held_.append(slice);
      while (cuttable && held_.size() > kUnitBytes) {
        const size_t cut = tokenizer_.safe_cut(held_, std::max(kUnitBytes, scanned_));
        if (cut == Tokenizer::npos) {
          scanned_ = held_.size() - 16;  // a cut depends on the few bytes around it: look again there once more comes
          break;
        }
        emit_piece(cut, false);
      }
    }
    if (!ends) return;
    if (!dropping_) {
      if (mode_ == Mode::document || started_) {
        emit_piece(held_.size(), true);
      } else {  // a long line of JSON or of a tokenizer that cannot cut: one unit of its own
        batch_line_ = document_line_;
        batch_ = std::move(held_);
        flush_lines();
      }
    }
    start_document(line_ + 1);
  }

  void emit_piece(size_t end, bool last) {
    Unit u;
    u.kind = Unit::Kind::piece;
    u.text = held_.substr(0, end);
    u.line = document_line_;
    u.first = !started_;
    u.last = last;
    held_.erase(0, end);
    scanned_ = 0;
    started_ = true;
    emit_(std::move(u));
  }

  void drop() {
    const std::string limit = std::to_string(max_document_ >> 20) + " MiB";
    Unit u;
    u.kind = Unit::Kind::skip;
    u.line = document_line_;
    u.aborts_document = started_;
    if (mode_ == Mode::json_lines) {
      u.why = "a JSON line longer than " + limit + ", the most held whole to parse";
    } else if (!tokenizer_.can_cut()) {
      u.why = "a document longer than " + limit + ", the most held whole, and this tokenizer cannot cut a document into pieces (docs/tokenizers.md)";
    } else {
      u.why = "a document with no place to cut it into pieces (a line break before a letter, or a space between letters) in " + limit + ", the most held whole";
    }
    held_.clear();
    held_.shrink_to_fit();
    dropping_ = true;
    emit_(std::move(u));
  }

  const Mode mode_;
  const Tokenizer& tokenizer_;
  const size_t max_document_;
  const std::function<void(Unit&&)> emit_;
  // Lines
  std::string batch_;    // whole lines for the next unit
  int batch_line_ = 1;   // the line of batch_[0]
  std::string partial_;  // the start of a short line whose end has not come yet
  int line_ = 1;         // the line being read
  bool long_line_ = false;
  // The document (or long line) being cut
  std::string held_;
  int document_line_ = 1;
  bool started_ = false;   // some of its pieces went out
  bool dropping_ = false;  // skipped: the rest is read past
  size_t scanned_ = 0;     // held_ before this has no safe cut past kUnitBytes
};

// A plain file's byte range, read a block at a time; checked unchanged after its last block.
class RangeReader {
 public:
  RangeReader(const InputFile& f, int64_t begin, int64_t end) : f_(f), begin_(begin), at_(begin), end_(end) {
    fd_ = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw input_error(f.path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
  }
  ~RangeReader() { ::close(fd_); }
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;

  // The next block into `out` (replaced); false at the end of the range.
  bool read(std::string& out) {
    if (at_ >= end_) {
      if (at_ == begin_) check_unchanged(f_, fd_);  // an empty range is read too
      return false;
    }
    out.resize(static_cast<size_t>(std::min<int64_t>(end_ - at_, static_cast<int64_t>(kUnitBytes))));
    for (size_t done = 0; done < out.size();) {
      const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, at_ + static_cast<int64_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        check_unchanged(f_, fd_);  // a file that shrank: say that it changed
        throw input_error(f_.path, 0, n < 0 ? std::string("cannot read: ") + std::strerror(err) : "the file shrank while being read", "check the file");
      }
      done += static_cast<size_t>(n);
    }
    at_ += static_cast<int64_t>(out.size());
    if (at_ >= end_) check_unchanged(f_, fd_);
    return true;
  }

 private:
  const InputFile& f_;
  const int64_t begin_;
  int64_t at_, end_;
  int fd_ = -1;
};

class Preparer {
 public:
  Preparer(const PrepareOptions& o, std::vector<InputFile> files) : o_(o), files_(std::move(files)) {
    tokenizer_ = open_tokenizer(o.tokenizer);
    tokenizer_path_ = tokenizer_file(o.tokenizer);
    const std::string bytes = read_file(tokenizer_path_);
    tokenizer_hash_ = "xxh3:" + hex64(XXH3_64bits(bytes.data(), bytes.size()));
    token_bytes_ = tokenizer_->vocab_size() <= 65536 ? 2 : 4;
    // Documents are marked as the post-processor says (BOS and/or EOS); if it adds nothing, EOS.
    tokenizer_->document_marks(before_, after_);
    marks_from_post_processor_ = !before_.empty() || !after_.empty();
    if (!marks_from_post_processor_) {
      if (!tokenizer_->eos()) {
        ErrorContext c;
        c.file = tokenizer_path_;
        c.hint = "use a tokenizer whose tokenizer_config.json names an eos_token";
        throw Error("the tokenizer marks no document boundary: no BOS/EOS from its post-processor and no EOS token", c);
      }
      after_ = {*tokenizer_->eos()};
    }
  }

  json identity(const Chunk& chunk) const {
    json pieces = json::array();
    for (const Piece& p : chunk.pieces) {
      const InputFile& f = files_[p.file];
      pieces.push_back({{"file", f.path}, {"size", f.size}, {"mtime_ns", f.mtime_ns}, {"begin", p.begin}, {"end", p.end}});
    }
    return {{"pieces", pieces}, {"tokenizer", tokenizer_hash_}, {"field", o_.field}, {"line_documents", o_.line_documents},
            {"token_bytes", token_bytes_}};
  }

  json end_of_document() const {
    if (!marks_from_post_processor_) return {{"eos", after_.front()}};
    return {{"post_processor", tokenizer_->encode("", true)}};
  }

  // The record of shard k when it holds this chunk's shard whole (finished by an earlier prepare).
  std::optional<json> finished_record(size_t k, const json& id) const {
    const std::string base = path_join(o_.out, shard_name(k));
    if (!file_exists(base + ".json")) return std::nullopt;
    try {
      json done = json::parse(read_file(base + ".json"));
      // --strict is not in the identity: a shard that skipped lines is made again, to fail.
      if (done.value("identity", json()) == id && file_size(base + ".tokens") == done.value("tokens_file_bytes", int64_t(-1)) &&
          file_size(base + ".docs") == done.value("docs_file_bytes", int64_t(-1)) && !(o_.strict && done.value("skipped_lines", 0) > 0)) {
        return done;
      }
    } catch (const json::exception&) {
      // An unreadable record is not a finished shard: it is written again.
    }
    return std::nullopt;
  }

  static ShardResult reused(const json& done) {
    ShardResult r;
    r.record = done;
    r.documents = done.value("documents", int64_t(0));
    r.tokens = done.value("tokens", int64_t(0));
    r.bytes = done.value("input_bytes", int64_t(0));
    r.skipped = done.value("skipped_lines", int64_t(0));
    if (done.contains("skipped_examples")) r.skipped_examples = done["skipped_examples"].get<std::vector<std::string>>();
    r.reused = true;
    return r;
  }

  // Where a streamed chunk starting as `chunk` does (its last piece's begin) ended when an earlier
  // prepare finished its shard k, if it matches in everything else; -1 if none.
  int64_t recorded_end(size_t k, Chunk chunk) const {
    const std::string path = path_join(o_.out, shard_name(k) + ".json");
    if (!file_exists(path)) return -1;
    try {
      const json done = json::parse(read_file(path));
      const json& pieces = done.at("identity").at("pieces");
      if (pieces.size() != 1) return -1;
      chunk.pieces.back().end = pieces[0].at("end").get<int64_t>();
      if (finished_record(k, identity(chunk))) return chunk.pieces.back().end;
    } catch (const json::exception&) {
      // Not a record of this chunk.
    }
    return -1;
  }

  Splitter::Mode mode_of(const InputFile& f) const {
    if (f.json_lines) return Splitter::Mode::json_lines;
    return o_.line_documents ? Splitter::Mode::lines : Splitter::Mode::document;
  }

  // A unit's ids. A document the tokenizer cannot take (a regex past its work budget) is skipped and
  // counted like a bad line, or with --strict fails the prepare.
  UnitIds tokenize(const Unit& u) const {
    UnitIds r;
    r.kind = u.kind;
    r.first = u.first;
    r.last = u.last;
    r.aborts_document = u.aborts_document;
    const Piece& p = u.shard->piece(u.piece);
    const InputFile& f = files_[p.file];
    // "file:line: why" for a skipped line or document; with --strict, the error.
    const auto report = [&](int relative_line, const std::string& why, const char* strict_hint) {
      const int at = u.shard->absolute_line(u.piece, relative_line, f.path);
      if (o_.strict) throw input_error(f.path, at, why, strict_hint);
      r.examples.push_back(f.path + ":" + std::to_string(at) + ": " + why);
    };
    const char* const refused_hint = "drop --strict to skip and count such documents, or change the tokenizer's pattern";
    switch (u.kind) {
      case Unit::Kind::skip:
        report(u.line, u.why, "split the document, or drop --strict to skip and count such documents");
        return r;
      case Unit::Kind::piece:
        try {
          if (u.first && u.last) {
            tokenizer_->encode_in_pieces(u.text, marks_from_post_processor_, r.ids);
            if (!marks_from_post_processor_) r.ids.insert(r.ids.end(), after_.begin(), after_.end());
          } else {
            if (u.first) r.ids = before_;
            tokenizer_->encode_in_pieces(u.text, false, r.ids);
            if (u.last) r.ids.insert(r.ids.end(), after_.begin(), after_.end());
          }
        } catch (const TokenizerRegexError& e) {
          r.ids.clear();
          r.refused = true;
          report(u.line, excerpt(e.what()), refused_hint);
        }
        return r;
      case Unit::Kind::lines:
        break;
    }
    int line = u.line;
    std::vector<uint32_t> ids;
    for (size_t start = 0; start < u.text.size(); ++line) {
      size_t end = u.text.find('\n', start);
      if (end == std::string::npos) end = u.text.size();
      const std::string_view text(u.text.data() + start, end - start);
      start = end + 1;
      const auto add_document = [&](std::string_view document) -> std::string {
        ids.clear();
        try {
          tokenizer_->encode_in_pieces(document, marks_from_post_processor_, ids);
        } catch (const TokenizerRegexError& e) {
          return excerpt(e.what());
        }
        if (!marks_from_post_processor_) ids.insert(ids.end(), after_.begin(), after_.end());
        r.ids.insert(r.ids.end(), ids.begin(), ids.end());
        r.ends.push_back(r.ids.size());
        return "";
      };
      std::string why;
      if (!f.json_lines) {
        why = add_document(text);
      } else if (!text.empty() && text.find_first_not_of(" \t\r") != std::string_view::npos) {
        try {
          const json doc = json::parse(text);
          if (!doc.is_object() || !doc.contains(o_.field)) why = "no field \"" + o_.field + "\"";
          else if (!doc[o_.field].is_string()) why = "field \"" + o_.field + "\" is not a string";
          else why = add_document(doc[o_.field].get_ref<const std::string&>());
        } catch (const json::parse_error& e) {
          why = excerpt(std::string("not JSON: ") + e.what());  // the parser quotes the whole bad token, maybe megabytes
        } catch (const json::out_of_range& e) {  // a number past double's range (1e999): one bad line, not the whole prepare
          why = excerpt(std::string("a number JSON cannot hold: ") + e.what());
        }
      }
      if (!why.empty()) {
        ++r.skipped;
        if (r.examples.size() < 5 || o_.strict) report(line, why, "fix the line, or drop --strict to skip and count such lines");
      }
    }
    return r;
  }

  const PrepareOptions& o_;
  std::vector<InputFile> files_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string tokenizer_path_, tokenizer_hash_;
  int token_bytes_ = 4;
  bool marks_from_post_processor_ = false;
  std::vector<uint32_t> before_, after_;  // around each document: the post-processor's marks, or EOS after
};

// Thrown in the producer when a worker has failed: its error is the one reported.
struct Stopped {};

// One producer walks the inputs in order, cuts each chunk's text into units (decompressing as it
// goes) and numbers the shards; every thread tokenizes units, whichever shard they belong to, and
// appends them to their shard, which the thread that appends its last unit finishes. At most
// 2 x threads + 2 units are out at once (queued, being tokenized, or waiting for the units ahead of
// them), so memory is bounded by units, not by the size of any file or document.
class Pipeline {
 public:
  Pipeline(const PrepareOptions& o, Preparer& preparer, int threads, int64_t total_bytes, const PrepareProgress& progress)
      : o_(o), preparer_(preparer), threads_(threads), total_bytes_(total_bytes), progress_(progress),
        max_out_(2 * static_cast<size_t>(threads) + 2) {}

  std::vector<ShardResult> run(const std::vector<PlannedChunk>& planned) {
    std::thread producer([&] { produce(planned); });
    std::vector<std::thread> pool;
    for (int t = 0; t < threads_; ++t) pool.emplace_back([this] { work(); });
    for (;;) {
      int done, known;
      int64_t bytes;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (failed_ || (produced_all_ && done_ == known_)) break;
        done = done_;
        known = known_;
        bytes = bytes_done_;
      }
      if (progress_) progress_(done, known, bytes, total_bytes_);
      std::unique_lock<std::mutex> lock(mutex_);  // a report every 200 ms, and none waited for once all is done
      changed_.wait_for(lock, std::chrono::milliseconds(200), [&] { return failed_ || (produced_all_ && done_ == known_); });
    }
    producer.join();
    for (auto& t : pool) t.join();
    queue_.clear();
    builder_.reset();  // an unfinished shard's temporary file goes with its last owner
    if (error_) std::rethrow_exception(error_);
    std::vector<ShardResult> out;
    for (auto& [k, r] : results_) out.push_back(std::move(r));
    return out;
  }

 private:
  void fail_with(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = e;
    failed_ = true;
    changed_.notify_all();
  }

  void shard_done(size_t k, ShardResult r) {
    std::lock_guard<std::mutex> lock(mutex_);
    results_[k] = std::move(r);
    ++done_;
    changed_.notify_all();
  }

  // A new shard k is under way (or kept from an earlier prepare).
  void announce_shard() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++known_;
  }

  void add_progress(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_done_ += bytes;
  }

  // To the queue, as unit `next_index_` of the current shard; waits while max_out_ units are out.
  void emit(Unit&& u) {
    u.shard = builder_;
    u.index = next_index_++;
    u.piece = piece_;
    u.progress = pending_progress_;
    pending_progress_ = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return out_ < max_out_ || failed_; });
    if (failed_) throw Stopped{};
    queue_.push_back(std::move(u));
    ++out_;
    changed_.notify_all();
  }

  void start_shard(size_t k, const Chunk& chunk) {
    builder_ = std::make_shared<ShardBuilder>(o_.out, k, chunk, preparer_.token_bytes_, preparer_.tokenizer_->vocab_size());
    next_index_ = 0;
    text_bytes_ = 0;
  }

  void close_shard(size_t k, int64_t end) {
    std::shared_ptr<ShardBuilder> builder = std::move(builder_);
    add_progress(pending_progress_);
    pending_progress_ = 0;
    if (builder->close(next_index_, end, text_bytes_)) shard_done(k, builder->finish(preparer_.identity(builder->chunk())));
  }

  // Text for the current shard's splitter.
  void feed(Splitter& splitter, std::string_view text) {
    text_bytes_ += static_cast<int64_t>(text.size());
    splitter.feed(text);
  }

  void produce(const std::vector<PlannedChunk>& planned) {
    try {
      size_t k = 0;
      for (const PlannedChunk& p : planned) {
        if (p.stream_file < 0) produce_chunk(k++, p.chunk);
        else produce_stream(static_cast<size_t>(p.stream_file), k);
      }
    } catch (const Stopped&) {
      // A worker failed; its error is reported.
    } catch (const std::bad_alloc&) {
      fail_with(std::make_exception_ptr(input_error(reading_, 0, "out of memory while reading this file", "prepare with fewer --threads, or on a machine with more memory")));
    } catch (...) {
      fail_with(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    produced_all_ = true;
    changed_.notify_all();
  }

  // A chunk whose pieces are known before reading: byte ranges of plain files, whole compressed files.
  void produce_chunk(size_t k, const Chunk& chunk) {
    announce_shard();
    if (const auto done = preparer_.finished_record(k, preparer_.identity(chunk))) {
      add_progress(chunk.bytes);
      shard_done(k, Preparer::reused(*done));
      return;
    }
    start_shard(k, chunk);
    for (piece_ = 0; piece_ < chunk.pieces.size(); ++piece_) {
      const Piece& p = chunk.pieces[piece_];
      const InputFile& f = preparer_.files_[p.file];
      reading_ = f.path;
      Splitter splitter(preparer_.mode_of(f), *preparer_.tokenizer_, static_cast<size_t>(o_.max_document_bytes), [this](Unit&& u) { emit(std::move(u)); });
      std::string block;
      if (f.compression == Compression::none) {
        RangeReader reader(f, p.begin, p.end);
        while (!splitter.skipping_document() && reader.read(block)) {
          pending_progress_ += static_cast<int64_t>(block.size());
          feed(splitter, block);
        }
      } else {  // a compressed text read as one document, streamed
        Decompressor d(f);
        int64_t consumed = 0;
        for (bool more = true; more && !splitter.skipping_document();) {
          block.clear();
          more = d.read(block);
          const int64_t now = more ? d.consumed() : f.size;
          pending_progress_ += now - consumed;
          consumed = now;
          feed(splitter, block);
        }
        pending_progress_ += f.size - consumed;  // the rest of a skipped document, not read
      }
      splitter.finish();
    }
    close_shard(k, chunk.pieces.back().end);
  }

  // A compressed file of lines, cut into chunks as it is decompressed: a chunk ends at the first
  // line end at or after --shard-mb of text (as plain files are cut), so its end is known only once
  // read. A chunk an earlier prepare finished (its record names this start) is read past and kept.
  void produce_stream(size_t i, size_t& k) {
    const InputFile& f = preparer_.files_[i];
    reading_ = f.path;
    Decompressor d(f);
    std::string block;
    size_t at = 0;
    bool more = true;
    int64_t consumed = 0;
    // The unread text in block[at..], read on when it is all used; false at the end of the file.
    const auto fill = [&] {
      while (at == block.size() && more) {
        block.clear();
        at = 0;
        more = d.read(block);
        const int64_t now = more ? d.consumed() : f.size;
        pending_progress_ += now - consumed;
        consumed = now;
      }
      return at < block.size();
    };
    int64_t begin = 0;
    int line = 1;
    while (fill()) {
      Chunk chunk{{{i, begin, begin, line}}, 0};
      announce_shard();
      const int64_t recorded = preparer_.recorded_end(k, chunk);
      std::unique_ptr<Splitter> splitter;
      piece_ = 0;
      if (recorded < 0) {
        start_shard(k, chunk);
        splitter = std::make_unique<Splitter>(preparer_.mode_of(f), *preparer_.tokenizer_, static_cast<size_t>(o_.max_document_bytes), [this](Unit&& u) { emit(std::move(u)); });
      }
      int64_t taken = 0;
      int lines = 0;
      while (fill()) {
        std::string_view rest(block.data() + at, block.size() - at);
        size_t n = rest.size();
        bool chunk_ends = false;
        if (taken + static_cast<int64_t>(n) > o_.shard_bytes) {
          const size_t from = static_cast<size_t>(std::max<int64_t>(0, o_.shard_bytes - taken));
          const size_t newline = rest.find('\n', from);
          if (newline != std::string_view::npos) {
            n = newline + 1;
            chunk_ends = true;
          }
        }
        const std::string_view part = rest.substr(0, n);
        lines += static_cast<int>(std::count(part.begin(), part.end(), '\n'));
        if (splitter) feed(*splitter, part);
        taken += static_cast<int64_t>(n);
        at += n;
        if (chunk_ends) break;
      }
      const int64_t end = begin + taken;
      if (splitter) {
        splitter->finish();
        close_shard(k, end);
      } else {
        chunk.pieces[0].end = end;
        const auto done = recorded == end ? preparer_.finished_record(k, preparer_.identity(chunk)) : std::nullopt;
        if (!done) {  // the record named another end: the text changed after all; read the chunk again
          start_shard(k, chunk);
          Splitter again(preparer_.mode_of(f), *preparer_.tokenizer_, static_cast<size_t>(o_.max_document_bytes), [this](Unit&& u) { emit(std::move(u)); });
          reread(f, begin, taken, again);
          again.finish();
          close_shard(k, end);
        } else {
          add_progress(pending_progress_);
          pending_progress_ = 0;
          shard_done(k, Preparer::reused(*done));
        }
      }
      begin = end;
      line += lines;
      ++k;
    }
  }

  // Text [begin, begin + size) of a compressed file, decompressed from its start again, to `splitter`.
  void reread(const InputFile& f, int64_t begin, int64_t size, Splitter& splitter) {
    Decompressor d(f);
    std::string block;
    int64_t at = 0;
    for (bool more = true; more && at < begin + size;) {
      block.clear();
      more = d.read(block);
      const int64_t from = std::max<int64_t>(at, begin), to = std::min<int64_t>(at + static_cast<int64_t>(block.size()), begin + size);
      if (to > from) feed(splitter, std::string_view(block).substr(static_cast<size_t>(from - at), static_cast<size_t>(to - from)));
      at += static_cast<int64_t>(block.size());
    }
  }

  void work() {
    for (;;) {
      Unit u;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return !queue_.empty() || produced_all_ || failed_; });
        if (failed_ || queue_.empty()) return;
        u = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        UnitIds ids;
        try {
          ids = preparer_.tokenize(u);
        } catch (const std::bad_alloc&) {
          const std::string& path = preparer_.files_[u.shard->piece(u.piece).file].path;
          throw input_error(path, u.shard->absolute_line(u.piece, u.line, path), "out of memory tokenizing " + std::to_string(u.text.size()) + " bytes of text from this line",
                            "prepare with fewer --threads, or on a machine with more memory");
        }
        const auto [appended, complete] = u.shard->deliver(u.index, std::move(ids));
        {
          std::lock_guard<std::mutex> lock(mutex_);
          out_ -= appended;
          bytes_done_ += u.progress;
          changed_.notify_all();
        }
        if (complete) {
          shard_done(u.shard->number(), u.shard->finish(preparer_.identity(u.shard->chunk())));
        }
      } catch (const std::bad_alloc&) {
        fail_with(std::make_exception_ptr(input_error(o_.out, 0, "out of memory writing a shard", "prepare with fewer --threads, or on a machine with more memory")));
        return;
      } catch (...) {
        fail_with(std::current_exception());
        return;
      }
    }
  }

  const PrepareOptions& o_;
  Preparer& preparer_;
  const int threads_;
  const int64_t total_bytes_;
  const PrepareProgress& progress_;
  const size_t max_out_;

  std::mutex mutex_;  // everything below it, but the producer's own state
  std::condition_variable changed_;
  std::deque<Unit> queue_;
  size_t out_ = 0;  // units queued, being tokenized, or waiting for the units ahead of them
  bool produced_all_ = false, failed_ = false;
  std::exception_ptr error_;
  std::map<size_t, ShardResult> results_;
  int done_ = 0, known_ = 0;
  int64_t bytes_done_ = 0;

  // The producer's
  std::shared_ptr<ShardBuilder> builder_;  // of the shard being cut
  size_t next_index_ = 0, piece_ = 0;
  int64_t pending_progress_ = 0;  // input bytes read since the last unit went out
  int64_t text_bytes_ = 0;        // text of the shard being cut
  std::string reading_;           // the file being read, for an out-of-memory error
};

// The lock of an output directory, held (flock) from before the old manifest is deleted until the
// new one is written; the kernel drops it when the process ends, however it ends. The file stays
// (removing it would let a second prepare lock a file the first no longer sees); it holds the pid.
class OutputLock {
 public:
  explicit OutputLock(const std::string& dir) {
    const std::string path = path_join(dir, kPrepareLockName);
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw input_error(path, 0, std::string("cannot create the lock file: ") + std::strerror(errno), "check that the output directory is writable");
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char text[32] = {};
      const ssize_t n = ::pread(fd_, text, sizeof text - 1, 0);
      const long long pid = n > 0 ? std::atoll(text) : 0;
      ::close(fd_);
      if (err == EWOULDBLOCK) {
        ErrorContext c;
        c.file = dir;
        c.hint = "wait for it to finish (or stop it), or write to another directory with -o";
        throw Error("another dsrun prepare" + (pid > 0 ? " (pid " + std::to_string(pid) + ")" : std::string()) + " is writing to this directory", c);
      }
      throw input_error(path, 0, std::string("cannot lock: ") + std::strerror(err), "put the output directory on a file system that supports flock");
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
      // The lock holds without the pid; a second prepare is refused all the same, without it.
    }
  }
  ~OutputLock() { ::close(fd_); }
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

 private:
  int fd_ = -1;
};

// Files an earlier prepare left that this one's manifest does not list: shards numbered `shards`
// and above (the earlier corpus was larger), and temporary files of a killed prepare. Under the
// lock, so no other prepare is writing them.
int remove_stale_files(const std::string& dir, size_t shards) {
  int removed = 0;
  for (const std::string& name : list_directory(dir)) {
    bool temporary = false;
    const int64_t k = shard_number(name, &temporary);
    const bool manifest_tmp = name.rfind("manifest.json.tmp.", 0) == 0;
    if (!manifest_tmp && (k < 0 || (!temporary && static_cast<size_t>(k) < shards))) continue;
    const std::string path = path_join(dir, name);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      throw input_error(path, 0, std::string("cannot remove a stale file of an earlier prepare: ") + std::strerror(errno), "remove it by hand, or write to a new directory");
    ++removed;
  }
  return removed;
}

PrepareSummary prepare(const PrepareOptions& o, const PrepareProgress& progress) {
  if (o.inputs.empty()) throw input_error("", 0, "no inputs", "name text, .jsonl, .gz or .zst files or directories");
  // An empty -o would put the lock, shards and manifest into the current directory.
  if (o.out.find_first_not_of(" \t") == std::string::npos) throw input_error(o.out, 0, "no output directory (-o is empty)", "name a directory for the shards: -o corpus/");
  OutputDirectory output;
  struct stat out_st {};
  if (::stat(o.out.c_str(), &out_st) == 0 && S_ISDIR(out_st.st_mode)) output = {true, out_st.st_dev, out_st.st_ino};
  std::vector<std::string> paths, skipped_directories;
  for (const std::string& in : o.inputs) collect(in, paths, output, true, skipped_directories);
  {  // A file named twice (or inside two named directories) is read once.
    std::set<std::pair<dev_t, ino_t>> seen;
    std::vector<std::string> once;
    for (const std::string& p : paths) {
      struct stat st {};
      if (::stat(p.c_str(), &st) == 0 && !seen.insert({st.st_dev, st.st_ino}).second) {
        skipped_directories.push_back(p + ": named more than once, read once");
        continue;
      }
      once.push_back(p);
    }
    paths = std::move(once);
  }
  if (paths.empty()) throw input_error(o.inputs.front(), 0, "no input files", "name text, .jsonl, .gz or .zst files or directories");
  std::vector<InputFile> files;
  int64_t total_bytes = 0;
  for (const std::string& p : paths) {
    files.push_back(describe_input(p));
    total_bytes += files.back().size;
  }
  const std::vector<PlannedChunk> planned = make_chunks(files, o);
  make_directories(o.out);
  const OutputLock lock(o.out);  // a second prepare into this directory is refused until this one ends
  const std::string manifest_path = path_join(o.out, "manifest.json");
  if (file_exists(manifest_path)) ::unlink(manifest_path.c_str());  // re-preparing: not finished until written again

  Preparer preparer(o, std::move(files));
  const int threads = std::max(1, o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency()));
  Pipeline pipeline(o, preparer, threads, total_bytes, progress);
  const std::vector<ShardResult> results = pipeline.run(planned);
  const size_t n = results.size();
  if (progress) progress(static_cast<int>(n), static_cast<int>(n), total_bytes, total_bytes);

  PrepareSummary s;
  s.shards = static_cast<int>(n);
  s.token_bytes = preparer.token_bytes_;
  s.threads = threads;
  s.skipped_directories = std::move(skipped_directories);
  s.stale_files_removed = remove_stale_files(o.out, n);
  json shards = json::array();
  for (const ShardResult& r : results) {
    s.documents += r.documents;
    s.tokens += r.tokens;
    s.input_bytes += r.bytes;
    s.skipped_lines += r.skipped;
    s.shards_reused += r.reused ? 1 : 0;
    s.cut_documents += r.cut_documents;
    s.cut_pieces += r.cut_pieces;
    for (const auto& e : r.skipped_examples) if (s.skipped_examples.size() < 5) s.skipped_examples.push_back(e);
    json entry = r.record;
    entry.erase("identity");
    entry.erase("skipped_examples");  // in the shard records only, for a prepare that keeps the shard
    shards.push_back(entry);
  }
  const json manifest = {{"format", "dsrun-tokens"},
                         {"version", 1},
                         {"tokenizer", {{"file", preparer.tokenizer_path_}, {"checksum", preparer.tokenizer_hash_},
                                        {"vocab_size", preparer.tokenizer_->vocab_size()}, {"describe", preparer.tokenizer_->describe()}}},
                         {"end_of_document", preparer.end_of_document()},
                         {"token_bytes", s.token_bytes},
                         {"documents", s.documents},
                         {"tokens", s.tokens},
                         {"input_bytes", s.input_bytes},
                         {"skipped_lines", s.skipped_lines},
                         {"shards", shards}};
  write_file_atomic(manifest_path, manifest.dump(1, ' ', false, json::error_handler_t::replace) + "\n");  // (file names need not be UTF-8)
  return s;
}

}  // namespace

PrepareSummary prepare_corpus(const PrepareOptions& o, const PrepareProgress& progress) {
  try {
    return prepare(o, progress);
  } catch (const std::bad_alloc&) {  // where no nearer handler named the file (loading the tokenizer, listing inputs)
    throw input_error(o.out, 0, "out of memory while preparing this corpus", "prepare with fewer --threads, or on a machine with more memory");
  }
}

}  // namespace dsrun
