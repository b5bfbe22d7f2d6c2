#include "engine/train/checkpointing.hpp"

#include "engine/checkpoint/export.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/parallel/tensor_parallel.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <mutex>

namespace dsrun {

namespace {

std::string safetensors_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "F32";
    case torch::kBFloat16: return "BF16";
    case torch::kFloat16: return "F16";
    case torch::kFloat64: return "F64";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kUInt8: return "U8";
    default: fail_at(__FILE__, __LINE__, std::string("no safetensors dtype for ") + c10::toString(t));
  }
}

torch::ScalarType torch_scalar_type(const std::string& d) {
  if (d == "F32") return torch::kFloat32;
  if (d == "BF16") return torch::kBFloat16;
  if (d == "F16") return torch::kFloat16;
  if (d == "F64") return torch::kFloat64;
  if (d == "I64") return torch::kInt64;
  if (d == "I32") return torch::kInt32;
  if (d == "U8") return torch::kUInt8;
  fail_at(__FILE__, __LINE__, "unsupported tensor dtype " + d);
}

// Fault injection for the tests: DSRUN_TEST_CRASH_IN_SAVE="RANK:STEP" kills that rank after its
// shard is written and before the checkpoint is committed (a crash in the middle of a save).
bool crash_in_save_requested(int rank, int64_t step) {
  const char* v = std::getenv("DSRUN_TEST_CRASH_IN_SAVE");
  const char* restart = std::getenv("DSRUN_RESTART");
  if (restart && std::atoi(restart) > 0) return false;
  int r = -1;
  long long s = -1;
  return v && std::sscanf(v, "%d:%lld", &r, &s) == 2 && r == rank && s == step;
}

uint64_t checksum_value(const std::string& checksum) { return std::strtoull(checksum.substr(checksum.find(':') + 1).c_str(), nullptr, 16); }

std::string checksum_text(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return std::string("xxh3:") + buf;
}

// Parameter names by tensor identity (ZeRO swaps their storage, never the tensors themselves).
std::map<const void*, std::string> parameter_names(Model& model) {
  std::map<const void*, std::string> names;
  for (const auto& p : model.module().named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  return names;
}

std::string join_numbers(const std::vector<int64_t>& v) {
  std::vector<std::string> parts;
  for (int64_t x : v) parts.push_back(std::to_string(x));
  return join(parts, ", ");
}

torch::Tensor cpu_contiguous(const torch::Tensor& t) { return t.to(torch::kCPU).contiguous(); }

bool model_parallel(const DeviceMesh& mesh) { return mesh.shape().tensor * mesh.shape().pipeline * mesh.shape().expert > 1; }

// Every rank's string, on every rank (a sum of rows, each rank filling its own).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int world = comm.world_size(), rank = comm.rank();
  torch::Tensor sizes = torch::zeros({world}, torch::kInt64);
  sizes[rank] = static_cast<int64_t>(mine.size());
  comm.all_reduce_sum(sizes);
  const int64_t longest = std::max<int64_t>(1, sizes.max().item<int64_t>());
  torch::Tensor rows = torch::zeros({world, longest}, torch::kInt32);
  int32_t* row = rows[rank].data_ptr<int32_t>();
  for (size_t i = 0; i < mine.size(); ++i) row[i] = static_cast<unsigned char>(mine[i]);
  comm.all_reduce_sum(rows);
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    const int32_t* chars = rows[r].data_ptr<int32_t>();
    out.emplace_back(chars, chars + sizes[r].item<int64_t>());
  }
  return out;
}

// A unit's flat shard of `kind` ("master" or an optimizer state), whole: gathered over the data
// ranks (routed experts: those keeping the same ones) unless this rank already holds all of it (ZeRO-0).
torch::Tensor whole_unit(RankTrainingState& s, size_t k, const std::string& kind) {
  torch::Tensor shard = kind == "master" ? s.zero.shards()[k].master : s.optimizer.state(kind, k);
  Communicator& data = s.zero.unit_group(k);
  if (s.zero.master_begin(k) == 0 && shard.numel() >= s.zero.unit_numel(k)) return shard;
  torch::Tensor full = torch::empty({shard.numel() * data.world_size()}, shard.options());
  data.all_gather(shard.contiguous(), full);
  return full;
}

