// `dsrun prepare` (see prepare.hpp). The input is cut into chunks (byte ranges at line ends, or
// whole files) before any tokenizing, so shard k is a pure function of chunk k and the tokenizer:
// that is what lets a killed prepare keep the shards it finished. Each shard is three files
// written atomically in order (.tokens, .docs, then .json, the mark of a finished shard); the
// manifest is written last, so a directory without one is never taken as a finished corpus. One
// prepare at a time writes to a directory (flock on its lock file); an input file that changes
// while it is read is an error, not a corpus of old and new text.
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
#include <atomic>
#include <map>
#include <deque>
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

std::string decompress(const InputFile& f) {
  Decompressor d(f);
  std::string out;
  while (d.read(out)) {
  }
  return out;
}

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

// The 1-based line number at byte `offset` of a plain file (read only when a line is reported).
int line_at(const std::string& path, int64_t offset) {
  if (offset == 0) return 1;
  const std::string before = read_range(path, 0, offset);
  return static_cast<int>(std::count(before.begin(), before.end(), '\n')) + 1;
}

class Preparer {
 public:
  Preparer(const PrepareOptions& o, std::vector<InputFile> files) : o_(o), files_(std::move(files)) {
    tokenizer_ = open_tokenizer(o.tokenizer);
    tokenizer_path_ = tokenizer_file(o.tokenizer);
    const std::string bytes = read_file(tokenizer_path_);
    tokenizer_hash_ = "xxh3:" + hex64(XXH3_64bits(bytes.data(), bytes.size()));
    token_bytes_ = tokenizer_->vocab_size() <= 65536 ? 2 : 4;
    // Documents are marked as the post-processor says (BOS and/or EOS); if it adds nothing, EOS.
    marks_from_post_processor_ = !tokenizer_->encode("", true).empty();
    if (!marks_from_post_processor_) {
      if (!tokenizer_->eos()) {
        ErrorContext c;
        c.file = tokenizer_path_;
        c.hint = "use a tokenizer whose tokenizer_config.json names an eos_token";
        throw Error("the tokenizer marks no document boundary: no BOS/EOS from its post-processor and no EOS token", c);
      }
      eos_ = *tokenizer_->eos();
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
    if (!marks_from_post_processor_) return {{"eos", eos_}};
    return {{"post_processor", tokenizer_->encode("", true)}};
  }

  // Shard k from its chunk; `text`: the chunk's text when the producer already has it (streamed).
  ShardResult run_shard(size_t k, const Chunk& chunk, const std::string* streamed) const {
    const std::string base = path_join(o_.out, shard_name(k));
    const json id = identity(chunk);
    ShardResult r;
    if (file_exists(base + ".json")) {  // finished before: reuse if it is this chunk's shard, whole
      try {
        json done = json::parse(read_file(base + ".json"));
        // --strict is not in the identity: a shard that skipped lines is made again, to fail.
        if (done.value("identity", json()) == id && file_size(base + ".tokens") == done.value("tokens_file_bytes", int64_t(-1)) &&
            file_size(base + ".docs") == done.value("docs_file_bytes", int64_t(-1)) && !(o_.strict && done.value("skipped_lines", 0) > 0)) {
          r.record = done;
          r.documents = done["documents"];
          r.tokens = done["tokens"];
          r.bytes = done["input_bytes"];
          r.skipped = done["skipped_lines"];
          if (done.contains("skipped_examples")) r.skipped_examples = done["skipped_examples"].get<std::vector<std::string>>();
          r.reused = true;
          return r;
        }
      } catch (const json::exception&) {
        // An unreadable record is not a finished shard: it is written again below.
      }
    }
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> ends;
    std::vector<uint32_t> ids;
    // A document the tokenizer cannot take (a regex past its work budget) is skipped and counted
    // like a bad line, or with --strict fails the prepare: why it was skipped, or "".
    const auto add_document = [&](std::string_view text) -> std::string {
      ids.clear();
      try {
        tokenizer_->encode(text, marks_from_post_processor_, ids);
      } catch (const TokenizerRegexError& e) {
        return excerpt(e.what());
      }
      if (!marks_from_post_processor_) ids.push_back(eos_);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
      ends.push_back(tokens.size());
      return "";
    };
    for (const Piece& p : chunk.pieces) {
      const InputFile& f = files_[p.file];
      std::string read;
      if (!streamed) read = f.compression == Compression::none ? read_range(f.path, p.begin, p.end, &f) : decompress(f);
      const std::string& text = streamed ? *streamed : read;
      r.bytes += static_cast<int64_t>(text.size());
      int first_line = 0;  // counted only when a line is reported
      if (!f.json_lines && !o_.line_documents) {
        if (const std::string why = add_document(text); !why.empty()) {
          const int at = p.first_line > 0 ? p.first_line : line_at(f.path, p.begin);
          if (o_.strict) throw input_error(f.path, at, why, "drop --strict to skip and count such documents, or change the tokenizer's pattern");
          ++r.skipped;
          if (r.skipped_examples.size() < 5) r.skipped_examples.push_back(f.path + ":" + std::to_string(at) + ": " + why);
        }
        continue;
      }
      size_t start = 0;
      while (start < text.size()) {
        size_t end = text.find('\n', start);
        if (end == std::string::npos) end = text.size();
        std::string_view line(text.data() + start, end - start);
        std::string why;
        if (!f.json_lines) {
          why = add_document(line);
        } else if (!line.empty() && line.find_first_not_of(" \t\r") != std::string_view::npos) {
          try {
            const json doc = json::parse(line);
            if (!doc.is_object() || !doc.contains(o_.field)) why = "no field \"" + o_.field + "\"";
            else if (!doc[o_.field].is_string()) why = "field \"" + o_.field + "\" is not a string";
            else why = add_document(doc[o_.field].get_ref<const std::string&>());
          } catch (const json::parse_error& e) {
            why = excerpt(std::string("not JSON: ") + e.what());  // the parser quotes the whole bad token, maybe megabytes
          }
        }
        {
          if (!why.empty()) {
            if (first_line == 0) first_line = p.first_line > 0 ? p.first_line : line_at(f.path, p.begin);
            const int at = first_line + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<long>(start), '\n'));
            if (o_.strict) throw input_error(f.path, at, why, "fix the line, or drop --strict to skip and count such lines");
            ++r.skipped;
            if (r.skipped_examples.size() < 5) r.skipped_examples.push_back(f.path + ":" + std::to_string(at) + ": " + why);
          }
        }
        start = end + 1;
      }
    }
    for (uint32_t t : tokens) {
      if (t >= tokenizer_->vocab_size()) {
        throw input_error(base + ".tokens", 0, "token " + std::to_string(t) + " is outside the vocabulary", "report it: the tokenizer produced it");
      }
    }
    // .tokens (the DSRUNTOK format), .docs, then the record that marks the shard finished.
    const std::string body = token_shard_bytes(tokens, token_bytes_);
    const std::string docs = document_index_bytes(ends);
    write_file_atomic(base + ".tokens", body);
    write_file_atomic(base + ".docs", docs);
    r.documents = static_cast<int64_t>(ends.size());
    r.tokens = static_cast<int64_t>(tokens.size());
    r.record = {{"identity", id},
                {"documents", r.documents},
                {"tokens", r.tokens},
                {"input_bytes", r.bytes},
                {"skipped_lines", r.skipped},
                {"tokens_file", shard_name(k) + ".tokens"},
                {"tokens_file_bytes", static_cast<int64_t>(body.size())},
                {"tokens_xxh3", hex64(XXH3_64bits(body.data(), body.size()))},
                {"docs_file", shard_name(k) + ".docs"},
                {"docs_file_bytes", static_cast<int64_t>(docs.size())},
                {"docs_xxh3", hex64(XXH3_64bits(docs.data(), docs.size()))}};
    if (!r.skipped_examples.empty()) r.record["skipped_examples"] = r.skipped_examples;  // for a prepare that keeps this shard
    write_file_atomic(base + ".json", r.record.dump(1) + "\n");
    return r;
  }

  const PrepareOptions& o_;
  std::vector<InputFile> files_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string tokenizer_path_, tokenizer_hash_;
  int token_bytes_ = 4;
  bool marks_from_post_processor_ = false;
  uint32_t eos_ = 0;
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

}  // namespace

