#include "engine/data/data_identity.hpp"

#include "engine/common/error.hpp"

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dsrun {
namespace {

constexpr int64_t kBlock = 4096;
constexpr int kBlocks = 8;

Error unreadable(const std::string& path, const std::string& what) {
  ErrorContext c;
  c.file = path;
  c.key = "data.path";
  c.hint = "put the run's data back where it was, or check data.path";
  return Error(what + ": " + std::strerror(errno), c);
}

std::string size_text(int64_t bytes) { return std::to_string(bytes) + " bytes"; }

}  // namespace

DataFileIdentity identify_data_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw unreadable(path, "cannot open the data file");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const Error e = unreadable(path, "cannot stat the data file");
    ::close(fd);
    throw e;
  }
  DataFileIdentity id;
  id.path = path;
  id.size = static_cast<int64_t>(st.st_size);
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  XXH3_state_t* state = XXH3_createState();
  if (!state || XXH3_64bits_reset(state) != XXH_OK) fail_at(__FILE__, __LINE__, "xxh3 state");
  char block[kBlock];
  // Evenly spaced blocks from the head to the tail: a truncation, an append or a rewrite of any
  // region larger than the gaps between them changes the hash.
  const int64_t last = std::max<int64_t>(0, id.size - kBlock);
  for (int k = 0; k < kBlocks && id.size > 0; ++k) {
    const int64_t at = last * k / (kBlocks - 1);
    const int64_t want = std::min<int64_t>(kBlock, id.size - at);
    const ssize_t got = ::pread(fd, block, static_cast<size_t>(want), at);
    if (got != want) {
      if (got >= 0) errno = EIO;  // shorter than fstat said: it shrank while read
      const Error e = unreadable(path, "cannot read the data file at byte " + std::to_string(at));
      XXH3_freeState(state);
      ::close(fd);
      throw e;
    }
    XXH3_64bits_update(state, block, static_cast<size_t>(got));
  }
  char hex[24];
  std::snprintf(hex, sizeof hex, "xxh3:%016llx", static_cast<unsigned long long>(XXH3_64bits_digest(state)));
  id.sample_hash = hex;
  XXH3_freeState(state);
  if (::close(fd) != 0) fail_at(__FILE__, __LINE__, "close " + path + ": " + std::strerror(errno));
  return id;
}

std::vector<DataFileIdentity> identify_data_files(const std::vector<std::string>& paths) {
  std::vector<DataFileIdentity> out;
  out.reserve(paths.size());
  for (const std::string& p : paths) out.push_back(identify_data_file(p));
  return out;
}

DataChanges compare_data_files(const std::vector<DataFileIdentity>& then, const std::vector<DataFileIdentity>& now) {
  DataChanges c;
  const size_t common = std::min(then.size(), now.size());
  for (size_t i = 0; i < common; ++i) {
    const DataFileIdentity &a = then[i], &b = now[i];
    const std::string name = a.path == b.path ? a.path : a.path + " (now " + b.path + ")";
    if (a.size != b.size) c.differ.push_back(name + ": " + size_text(a.size) + " -> " + size_text(b.size));
    else if (a.sample_hash != b.sample_hash) c.differ.push_back(name + ": same size, different content (sampled blocks " + a.sample_hash + " -> " + b.sample_hash + ")");
    else if (a.mtime_ns != b.mtime_ns) c.touched.push_back(name + ": modified since, same size and sampled content");
  }
  for (size_t i = common; i < then.size(); ++i) c.differ.push_back(then[i].path + ": no longer part of the data");
  for (size_t i = common; i < now.size(); ++i) c.differ.push_back(now[i].path + ": new (" + size_text(now[i].size) + ")");
  return c;
}

DataChanges compare_with_disk(const std::vector<DataFileIdentity>& then) {
  DataChanges c;
  for (const DataFileIdentity& f : then) {
    struct stat st {};
    if (::stat(f.path.c_str(), &st) != 0) {
      c.differ.push_back(f.path + ": missing (" + std::strerror(errno) + ")");
      continue;
    }
    const DataChanges one = compare_data_files({f}, {identify_data_file(f.path)});
    c.differ.insert(c.differ.end(), one.differ.begin(), one.differ.end());
    c.touched.insert(c.touched.end(), one.touched.begin(), one.touched.end());
  }
  return c;
}

nlohmann::json data_files_to_json(const std::vector<DataFileIdentity>& files) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& f : files) j.push_back({{"path", f.path}, {"size", f.size}, {"mtime_ns", f.mtime_ns}, {"sample_hash", f.sample_hash}});
  return j;
}

std::vector<DataFileIdentity> data_files_from_json(const nlohmann::json& j) {
  std::vector<DataFileIdentity> files;
  for (const auto& f : j) files.push_back({f.at("path").get<std::string>(), f.at("size").get<int64_t>(), f.at("mtime_ns").get<int64_t>(), f.at("sample_hash").get<std::string>()});
  return files;
}

}  // namespace dsrun