// Model-parallel saves (tensor, pipeline, expert): every parameter of this rank's units whole (its
// ZeRO shards gathered over the data ranks, its slices over the tensor ranks), written as a unit of
// its own by one rank of the mesh's holders (MeshShape::holders): tensor rank 0 of the first data
// rank of each stage, and for routed experts that of each expert shard. The holders' group alone
// agrees on the numbering. Returns, on rank 0, the manifest's units.
std::vector<CheckpointUnit> save_whole_parameters(RankTrainingState& s, const std::vector<std::string>& states,
                                                  const std::function<void(const std::string&, const torch::Tensor&)>& add) {
  Communicator& tensor = s.mesh.along(MeshDim::Tensor);
  Communicator* holders = s.mesh.holders();
  const bool writer = holders != nullptr;
  const std::vector<ParameterUnit> units = s.model.parameter_units();  // ZeRO's order
  // Dense units are written by data rank 0 alone; each expert shard's by its first replica.
  const auto writes = [&](const ParameterUnit& u) { return writer && (u.experts_of >= 0 || s.mesh.coordinates().data == 0); };
  // Where this writer's units start in the checkpoint: after every earlier holder's.
  int64_t index = 0;
  if (writer) {
    Communicator& writers = *holders;
    int64_t count = 0;
    for (const auto& u : units)
      if (writes(u)) count += static_cast<int64_t>(u.params.size());
    torch::Tensor counts = torch::zeros({writers.world_size()}, torch::kInt64);
    counts[writers.rank()] = count;
    writers.all_reduce_sum(counts);
    index = counts.narrow(0, 0, writers.rank()).sum().item<int64_t>();
  }

  nlohmann::json mine = nlohmann::json::array();
  std::vector<std::string> kinds{"master"};
  kinds.insert(kinds.end(), states.begin(), states.end());
  for (size_t k = 0; k < units.size(); ++k) {
    std::vector<torch::Tensor> flats;
    for (const auto& kind : kinds) flats.push_back(whole_unit(s, k, kind));
    for (size_t i = 0; i < units[k].params.size(); ++i) {
      const std::vector<int64_t>& local_shape = s.zero.unit_shape(k, i);
      const TensorSplit split = i < units[k].splits.size() ? units[k].splits[i] : TensorSplit{};
      std::vector<int64_t> full_shape;
      int64_t numel = 1;
      for (int64_t d : local_shape) numel *= d;
      for (size_t n = 0; n < kinds.size(); ++n) {
        torch::Tensor local = flats[n].narrow(0, s.zero.unit_offsets(k)[i], numel).view(local_shape).contiguous();
        torch::Tensor full = local;
        if (tensor.world_size() > 1 && split.kind != TensorSplit::Replicated) {
          torch::Tensor gathered = torch::empty({numel * tensor.world_size()}, local.options());
          tensor.all_gather(local.flatten(), gathered);
          std::vector<torch::Tensor> slices;
          for (const auto& row : gathered.view({tensor.world_size(), numel}).unbind(0)) slices.push_back(row.view(local_shape));
          full = tensor_join(slices, split);
        }
        full_shape = full.sizes().vec();
        if (writes(units[k])) add(unit_tensor_name(static_cast<size_t>(index), kinds[n]), full.flatten());
      }
      if (!writes(units[k])) continue;
      mine.push_back({{"name", units[k].names[i]}, {"shape", full_shape}, {"index", index}});
      ++index;
    }
  }
  // Rank 0 writes the manifest: every writer's parameters, in checkpoint order.
  std::vector<CheckpointUnit> all;
  if (!writer) return all;
  const std::vector<std::string> lists = all_gather_strings(*holders, mine.dump());
  const std::vector<int> writer_ranks = s.mesh.shape().holders();
  for (size_t w = 0; w < writer_ranks.size(); ++w)
    for (const auto& p : nlohmann::json::parse(lists[w])) {
      const int r = writer_ranks[w];
      CheckpointUnit u;
      u.name = p.at("name").get<std::string>();
      const std::vector<int64_t> shape = p.at("shape").get<std::vector<int64_t>>();
      u.numel = 1;
      for (int64_t d : shape) u.numel *= d;
      u.params.push_back({u.name, shape, 0});
      u.slices.push_back({r, 0, u.numel});
      DSRUN_ASSERT(p.at("index").get<int64_t>() == static_cast<int64_t>(all.size()), "writers number their parameters in rank order");
      all.push_back(std::move(u));
    }
  return all;
}

