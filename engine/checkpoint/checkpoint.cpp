#include "engine/checkpoint/checkpoint.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <tuple>

namespace dsrun {

namespace {

[[noreturn]] void bad_checkpoint(const std::string& file, int64_t step, const std::string& what) {
  ErrorContext c;
  c.file = file;
  c.hint = "resume from the previous complete checkpoint with `dsrun resume RUN --fallback`, or roll back to an earlier step";
  throw Error("checkpoint at step " + std::to_string(step) + ": " + what, c);
}

int64_t step_of_directory(const std::string& name) {
  if (!starts_with(name, "step_") || name.size() <= 5) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::atoll(name.c_str() + 5);
}

// Versions 1 and 2 stored flat units ("unit3.master" in each file): rank r's file held elements
// checkpoint_slice(numel, world, r) of each (version 1), or the ranges a unit's "slices" list
// (version 2). Each parameter's part of such a range is a slice of the whole parameter.
std::vector<StoredParam> legacy_params(const nlohmann::json& units, int world) {
  std::vector<StoredParam> out;
  for (size_t k = 0; k < units.size(); ++k) {
    const nlohmann::json& u = units[k];
    const int64_t numel = u.at("numel").get<int64_t>();
    std::vector<std::tuple<int, int64_t, int64_t>> held;  // rank, [begin, end) of the unit
    if (u.contains("slices"))
      for (const auto& sl : u.at("slices")) held.emplace_back(sl.at("rank").get<int>(), sl.at("begin").get<int64_t>(), sl.at("end").get<int64_t>());
    else
      for (int r = 0; r < world; ++r) {
        auto [b, e] = checkpoint_slice(numel, world, r);
        held.emplace_back(r, b, e);
      }
    for (const auto& p : u.at("params")) {
      StoredParam param{p.at("name"), p.at("shape").get<std::vector<int64_t>>(), {}};
      const int64_t offset = p.at("offset").get<int64_t>(), n = element_count(param.shape);
      for (const auto& [rank, b, e] : held) {
        const int64_t lo = std::max(b, offset), hi = std::min(e, offset + n);
        if (lo >= hi) continue;
        ParamSlice sl;
        sl.rank = rank;
        sl.begin = lo - offset;
        sl.end = hi - offset;
        sl.tensor = "unit" + std::to_string(k);
        sl.tensor_offset = lo - b;
        param.slices.push_back(std::move(sl));
      }
      out.push_back(std::move(param));
    }
  }
  return out;
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank%05d.safetensors", rank);
  return buf;
}

std::string slice_tensor_name(const std::string& tensor, const std::string& kind) { return tensor + "." + kind; }

std::pair<int64_t, int64_t> checkpoint_slice(int64_t numel, int world, int rank) {
  const int64_t chunk = (numel + world - 1) / world;
  const int64_t begin = std::min<int64_t>(numel, chunk * rank);
  return {begin, std::min<int64_t>(numel, begin + chunk)};
}

std::string manifest_to_json(const CheckpointManifest& m) {
  nlohmann::ordered_json j;
  j["format"] = "dsrun-checkpoint";
  j["format_version"] = 3;  // what is written; a manifest read from an older version is converted, never written back
  for (const auto& p : m.params)
    for (const auto& sl : p.slices) DSRUN_ASSERT(sl.tensor == p.name && sl.tensor_offset == 0, "format 3 stores each slice as the tensor named for its parameter");
  j["run_id"] = m.run_id;
  j["step"] = m.step;
  j["samples_seen"] = m.samples_seen;
  j["world_size"] = m.world_size;
  j["zero_stage"] = m.zero_stage;
  j["dtype"] = m.dtype;
  j["optimizer"] = m.optimizer;
  j["optimizer_states"] = m.optimizer_states;
  j["optimizer_steps"] = m.optimizer_steps;
  j["created_at"] = m.created_at;
  j["files"] = nlohmann::ordered_json::array();
  for (const auto& f : m.files) j["files"].push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"checksum", f.checksum}});
  j["params"] = nlohmann::ordered_json::array();
  for (const auto& p : m.params) {
    nlohmann::ordered_json slices = nlohmann::ordered_json::array();
    for (const auto& sl : p.slices) {
      nlohmann::ordered_json one = {{"rank", sl.rank}, {"begin", sl.begin}, {"end", sl.end}};
      if (!sl.region.whole()) {
        one["dim"] = sl.region.dim;
        one["ranges"] = nlohmann::ordered_json::array();
        for (const auto& [b, n] : sl.region.ranges) one["ranges"].push_back({b, n});
      }
      slices.push_back(one);
    }
    j["params"].push_back({{"name", p.name}, {"shape", p.shape}, {"slices", slices}});
  }
  if (!m.data_files.empty()) j["data_files"] = data_files_to_json(m.data_files);
  j["config_toml"] = m.config_toml;
  return j.dump(1) + "\n";
}