PrepareSummary prepare_corpus(const PrepareOptions& o, const PrepareProgress& progress) {
  if (o.inputs.empty()) throw input_error("", 0, "no inputs", "name text, .jsonl, .gz or .zst files or directories");
  OutputDirectory output;
  struct stat out_st {};
  if (::stat(o.out.c_str(), &out_st) == 0 && S_ISDIR(out_st.st_mode)) output = {true, out_st.st_dev, out_st.st_ino};
  std::vector<std::string> paths, skipped_directories;
  for (const std::string& in : o.inputs) collect(in, paths, output, true, skipped_directories);
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

  // One producer walks the inputs in order and numbers the chunks (decompressing streamed files as
  // it goes); workers tokenize them. One chunk waits in the queue at most, so memory is bounded
  // by the chunks in flight, not by the size of any file.
  struct Job {
    size_t k;
    Chunk chunk;
    std::shared_ptr<const std::string> text;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Job> queue;
  bool produced_all = false;
  std::map<size_t, ShardResult> results;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::atomic<int> done{0}, known{0};
  std::atomic<int64_t> bytes_done{0};
  const auto push = [&](Job job) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return queue.empty() || failed; });  // one chunk waiting is enough: decompressing outruns tokenizing
    if (failed) throw std::runtime_error("stopped");  // a worker failed; its error is the one reported
    queue.push_back(std::move(job));
    ++known;
    changed.notify_all();
  };
  const auto fail_with = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error) error = e;
    failed = true;
    changed.notify_all();
  };
  const auto produce = [&] {
    try {
      size_t k = 0;
      for (const PlannedChunk& p : planned) {
        if (p.stream_file < 0) {
          push({k++, p.chunk, nullptr});
          continue;
        }
        // Cut as plain files are cut: at the first line start at or after shard_bytes.
        const size_t i = static_cast<size_t>(p.stream_file);
        Decompressor d(preparer.files_[i]);
        std::string buffer;
        int64_t begin = 0, consumed = 0;
        int line = 1;
        bool more = true;
        while (more || !buffer.empty()) {
          size_t newline;
          while ((newline = buffer.find('\n', static_cast<size_t>(o.shard_bytes))) == std::string::npos && more) more = d.read(buffer);
          const size_t cut = newline == std::string::npos ? buffer.size() : newline + 1;
          if (cut == 0) break;
          auto text = std::make_shared<std::string>(buffer, 0, cut);
          buffer.erase(0, cut);
          const int64_t now = more ? d.consumed() : preparer.files_[i].size;
          Chunk c{{{i, begin, begin + static_cast<int64_t>(cut), line}}, now - consumed};
          consumed = now;
          begin += static_cast<int64_t>(cut);
          line += static_cast<int>(std::count(text->begin(), text->end(), '\n'));
          push({k++, std::move(c), std::move(text)});
        }
      }
    } catch (...) {
      if (!failed) fail_with(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mutex);
    produced_all = true;
    changed.notify_all();
  };
  const auto work = [&] {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex);
        changed.wait(lock, [&] { return !queue.empty() || produced_all || failed; });
        if (failed || queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
        changed.notify_all();
      }
      try {
        ShardResult r = preparer.run_shard(job.k, job.chunk, job.text.get());
        std::lock_guard<std::mutex> lock(mutex);
        results[job.k] = std::move(r);
      } catch (...) {
        fail_with(std::current_exception());
        return;
      }
      bytes_done += job.chunk.bytes;
      ++done;
      {
        std::lock_guard<std::mutex> lock(mutex);  // so the wait below cannot miss the last one
      }
      changed.notify_all();
    }
  };
  std::thread producer(produce);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (failed || (produced_all && done == known)) break;
    }
    if (progress) progress(done, known, bytes_done, total_bytes);
    std::unique_lock<std::mutex> lock(mutex);  // a report every 200 ms, and none waited for once all is done
    changed.wait_for(lock, std::chrono::milliseconds(200), [&] { return failed || (produced_all && done == known); });
  }
  producer.join();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  const size_t n = results.size();
  if (progress) progress(static_cast<int>(n), static_cast<int>(n), total_bytes, total_bytes);

  PrepareSummary s;
  s.shards = static_cast<int>(n);
  s.token_bytes = preparer.token_bytes_;
  s.skipped_directories = std::move(skipped_directories);
  s.stale_files_removed = remove_stale_files(o.out, n);
  json shards = json::array();
  for (size_t k = 0; k < n; ++k) {
    const ShardResult& r = results.at(k);
    s.documents += r.documents;
    s.tokens += r.tokens;
    s.input_bytes += r.bytes;
    s.skipped_lines += r.skipped;
    s.shards_reused += r.reused ? 1 : 0;
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
  write_file_atomic(manifest_path, manifest.dump(1) + "\n");
  return s;
}

}  // namespace dsrun
