// dsrun prepare's inputs: each file described (size, time, compression) and checked unchanged while
// read, errors at a file and line, the pieces and chunks text is cut into, the output directory.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

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

namespace dsrun::prepare_detail {

using json = nlohmann::json;

inline Error input_error(const std::string& file, int line, const std::string& what, const std::string& hint) {
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

inline int64_t nanoseconds(const struct timespec& t) { return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec; }

// After a file was read: the file must be as it was when the inputs were listed, or the corpus
// would mix old and new text. Size, modification time and status-change time (which no tool can
// set back, so a file put back with its old modification time is caught too).
inline void check_unchanged(const InputFile& f, int fd) {
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
inline std::string excerpt(const std::string& text, size_t limit = 300) {
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

inline void collect(const std::string& path, std::vector<std::string>& out, const OutputDirectory& output, bool named,
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

inline InputFile describe_input(const std::string& path) {
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
inline std::string read_range(const std::string& path, int64_t begin, int64_t end, const InputFile* input = nullptr) {
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

}  // namespace dsrun::prepare_detail