// Restores into any layout from any checkpoint: every parameter of this rank's units read whole by
// name, cut to this rank's tensor slice, and the part within its ZeRO shard copied in.
void restore_whole_parameters(RankTrainingState& s, CheckpointReader& reader, const std::vector<std::string>& states, ErrorContext& c) {
  const CheckpointManifest& m = reader.manifest();
  std::map<std::string, std::pair<size_t, const CheckpointParam*>> where;
  for (size_t u = 0; u < m.units.size(); ++u)
    for (const auto& p : m.units[u].params) where[p.name] = {u, &p};
  Communicator& tensor = s.mesh.along(MeshDim::Tensor);
  const std::vector<ParameterUnit> units = s.model.parameter_units();
  std::vector<std::string> problems;
  std::vector<std::string> kinds{"master"};
  kinds.insert(kinds.end(), states.begin(), states.end());
  for (size_t k = 0; k < units.size(); ++k) {
    const int64_t shard_begin = s.zero.master_begin(k), shard_numel = s.zero.shards()[k].master.numel();
    for (size_t i = 0; i < units[k].params.size(); ++i) {
      const std::string& name = units[k].names[i];
      const TensorSplit split = i < units[k].splits.size() ? units[k].splits[i] : TensorSplit{};
      auto it = where.find(name);
      if (it == where.end()) {
        problems.push_back("no parameter " + name);
        continue;
      }
      const CheckpointParam& p = *it->second.second;
      const std::vector<int64_t>& local_shape = s.zero.unit_shape(k, i);
      if (!tensor_split_problem(p.shape, split, tensor.world_size()).empty() || tensor_slice_shape(p.shape, split, tensor.world_size()) != local_shape) {
        problems.push_back(name + " has shape [" + join_numbers(p.shape) + "] in the checkpoint, which does not give this rank's [" + join_numbers(local_shape) + "]");
        continue;
      }
      const int64_t offset = s.zero.unit_offsets(k)[i];
      int64_t numel = 1;
      for (int64_t d : local_shape) numel *= d;
      const int64_t lo = std::max(offset, shard_begin), hi = std::min(offset + numel, shard_begin + shard_numel);
      if (lo >= hi) continue;  // none of it in this rank's shard
      for (const auto& kind : kinds) {
        std::vector<float> values = reader.read_param(it->second.first, p, kind);
        torch::Tensor full = torch::from_blob(values.data(), p.shape, torch::kFloat32);
        torch::Tensor mine = tensor_slice(full, split, tensor.rank(), tensor.world_size()).flatten();
        torch::Tensor target = kind == "master" ? s.zero.shards()[k].master : s.optimizer.state(kind, k);
        target.narrow(0, lo - shard_begin, hi - lo).copy_(mine.narrow(0, lo - offset, hi - lo));
      }
    }
  }
  // The reverse: what the checkpoint holds that no rank's model has (a removed layer, a head the
  // model now ties to its embedding) would be dropped silently. Every rank holds only its own
  // stage's units, so the names are gathered: every rank then sees, and reports, the same.
  std::string mine;
  for (const ParameterUnit& u : units)
    for (const std::string& name : u.names) mine += name + "\n";
  std::set<std::string> in_model;
  for (const std::string& names : all_gather_strings(s.mesh.world(), mine)) {
    std::istringstream lines(names);
    for (std::string name; std::getline(lines, name);) in_model.insert(name);
  }
  for (const auto& [name, at] : where)
    if (!in_model.count(name)) problems.push_back("unexpected " + name + " (in the checkpoint, not in this model)");
  if (!problems.empty()) {
    c.key = "model";
    c.hint = "resume with the checkpoint's model settings; to start a different model from these weights, export them and use model.init_from";
    throw Error("checkpoint does not fit this model: " + join(problems, "; "), c);
  }
}

}  // namespace