CheckpointManifest manifest_from_json(const std::string& text, const std::string& path) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != "dsrun-checkpoint") bad_checkpoint(path, -1, "manifest is not a dsrun checkpoint manifest");
  CheckpointManifest m;
  try {
    m.format_version = j.at("format_version").get<int>();
    // 1: flat units; 2: units may name their slices (whole parameters); 3: parameters in slices.
    if (m.format_version < 1 || m.format_version > 3) bad_checkpoint(path, -1, "manifest format version " + std::to_string(m.format_version) + " is newer than this dsrun reads (3)");
    m.run_id = j.at("run_id").get<std::string>();
    m.step = j.at("step").get<int64_t>();
    m.samples_seen = j.at("samples_seen").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    m.zero_stage = j.at("zero_stage").get<int>();
    m.dtype = j.at("dtype").get<std::string>();
    m.optimizer = j.at("optimizer").get<std::string>();
    m.optimizer_states = j.at("optimizer_states").get<std::vector<std::string>>();
    m.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
    m.created_at = j.at("created_at").get<double>();
    m.config_toml = j.at("config_toml").get<std::string>();
    if (j.contains("data_files")) m.data_files = data_files_from_json(j.at("data_files"));  // absent before dsrun recorded it
    for (const auto& f : j.at("files")) m.files.push_back({f.at("name"), f.at("rank"), f.at("bytes"), f.at("checksum")});
    if (m.format_version >= 3) {
      for (const auto& p : j.at("params")) {
        StoredParam param{p.at("name"), p.at("shape").get<std::vector<int64_t>>(), {}};
        for (const auto& sl : p.at("slices")) {
          ParamSlice slice;
          slice.rank = sl.at("rank");
          slice.begin = sl.at("begin");
          slice.end = sl.at("end");
          if (sl.contains("dim")) {
            slice.region.dim = sl.at("dim");
            for (const auto& r : sl.at("ranges")) slice.region.ranges.push_back({r.at(0), r.at(1)});
          }
          slice.tensor = param.name;
          param.slices.push_back(std::move(slice));
        }
        m.params.push_back(std::move(param));
      }
    } else {
      if (m.world_size < 1) bad_checkpoint(path, m.step, "manifest world size " + std::to_string(m.world_size));
      m.params = legacy_params(j.at("units"), m.world_size);
    }
  } catch (const nlohmann::json::exception& e) {
    bad_checkpoint(path, m.step, std::string("manifest field missing or of the wrong type: ") + e.what());
  }
  if (m.world_size < 1 || static_cast<int>(m.files.size()) != m.world_size) bad_checkpoint(path, m.step, "manifest lists " + std::to_string(m.files.size()) + " files for world size " + std::to_string(m.world_size));
  for (const StoredParam& p : m.params)
    for (const ParamSlice& sl : p.slices) {
      std::string problem;
      if (sl.rank < 0 || sl.rank >= m.world_size) problem = "names rank " + std::to_string(sl.rank) + "'s file of " + std::to_string(m.world_size);
      try {
        const int64_t n = element_count(region_shape(p.shape, sl.region));
        region_runs(p.shape, sl.region);
        if (sl.begin < 0 || sl.begin > sl.end || sl.end > n) problem = "has elements [" + std::to_string(sl.begin) + ", " + std::to_string(sl.end) + ") of a region of " + std::to_string(n);
      } catch (const std::exception& e) {  // dsrun::Error, or std::out_of_range for a dimension past the shape
        problem = e.what();
      }
      if (!problem.empty()) bad_checkpoint(path, m.step, "a slice of parameter " + p.name + " " + problem);
    }
  return m;
}

