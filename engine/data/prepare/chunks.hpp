// The input cut into chunks before any tokenizing (byte ranges at line starts, or whole compressed
// files): shard k is a pure function of chunk k, which lets a killed prepare keep what it finished.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/input.hpp"

namespace dsrun::prepare_detail {

// The offset of the first line start at or after `at` (the file's size if none).
inline int64_t next_line_start(const std::string& path, int64_t at, int64_t size) {
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

inline std::vector<PlannedChunk> make_chunks(const std::vector<InputFile>& files, const PrepareOptions& o) {
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

}  // namespace dsrun::prepare_detail