SavedCheckpoint save_checkpoint(RankTrainingState& s, const CheckpointRunFacts& facts, const std::string& root, int64_t step,
                                const std::string& hook_state, int64_t keep_last, int64_t keep_every) {
  torch::NoGradGuard no_grad;
  Communicator& comm = s.mesh.world();
  const int rank = comm.rank(), world = comm.world_size();
  const std::string dir = path_join(root, checkpoint_dir_name(step));
  make_directories(dir);
  // A complete checkpoint of this step from an earlier attempt stops existing before it is rewritten.
  if (rank == 0 && file_exists(path_join(dir, kCompleteMarker))) {
    std::remove(path_join(dir, kCompleteMarker).c_str());
    sync_directory(dir);
  }
  comm.barrier();

  std::vector<torch::Tensor> keep;  // the bytes the writer points at, alive until written
  SafetensorsWriter writer;
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    torch::Tensor c = cpu_contiguous(t);
    keep.push_back(c);
    writer.add(name, safetensors_dtype(c.scalar_type()), c.sizes().vec(), c.data_ptr());
  };
  const std::vector<std::string> states = s.optimizer.state_names();
  std::vector<CheckpointUnit> whole_parameters;  // model-parallel: the manifest's units
  if (model_parallel(s.mesh)) {
    whole_parameters = save_whole_parameters(s, states, add);
  } else {
    for (size_t k = 0; k < s.zero.unit_count(); ++k) {
      auto [begin, end] = checkpoint_slice(s.zero.unit_numel(k), world, rank);
      const int64_t from = begin - s.zero.master_begin(k);
      add(unit_tensor_name(k, "master"), s.zero.shards()[k].master.narrow(0, from, end - begin));
      for (const auto& name : states) add(unit_tensor_name(k, name), s.optimizer.state(name, k).narrow(0, from, end - begin));
    }
  }
  // Per-rank state: buffers (BatchNorm statistics are not synchronised across ranks) and RNG.
  for (const auto& b : s.model.module().named_buffers()) add("buffer." + b.key(), b.value());
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    add("rng.cpu", generator.get_state());
  }
  nlohmann::json rank_state = {{"rank", rank}, {"world_size", world}, {"step", step}, {"optimizer_steps", s.optimizer.steps_taken()}, {"hook_state", hook_state}};
  if (s.scaler) {
    LossScalerState st = s.scaler->state();
    rank_state["loss_scaler"] = {{"scale", st.scale}, {"hysteresis_left", st.hysteresis_left}, {"clean_steps", st.clean_steps}, {"skipped", st.skipped}};
  }
  writer.set_metadata("format", "dsrun-rank-state");
  writer.set_metadata("dsrun.rank_state", rank_state.dump());
  WrittenFile written = writer.write_atomic(path_join(dir, rank_file_name(rank)));
  if (crash_in_save_requested(rank, step)) ::raise(SIGKILL);

  // Every rank's size and checksum to rank 0 (a sum where each rank fills its own row).
  torch::Tensor table = torch::zeros({world, 2}, torch::kInt64);
  table[rank][0] = static_cast<int64_t>(written.bytes);
  table[rank][1] = static_cast<int64_t>(checksum_value(written.checksum));
  comm.all_reduce_sum(table);

  SavedCheckpoint saved;
  saved.path = dir;
  saved.step = step;
  if (rank == 0) {
    CheckpointManifest m;
    m.run_id = facts.run_id;
    m.step = step;
    m.samples_seen = step * facts.global_batch;
    m.world_size = world;
    m.zero_stage = facts.zero_stage;
    m.dtype = facts.dtype;
    m.optimizer = facts.optimizer;
    m.optimizer_states = states;
    m.optimizer_steps = s.optimizer.steps_taken();
    m.created_at = static_cast<double>(std::time(nullptr));
    m.config_toml = facts.config_toml;
    m.data_files = facts.data_files;
    auto names = parameter_names(s.model);
    if (!whole_parameters.empty()) m.format_version = 2;  // units name their slices
    m.units = whole_parameters;
    for (size_t k = 0; k < s.zero.unit_count() && whole_parameters.empty(); ++k) {
      CheckpointUnit u{s.zero.unit_name(k), s.zero.unit_numel(k), {}, {}};
      const auto& params = s.zero.unit_params(k);
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& shape = s.zero.unit_shape(k, i);
        u.params.push_back({names.at(params[i].unsafeGetTensorImpl()), shape, s.zero.unit_offsets(k)[i]});
      }
      m.units.push_back(std::move(u));
    }
    for (int r = 0; r < world; ++r) {
      const uint64_t bytes = static_cast<uint64_t>(table[r][0].item<int64_t>());
      m.files.push_back({rank_file_name(r), r, bytes, checksum_text(static_cast<uint64_t>(table[r][1].item<int64_t>()))});
      saved.bytes += bytes;
    }
    saved.checksum = commit_checkpoint(dir, m);
    for (const auto& old : checkpoints_to_remove(list_checkpoints(root), keep_last, keep_every)) {
      remove_tree(old);
      saved.removed.push_back(old);
    }
  }
  comm.barrier();  // nobody goes on (or reports success) before the checkpoint exists
  return saved;
}

