#include "engine/checkpoint/checkpoint.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

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

std::string unit_tensor_name(size_t unit, const std::string& kind) { return "unit" + std::to_string(unit) + "." + kind; }

std::pair<int64_t, int64_t> checkpoint_slice(int64_t numel, int world, int rank) {
  const int64_t chunk = (numel + world - 1) / world;
  const int64_t begin = std::min<int64_t>(numel, chunk * rank);
  return {begin, std::min<int64_t>(numel, begin + chunk)};
}

std::string manifest_to_json(const CheckpointManifest& m) {
  nlohmann::ordered_json j;
  j["format"] = "dsrun-checkpoint";
  j["format_version"] = m.format_version;
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
  j["units"] = nlohmann::ordered_json::array();
  for (const auto& u : m.units) {
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (const auto& p : u.params) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
    nlohmann::ordered_json unit = {{"name", u.name}, {"numel", u.numel}, {"params", params}};
    if (!u.slices.empty()) {
      unit["slices"] = nlohmann::ordered_json::array();
      for (const auto& sl : u.slices) unit["slices"].push_back({{"rank", sl.rank}, {"begin", sl.begin}, {"end", sl.end}});
    }
    j["units"].push_back(unit);
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
    // 2: units may name their slices (tensor- and pipeline-parallel runs write whole parameters).
    if (m.format_version < 1 || m.format_version > 2) bad_checkpoint(path, -1, "manifest format version " + std::to_string(m.format_version) + " is newer than this dsrun reads (2)");
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
    for (const auto& u : j.at("units")) {
      CheckpointUnit unit{u.at("name"), u.at("numel"), {}, {}};
      for (const auto& p : u.at("params")) unit.params.push_back({p.at("name"), p.at("shape").get<std::vector<int64_t>>(), p.at("offset")});
      if (u.contains("slices"))
        for (const auto& sl : u.at("slices")) unit.slices.push_back({sl.at("rank"), sl.at("begin"), sl.at("end")});
      m.units.push_back(std::move(unit));
    }
  } catch (const nlohmann::json::exception& e) {
    bad_checkpoint(path, m.step, std::string("manifest field missing or of the wrong type: ") + e.what());
  }
  if (m.world_size < 1 || static_cast<int>(m.files.size()) != m.world_size) bad_checkpoint(path, m.step, "manifest lists " + std::to_string(m.files.size()) + " files for world size " + std::to_string(m.world_size));
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
    : dir_(std::move(dir)), m_(std::move(manifest)), verify_(verify_checksums) {}

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

void CheckpointReader::read_unit(const std::string& kind, size_t unit, int64_t begin, int64_t end, float* out) {
  const CheckpointUnit& u = m_.units.at(unit);
  end = std::min(end, u.numel);
  std::vector<CheckpointSlice> slices = u.slices;
  if (slices.empty())
    for (int r = 0; r < m_.world_size; ++r) {
      auto [b, e] = checkpoint_slice(u.numel, m_.world_size, r);
      slices.push_back({r, b, e});
    }
  for (const CheckpointSlice& sl : slices) {
    const int64_t b = sl.begin, e = sl.end;
    const int64_t lo = std::max(b, begin), hi = std::min(e, end);
    if (lo >= hi) continue;
    if (sl.rank < 0 || sl.rank >= m_.world_size) bad_checkpoint(dir_, m_.step, "unit " + u.name + " names rank " + std::to_string(sl.rank) + "'s file, and there are " + std::to_string(m_.world_size));
    const SafetensorsFile& f = rank_file(sl.rank);
    const SafetensorsEntry& entry = f.at(unit_tensor_name(unit, kind));
    if (entry.dtype != "F32" || entry.numel() != e - b) bad_checkpoint(f.path(), m_.step, "tensor " + entry.name + " has the wrong dtype or size for its slice");
    f.read(entry, static_cast<uint64_t>(lo - b) * 4, static_cast<uint64_t>(hi - lo) * 4, out + (lo - begin));
  }
}

std::vector<float> CheckpointReader::read_param(size_t unit, const CheckpointParam& p, const std::string& kind) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  read_unit(kind, unit, p.offset, p.offset + n, out.data());
  return out;
}

}  // namespace dsrun