std::string commit_checkpoint(const std::string& dir, const CheckpointManifest& m) {
  const std::string text = manifest_to_json(m);
  write_file_atomic(path_join(dir, kManifestFile), text);
  const std::string checksum = checksum_bytes(text.data(), text.size());
  write_file_atomic(path_join(dir, kCompleteMarker), checksum + "\n");
  return checksum;
}

std::vector<CheckpointInfo> list_checkpoints(const std::string& root) {
  std::vector<CheckpointInfo> out;
  if (!is_directory(root)) return out;
  for (const auto& name : list_directory(root)) {
    const int64_t step = step_of_directory(name);
    const std::string path = path_join(root, name);
    if (step < 0 || !is_directory(path)) continue;
    out.push_back({step, path, file_exists(path_join(path, kCompleteMarker))});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step < b.step; });
  return out;
}

CheckpointManifest read_checkpoint(const std::string& dir, bool verify_files) {
  const int64_t dir_step = step_of_directory(dir.substr(dir.find_last_of('/') + 1));
  const std::string marker = path_join(dir, kCompleteMarker), manifest_path = path_join(dir, kManifestFile);
  if (!is_directory(dir)) bad_checkpoint(dir, dir_step, "no such directory");
  if (!file_exists(marker)) bad_checkpoint(marker, dir_step, "incomplete: no completion marker (the save was interrupted)");
  if (!file_exists(manifest_path)) bad_checkpoint(manifest_path, dir_step, "manifest missing");
  const std::string text = read_file(manifest_path);
  if (trim(read_file(marker)) != checksum_bytes(text.data(), text.size())) bad_checkpoint(manifest_path, dir_step, "manifest does not match the checksum in its completion marker");
  CheckpointManifest m = manifest_from_json(text, manifest_path);
  // A step directory is its manifest's step: a copy under another name (cp -r step_4 step_10)
  // would resume "from step 10" with step 4's state and hide the newer steps between.
  if (dir_step >= 0 && m.step != dir_step)
    bad_checkpoint(manifest_path, dir_step, "its manifest is step " + std::to_string(m.step) + "'s, not its directory's (copied or renamed?): move it back to " +
                                                checkpoint_dir_name(m.step) + ", or remove it");
  for (const auto& f : m.files) {
    const std::string path = path_join(dir, f.name);
    const int64_t size = file_size(path);
    if (size < 0) bad_checkpoint(path, m.step, "rank " + std::to_string(f.rank) + "'s shard is missing");
    if (static_cast<uint64_t>(size) != f.bytes) bad_checkpoint(path, m.step, "rank " + std::to_string(f.rank) + "'s shard has " + std::to_string(size) + " bytes, the manifest says " + std::to_string(f.bytes) + " (truncated?)");
    if (verify_files && checksum_file(path) != f.checksum) bad_checkpoint(path, m.step, "rank " + std::to_string(f.rank) + "'s shard does not match its checksum (corrupted)");
  }
  return m;
}

std::optional<CheckpointInfo> find_checkpoint(const std::string& root, int64_t max_step, bool fallback, std::vector<std::string>* skipped) {
  std::vector<CheckpointInfo> all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (!it->complete || (max_step >= 0 && it->step > max_step)) continue;
    try {
      read_checkpoint(it->path, true);
      return *it;
    } catch (const Error& e) {
      if (!fallback) throw;
      if (skipped) skipped->push_back(e.describe());
    }
  }
  return std::nullopt;
}

std::vector<std::string> checkpoints_to_remove(const std::vector<CheckpointInfo>& all, int64_t keep_last, int64_t keep_every) {
  std::vector<std::string> remove;
  int64_t newest_complete = -1, kept = 0;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (!it->complete) {
      if (it->step < newest_complete) remove.push_back(it->path);  // left by an interrupted save
      continue;
    }
    if (newest_complete < 0) newest_complete = it->step;
    if (kept < keep_last) {
      ++kept;
      continue;
    }
    if (keep_every > 0 && it->step % keep_every == 0) continue;
    remove.push_back(it->path);
  }
  return remove;
}