RestoredProgress restore_checkpoint(RankTrainingState& s, const std::string& dir) {
  torch::NoGradGuard no_grad;
  const int rank = s.mesh.world().rank();
  CheckpointManifest m = read_checkpoint(dir, /*verify_files=*/false);
  ErrorContext c;
  c.file = path_join(dir, kManifestFile);
  c.rank = rank;
  // Unit by unit when both sides are one flat layout (no model parallelism here, no whole
  // parameters there); otherwise parameter by parameter, by name (restore_whole_parameters).
  const bool same_units = !model_parallel(s.mesh) && std::all_of(m.units.begin(), m.units.end(), [](const CheckpointUnit& u) { return u.slices.empty(); });
  // Then the model must be the one that was saved: same units, same sizes.
  std::vector<std::string> problems;
  if (same_units && m.units.size() != s.zero.unit_count())
    problems.push_back("the checkpoint has " + std::to_string(m.units.size()) + " parameter units, this model " + std::to_string(s.zero.unit_count()));
  for (size_t k = 0; same_units && k < std::min(m.units.size(), s.zero.unit_count()); ++k)
    if (m.units[k].numel != s.zero.unit_numel(k))
      problems.push_back("unit \"" + m.units[k].name + "\" has " + std::to_string(m.units[k].numel) + " elements in the checkpoint, " + std::to_string(s.zero.unit_numel(k)) + " here");
  if (!problems.empty()) {
    c.key = "model";
    c.hint = "resume with the checkpoint's model settings; to start a different model from these weights, export them and use model.init_from";
    throw Error("checkpoint does not fit this model: " + join(problems, "; "), c);
  }
  const std::vector<std::string> states = s.optimizer.state_names();
  for (const auto& name : states)
    if (std::find(m.optimizer_states.begin(), m.optimizer_states.end(), name) == m.optimizer_states.end()) {
      c.key = "optimizer.kind";
      c.hint = "use the checkpoint's optimizer (" + m.optimizer + ")";
      throw Error("the checkpoint has no optimizer state \"" + name + "\" (it was written by " + m.optimizer + ")", c);
    }

  CheckpointReader reader(dir, m, /*verify_checksums=*/true);
  auto load_into = [&](const std::string& kind, size_t k, torch::Tensor& target) {
    const int64_t begin = s.zero.master_begin(k), count = std::min(target.numel(), s.zero.unit_numel(k) - begin);
    if (count <= 0) return;  // a shard of padding only
    std::vector<float> values(static_cast<size_t>(count));
    reader.read_unit(kind, k, begin, begin + count, values.data());
    target.narrow(0, 0, count).copy_(torch::from_blob(values.data(), {count}, torch::kFloat32));
  };
  if (same_units) {
    for (size_t k = 0; k < s.zero.unit_count(); ++k) {
      load_into("master", k, s.zero.shards()[k].master);
      for (const auto& name : states) load_into(name, k, s.optimizer.state(name, k));
    }
  } else {
    restore_whole_parameters(s, reader, states, c);
  }
  s.optimizer.set_steps_taken(m.optimizer_steps);

  // This rank's own state; on another world size, that of the old rank it maps to.
  const int source = rank % m.world_size;
  const SafetensorsFile& own = reader.rank_file(source);
  nlohmann::json rank_state = nlohmann::json::parse(own.metadata().count("dsrun.rank_state") ? own.metadata().at("dsrun.rank_state") : "{}", nullptr, false);
  if (rank_state.is_discarded() || !rank_state.is_object()) throw Error("rank state metadata unreadable in " + own.path(), c);
  auto read_tensor = [&](const SafetensorsEntry& e) {
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(torch_scalar_type(e.dtype)));
    own.read(e, 0, e.end - e.begin, t.data_ptr());
    return t;
  };
  for (auto& b : s.model.module().named_buffers()) {
    const SafetensorsEntry* e = own.find("buffer." + b.key());
    if (!e) throw Error("the checkpoint has no buffer " + b.key(), c);
    b.value().copy_(read_tensor(*e));
  }
  if (const SafetensorsEntry* e = own.find("rng.cpu"); e && source == rank) {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(read_tensor(*e));
  }
  if (s.scaler && rank_state.contains("loss_scaler")) {
    const auto& j = rank_state["loss_scaler"];
    s.scaler->restore({j.at("scale").get<double>(), j.at("hysteresis_left").get<int>(), j.at("clean_steps").get<int64_t>(), j.at("skipped").get<int64_t>()});
  }
  s.zero.publish_master();
  RestoredProgress p;
  p.step = m.step;
  p.hook_state = rank_state.value("hook_state", std::string());
  p.from_world = m.world_size;
  p.from_stage = m.zero_stage;
  return p;
}

