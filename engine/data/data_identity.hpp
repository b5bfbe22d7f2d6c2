// What a run's data files were, so that a resume can tell whether it reads what its checkpoint
// trained on: each file's size, modification time and a hash of sampled blocks (cheap at any size).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

struct DataFileIdentity {
  std::string path;
  int64_t size = 0;
  int64_t mtime_ns = 0;
  std::string sample_hash;  // "xxh3:..." of up to 8 blocks of 4 KiB: the head, the tail, six between
};

// Reads the samples with pread (not through a map, so a file shrinking meanwhile is an error, not
// SIGBUS). A missing or unreadable file throws dsrun::Error naming it.
DataFileIdentity identify_data_file(const std::string& path);
std::vector<DataFileIdentity> identify_data_files(const std::vector<std::string>& paths);

// How the data now differs from the data a checkpoint recorded. Files are compared in order, so a
// corpus moved to another directory (same files) is the same data.
struct DataChanges {
  std::vector<std::string> differ;   // "PATH: 104857600 bytes -> 4096": size, content, or files added or gone
  std::vector<std::string> touched;  // same size and samples, newer modification time: said, not refused
  bool same() const { return differ.empty(); }
};
DataChanges compare_data_files(const std::vector<DataFileIdentity>& then, const std::vector<DataFileIdentity>& now);
// `then` against the files at the same paths now (a missing file differs).
DataChanges compare_with_disk(const std::vector<DataFileIdentity>& then);

nlohmann::json data_files_to_json(const std::vector<DataFileIdentity>& files);
std::vector<DataFileIdentity> data_files_from_json(const nlohmann::json& j);  // throws nlohmann's errors on a bad shape

}  // namespace dsrun