CheckpointReader::CheckpointReader(std::string dir, CheckpointManifest manifest, bool verify_checksums)
    : dir_(std::move(dir)), m_(std::move(manifest)), verify_(verify_checksums) {
  for (size_t i = 0; i < m_.params.size(); ++i) by_name_[m_.params[i].name] = i;
}

const StoredParam* CheckpointReader::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &m_.params[it->second];
}

const SafetensorsFile& CheckpointReader::rank_file(int rank) {
  auto& f = files_[rank];
  if (f) return *f;
  const CheckpointFile& listed = m_.files.at(static_cast<size_t>(rank));
  const std::string path = path_join(dir_, listed.name);
  if (file_size(path) < 0) bad_checkpoint(path, m_.step, "rank " + std::to_string(rank) + "'s shard is missing");
  if (static_cast<uint64_t>(file_size(path)) != listed.bytes) bad_checkpoint(path, m_.step, "rank " + std::to_string(rank) + "'s shard has " + std::to_string(file_size(path)) + " bytes, the manifest says " + std::to_string(listed.bytes) + " (truncated?)");
  if (verify_ && checksum_file(path) != listed.checksum) bad_checkpoint(path, m_.step, "rank " + std::to_string(rank) + "'s shard does not match its checksum (corrupted)");
  f = std::make_unique<SafetensorsFile>(path);
  return *f;
}

void CheckpointReader::read_slice(const StoredParam& p, const ParamSlice& s, const std::string& kind, int64_t begin, int64_t end, float* out) {
  const SafetensorsFile& f = rank_file(s.rank);
  const SafetensorsEntry& entry = f.at(slice_tensor_name(s.tensor, kind));
  if (entry.dtype != "F32" || entry.numel() < s.tensor_offset + (s.end - s.begin))
    bad_checkpoint(f.path(), m_.step, "tensor " + entry.name + " (of " + p.name + ") has the wrong dtype or size for its slice");
  const uint64_t bytes = static_cast<uint64_t>(end - begin) * 4;
  f.read(entry, static_cast<uint64_t>(s.tensor_offset + begin - s.begin) * 4, bytes, out);
  bytes_read_ += bytes;
}

std::vector<float> CheckpointReader::read_whole(const StoredParam& p, const std::string& kind) {
  std::vector<float> whole(static_cast<size_t>(element_count(p.shape)));
  int64_t covered = 0;
  std::vector<float> part;
  for (const ParamSlice& s : p.slices) {
    part.resize(static_cast<size_t>(s.end - s.begin));
    read_slice(p, s, kind, s.begin, s.end, part.data());
    copy_region_range(region_runs(p.shape, s.region), s.begin, s.end, part.data(), whole.data(), /*to_whole=*/true);
    covered += s.end - s.begin;
  }
  if (covered != static_cast<int64_t>(whole.size()))
    bad_checkpoint(dir_, m_.step, "parameter " + p.name + ": its slices hold " + std::to_string(covered) + " of its " + std::to_string(whole.size()) + " elements");
  return whole;
}

void CheckpointReader::read(const StoredParam& p, const std::string& kind, const TensorRegion& region, int64_t begin, int64_t end, float* out) {
  // The same region as stored (the same tensor-parallel degree, or none): copy the ranges straight.
  int64_t covered = 0;
  for (const ParamSlice& s : p.slices) {
    if (!(s.region == region)) continue;
    const int64_t lo = std::max(begin, s.begin), hi = std::min(end, s.end);
    if (lo >= hi) continue;
    read_slice(p, s, kind, lo, hi, out + (lo - begin));
    covered += hi - lo;
  }
  if (covered == end - begin) return;
  std::vector<float> whole = read_whole(p, kind);
  copy_region_range(region_runs(p.shape, region), begin, end, out, whole.data(), /*to_whole=*/false);
}

}  // namespace dsrun