void load_pretrained_weights(Model& model, const ModelSpec& spec, const std::string& path) {
  torch::NoGradGuard no_grad;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  if (is_directory(path)) {
    for (const auto& name : list_directory(path))
      if (ends_with(name, ".safetensors")) files.push_back(std::make_unique<SafetensorsFile>(path_join(path, name)));
  } else {
    files.push_back(std::make_unique<SafetensorsFile>(path));
  }
  ErrorContext c;
  c.file = path;
  c.key = "model.init_from";
  if (files.empty()) {
    c.hint = "point model.init_from at a .safetensors file or a directory holding some";
    throw Error("no .safetensors files found", c);
  }
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsEntry*>> index;
  for (const auto& f : files)
    for (const auto& e : f->entries()) index[e.name] = {f.get(), &e};

  std::vector<std::string> problems;
  std::map<std::string, bool> used;
  struct Copy {
    torch::Tensor target;
    const SafetensorsFile* file;
    const SafetensorsEntry* entry;
  };
  std::vector<Copy> copies;
  for (const auto& p : model.module().named_parameters()) {
    const std::vector<int64_t> shape = p.value().sizes().vec();
    for (const auto& piece : hf_pieces(p.key(), shape, spec)) {
      std::vector<int64_t> want = shape;
      if (!want.empty()) want[0] = piece.rows;
      auto it = index.find(piece.name);
      if (it == index.end()) {
        problems.push_back("missing " + piece.name + " (for " + p.key() + ")");
        continue;
      }
      used[piece.name] = true;
      if (it->second.second->shape != want) {
        problems.push_back(piece.name + " has shape [" + join_numbers(it->second.second->shape) + "], the model needs [" + join_numbers(want) + "]");
        continue;
      }
      copies.push_back({shape.empty() ? p.value() : p.value().narrow(0, piece.row_begin, piece.rows), it->second.first, it->second.second});
    }
  }
  for (const auto& [name, where] : index)
    if (!used.count(name) && !ends_with(name, "rotary_emb.inv_freq")) problems.push_back("unexpected " + name + " (not in this model)");
  if (!problems.empty()) {
    const size_t shown = std::min<size_t>(problems.size(), 20);
    std::string list;
    for (size_t i = 0; i < shown; ++i) list += "\n  " + problems[i];
    if (shown < problems.size()) list += "\n  ... and " + std::to_string(problems.size() - shown) + " more";
    c.hint = "the weights must match the model section (hidden, layers, heads, kv_heads, intermediate, vocab, moe.*)";
    throw Error(std::to_string(problems.size()) + " mismatch(es) between the weights and the model:" + list, c);
  }
  for (auto& copy : copies) {
    std::vector<float> values = copy.file->read_f32(*copy.entry, 0, copy.entry->numel());
    copy.target.copy_(torch::from_blob(values.data(), copy.target.sizes(), torch::kFloat32));
  }
}

}  // namespace dsrun
