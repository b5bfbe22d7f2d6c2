#include "engine/train/checkpointing.hpp"

#include "engine/checkpoint/export.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/parallel/copy_stream.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/train/fault_injection.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

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

// A full disk for the tests (engine/train/fault_injection.hpp): writes past the cap fail with
// EFBIG, as a full disk fails with ENOSPC.
void apply_test_file_size_limit(int64_t step) {
  const int64_t bytes = test_file_size_limit(step);
  if (bytes <= 0) return;
  std::signal(SIGXFSZ, SIG_IGN);  // an error return, not a killed process
  struct rlimit limit {static_cast<rlim_t>(bytes), static_cast<rlim_t>(bytes)};
  if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) fail_at(__FILE__, __LINE__, std::string("setrlimit: ") + std::strerror(errno));
}

bool disk_full(const Error& e) {
  const int n = e.context().system_errno;
  return n == ENOSPC || n == EDQUOT || n == EFBIG;
}

std::string join_numbers(const std::vector<int64_t>& v) {
  std::vector<std::string> parts;
  for (int64_t x : v) parts.push_back(std::to_string(x));
  return join(parts, ", ");
}

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

// ---- ZeRO's flat shards <-> the checkpoint's slices: the one place that knows both ----

// Each unit's parameter names, in ZeRO's order: the unit's own list, else (a ResNet's units name
// none) the model's names found by tensor identity (ZeRO swaps storage, never the tensors).
std::vector<std::vector<std::string>> unit_parameter_names(Model& model, const std::vector<ParameterUnit>& units) {
  std::map<const void*, std::string> by_tensor;
  for (const auto& p : model.module().named_parameters()) by_tensor[p.value().unsafeGetTensorImpl()] = p.key();
  std::vector<std::vector<std::string>> names;
  for (const ParameterUnit& u : units) {
    names.push_back(u.names);
    if (u.names.size() == u.params.size()) continue;
    names.back().clear();
    for (const torch::Tensor& t : u.params) names.back().push_back(by_tensor.at(t.unsafeGetTensorImpl()));
  }
  return names;
}

// A parameter's elements that a rank's flat shard of unit `unit` holds (master and every
// optimizer state alike): elements [begin, end) of `region`, this rank's tensor-parallel part of
// the whole parameter, found from `shard_offset` of the shard.
struct ShardPiece {
  size_t unit = 0;
  std::string name;
  std::vector<int64_t> whole_shape;
  TensorRegion region;
  int64_t begin = 0, end = 0;
  int64_t shard_offset = 0;
};

enum class PieceUse {
  Write,  // each element once in the whole checkpoint: replicas split the writing
  Read,   // everything this rank's shards hold
};

// A unit's elements are written by the ranks its shards are spread over (unit_group), rank g of
// G writing checkpoint_slice(numel, G, g): its own shard at ZeRO stages 1-3 (ZeRO pads each unit
// to G equal shards, the same cut), an equal share of the replica at stage 0. Of a parameter that
// tensor parallelism replicates, tensor rank 0 writes; of the rest, each tensor rank its region.
std::vector<ShardPiece> shard_pieces(RankTrainingState& s, PieceUse use) {
  Communicator& tensor = s.mesh.along(MeshDim::Tensor);
  const std::vector<ParameterUnit> units = s.model.parameter_units();  // ZeRO's order
  DSRUN_ASSERT(units.size() == s.zero.units().size(), "ZeRO holds the model's units");
  const std::vector<std::vector<std::string>> names = unit_parameter_names(s.model, units);
  std::vector<ShardPiece> pieces;
  for (size_t k = 0; k < units.size(); ++k) {
    const int64_t numel = s.zero.units().numel(k), shard_begin = s.zero.units().master_begin(k);
    const int64_t shard_end = std::min(numel, shard_begin + s.zero.shards()[k].master.numel());
    int64_t lo = shard_begin, hi = shard_end;
    if (use == PieceUse::Write) {
      Communicator& group = s.zero.units().group(k);
      std::tie(lo, hi) = checkpoint_slice(numel, group.world_size(), group.rank());
      DSRUN_ASSERT(lo >= hi || (lo >= shard_begin && hi <= shard_end), "a rank writes only what its shard holds");
    }
    for (size_t i = 0; i < units[k].params.size(); ++i) {
      const TensorSplit split = i < units[k].splits.size() ? units[k].splits[i] : TensorSplit{};
      const bool replicated = split.kind == TensorSplit::Replicated || tensor.world_size() == 1;
      if (use == PieceUse::Write && replicated && tensor.rank() != 0) continue;
      const std::vector<int64_t>& local_shape = s.zero.units().shape(k, i);
      const int64_t offset = s.zero.units().offsets(k)[i];
      const int64_t a = std::max(lo, offset), b = std::min(hi, offset + element_count(local_shape));
      if (a >= b) continue;
      ShardPiece p;
      p.unit = k;
      p.name = names[k][i];
      p.whole_shape = tensor_whole_shape(local_shape, split, tensor.world_size());
      p.region = tensor_region(p.whole_shape, split, tensor.rank(), tensor.world_size());
      p.begin = a - offset;
      p.end = b - offset;
      p.shard_offset = a - shard_begin;
      pieces.push_back(std::move(p));
    }
  }
  return pieces;
}

torch::Tensor shard_of(RankTrainingState& s, const std::string& kind, size_t unit) {
  return kind == "master" ? s.zero.shards()[unit].master : s.optimizer.state(kind, unit);
}

nlohmann::json pieces_json(const std::vector<ShardPiece>& pieces, int rank) {
  nlohmann::json out = nlohmann::json::array();
  for (const ShardPiece& p : pieces) {
    nlohmann::json ranges = nlohmann::json::array();
    for (const auto& [b, n] : p.region.ranges) ranges.push_back({b, n});
    out.push_back({{"name", p.name}, {"shape", p.whole_shape}, {"rank", rank}, {"dim", p.region.dim}, {"ranges", ranges}, {"begin", p.begin}, {"end", p.end}});
  }
  return out;
}

// Every rank's written pieces -> the manifest's parameters, in the order of first appearance.
std::vector<StoredParam> stored_params(const std::vector<std::string>& per_rank) {
  std::vector<StoredParam> params;
  std::map<std::string, size_t> index;
  for (const std::string& text : per_rank)
    for (const auto& p : nlohmann::json::parse(text)) {
      const std::string name = p.at("name").get<std::string>();
      auto [it, added] = index.emplace(name, params.size());
      if (added) params.push_back({name, p.at("shape").get<std::vector<int64_t>>(), {}});
      ParamSlice sl;
      sl.rank = p.at("rank").get<int>();
      sl.region.dim = p.at("dim").get<int>();
      for (const auto& r : p.at("ranges")) sl.region.ranges.push_back({r.at(0).get<int64_t>(), r.at(1).get<int64_t>()});
      sl.begin = p.at("begin").get<int64_t>();
      sl.end = p.at("end").get<int64_t>();
      sl.tensor = name;
      params[it->second].slices.push_back(std::move(sl));
    }
  return params;
}

std::string written_marker_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank%05d.written", rank);
  return buf;
}

}  // namespace

// ---- saving ----

// What a writer needs, captured at the end of the pause: it reads staging memory and nothing live.
struct CheckpointSaver::Job {
  std::string dir;
  int64_t step = 0;
  std::string why;
  bool async = false;
  SafetensorsWriter file;              // points into staging and into `small`
  std::vector<torch::Tensor> small;    // buffers and RNG state, copied
  uint64_t checkpoint_bytes = 0;       // the slices' bytes over every rank, for a full disk's message
  CheckpointManifest manifest;         // rank 0: everything but the files
  SavedCheckpoint result;
};

CheckpointSaver::CheckpointSaver(CheckpointSaveOptions options, int rank, int world) : o_(std::move(options)), rank_(rank), world_(world) {}

CheckpointSaver::~CheckpointSaver() {
  cancel_ = true;
  if (writer_.joinable()) writer_.join();
}

void CheckpointSaver::collect() {
  if (writer_.joinable()) writer_.join();
  job_.reset();
}

std::vector<SavedCheckpoint> CheckpointSaver::finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::exchange(done_, {});
}

std::vector<SavedCheckpoint> CheckpointSaver::wait() {
  collect();
  return finished();
}

namespace {

// Asynchronous saves: the staging buffer, large enough for this rank's slices (grown, never
// shrunk), pinned when they come from a GPU (slow to allocate, fast to copy into).
void ensure_staging(torch::Tensor& staging, RankTrainingState& s, const std::vector<std::string>& kinds, const std::vector<ShardPiece>& pieces) {
  int64_t total = 0;
  bool from_device = false;
  for (const std::string& kind : kinds)
    for (const ShardPiece& p : pieces) {
      const torch::Tensor shard = shard_of(s, kind, p.unit);
      DSRUN_ASSERT(shard.is_contiguous() && shard.dim() == 1, "ZeRO shards are flat");
      total += p.end - p.begin;
      from_device |= shard.is_cuda();
    }
  if (staging.defined() && staging.numel() >= total) return;
  // Pinned exactly (cudaHostRegister): the caching pinned allocator rounds a block up to a power
  // of two, 10.5 GiB to 16 (measured on the 1B's end-of-run save, 17.0 GiB RSS against 11.8 planned).
  staging = from_device ? pinned_host_tensor(std::max<int64_t>(total, 1), torch::kFloat32) : torch::empty({std::max<int64_t>(total, 1)}, torch::kFloat32);
  // Kept between saves: touched now, so that the first save does not pay its page faults.
  if (!staging.is_pinned()) staging.zero_();
}

std::vector<std::string> state_kinds(RankTrainingState& s) {
  std::vector<std::string> k{"master"};
  for (const auto& name : s.optimizer.state_names()) k.push_back(name);
  return k;
}

}  // namespace

void CheckpointSaver::reserve(RankTrainingState& s) {
  if (o_.async) ensure_staging(staging_, s, state_kinds(s), shard_pieces(s, PieceUse::Write));
}

void CheckpointSaver::save(RankTrainingState& s, const CheckpointRunFacts& facts, int64_t step, const std::string& hook_state, const std::string& why) {
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  collect();  // one save at a time: the staging memory is the previous one's until it is written
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  Communicator& comm = s.mesh.world();
  auto job = std::make_unique<Job>();
  job->dir = path_join(o_.root, checkpoint_dir_name(step));
  job->step = step;
  job->why = why;
  job->async = o_.async;
  make_directories(job->dir);
  // What an earlier attempt at this step left (its marker, the ranks' notes) stops existing first.
  if (rank_ == 0) {
    std::remove(path_join(job->dir, kCompleteMarker).c_str());
    for (int r = 0; r < world_; ++r) std::remove(path_join(job->dir, written_marker_name(r)).c_str());
    sync_directory(job->dir);
  }
  comm.barrier();

  // Stage: this rank's slices of the master weights and every optimizer state, back to back.
  s.zero.offload().wait_host_update();  // offload: the host step is done with the states
  const std::vector<std::string> kinds = state_kinds(s);
  const std::vector<ShardPiece> pieces = shard_pieces(s, PieceUse::Write);
  if (o_.async) ensure_staging(staging_, s, kinds, pieces);
  bool from_device = false;
  int64_t at = 0;
  for (const std::string& kind : kinds)
    for (const ShardPiece& p : pieces) {
      const int64_t n = p.end - p.begin;
      torch::Tensor src = shard_of(s, kind, p.unit).narrow(0, p.shard_offset, n);
      // Synchronous: nothing moves while the rank writes, so host shards are written where they
      // are and a GPU's slices are copied down one at a time as the file is written.
      // (states kept in bf16 are written in fp32 too: converted as they are copied)
      if (!o_.async && (src.is_cuda() || src.scalar_type() != torch::kFloat32)) {
        job->file.add(slice_tensor_name(p.name, kind), "F32", {n}, [src, n](char* out) { torch::from_blob(out, {n}, torch::kFloat32).copy_(src); });
        continue;
      }
      if (!o_.async) {
        job->file.add(slice_tensor_name(p.name, kind), "F32", {n}, src.data_ptr());
        continue;
      }
      torch::Tensor dst = staging_.narrow(0, at, n);
      dst.copy_(src, /*non_blocking=*/src.is_cuda());
      from_device |= src.is_cuda();
      job->file.add(slice_tensor_name(p.name, kind), "F32", {n}, dst.data_ptr());
      at += n;
    }
  // Per-rank state: buffers (BatchNorm statistics are not synchronised across ranks) and RNG.
  auto add_small = [&](const std::string& name, const torch::Tensor& t) {
    torch::Tensor c = t.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    job->small.push_back(c);
    job->file.add(name, safetensors_dtype(c.scalar_type()), c.sizes().vec(), c.data_ptr());
  };
  for (const auto& b : s.model.module().named_buffers()) add_small("buffer." + b.key(), b.value());
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    add_small("rng.cpu", generator.get_state());
  }
#ifdef DSRUN_WITH_CUDA
  if (from_device) torch::cuda::synchronize();  // the copies to pinned staging memory have landed
#endif
  nlohmann::json rank_state = {{"rank", rank_}, {"world_size", world_}, {"step", step}, {"optimizer_steps", s.optimizer.steps_taken()}, {"hook_state", hook_state}};
  if (s.scaler) {
    LossScalerState st = s.scaler->state();
    rank_state["loss_scaler"] = {{"scale", st.scale}, {"hysteresis_left", st.hysteresis_left}, {"clean_steps", st.clean_steps}, {"skipped", st.skipped}, {"retried", st.retried}};
  }
  job->file.set_metadata("format", "dsrun-rank-state");
  job->file.set_metadata("dsrun.rank_state", rank_state.dump());

  // The manifest's parameters: every rank's slices, gathered once per save (a few KiB).
  const std::vector<StoredParam> params = stored_params(all_gather_strings(comm, pieces_json(pieces, rank_).dump()));
  for (const StoredParam& p : params)
    for (const ParamSlice& sl : p.slices) job->checkpoint_bytes += static_cast<uint64_t>(sl.end - sl.begin) * 4 * kinds.size();
  if (rank_ == 0) {
    CheckpointManifest& m = job->manifest;
    m.run_id = facts.run_id;
    m.step = step;
    m.samples_seen = step * facts.global_batch;
    m.world_size = world_;
    m.zero_stage = facts.zero_stage;
    m.dtype = facts.dtype;
    m.optimizer = facts.optimizer;
    m.optimizer_states = s.optimizer.state_names();
    m.optimizer_steps = s.optimizer.steps_taken();
    m.created_at = static_cast<double>(std::time(nullptr));
    m.config_toml = facts.config_toml;
    m.data_files = facts.data_files;
    m.params = params;
  }
  job->result.pause_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  job->result.waited_seconds = waited;
  apply_test_file_size_limit(step);

  job_ = std::move(job);
  if (o_.async) {
    writer_ = std::thread([this] {
      try {
        run_job(*job_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
      }
    });
    return;
  }
  run_job(*job_);
  comm.barrier();  // nobody goes on (or reports success) before the checkpoint exists
  job_->result.pause_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(mutex_);
  done_.back().pause_seconds = job_->result.pause_seconds;
}

// Another rank's write failed and removed the step's directory. Its error says why, so this rank
// waits to be stopped rather than race it to the launcher with a vaguer one ("cannot rename").
void CheckpointSaver::abandon(const Job& job) {
  for (int i = 0; i < 300 && !cancel_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  throw Error("checkpoint at step " + std::to_string(job.step) + " abandoned: another rank's write failed (its error says why)");
}

// Rank 0, once every rank's file is written (each leaves a note with its size and checksum):
// the manifest, then the marker.
void CheckpointSaver::commit(Job& job) {
  CheckpointManifest& m = job.manifest;
  SavedCheckpoint& saved = job.result;
  saved.bytes = 0;
  for (int r = 0; r < world_; ++r) {
    const std::string marker = path_join(job.dir, written_marker_name(r));
    while (!file_exists(marker)) {
      if (cancel_) throw Error("checkpoint at step " + std::to_string(job.step) + " abandoned: the rank is stopping");
      if (!is_directory(job.dir)) abandon(job);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const nlohmann::json j = nlohmann::json::parse(read_file(marker));
    m.files.push_back({rank_file_name(r), r, j.at("bytes").get<uint64_t>(), j.at("checksum").get<std::string>()});
    saved.bytes += m.files.back().bytes;
  }
  saved.checksum = commit_checkpoint(job.dir, m);
  for (int r = 0; r < world_; ++r) std::remove(path_join(job.dir, written_marker_name(r)).c_str());
}

void CheckpointSaver::run_job(Job& job) {
  const auto t0 = std::chrono::steady_clock::now();
  SavedCheckpoint& saved = job.result;
  saved.path = job.dir;
  saved.step = job.step;
  saved.why = job.why;
  saved.async = job.async;
  // Whatever fails to be written (a rank's file, its note, the manifest) takes the step's files
  // with it: the previous checkpoint stays the latest. A full disk says what it needed.
  try {
    const WrittenFile written = job.file.write_atomic(path_join(job.dir, rank_file_name(rank_)));
    saved.bytes = written.bytes;
    if (fault_requested(Fault::CrashInSave, rank_, job.step)) ::raise(SIGKILL);
    write_file_atomic(path_join(job.dir, written_marker_name(rank_)), nlohmann::json{{"bytes", written.bytes}, {"checksum", written.checksum}}.dump());
    if (rank_ == 0) commit(job);
  } catch (const Error& e) {
    // A file or the directory gone from under this rank's write: another rank removed the step.
    const bool removed_by_another = !is_directory(job.dir) || e.context().system_errno == ENOENT;
    // The cleanup's own failure is told beside the cause, never instead of it.
    std::string removed = "Its partial files were removed";
    bool cleaned = true;
    try {
      remove_tree(job.dir);
    } catch (const Error& cleanup) {
      cleaned = false;
      removed = std::string("Its partial files could not all be removed (") + cleanup.what() + ")";
    }
    if (!disk_full(e) && removed_by_another) abandon(job);
    if (!disk_full(e) && cleaned) throw;
    if (!disk_full(e)) throw Error(std::string(e.what()) + ". " + removed, e.context());
    std::string latest = "none";
    for (const CheckpointInfo& c : list_checkpoints(o_.root))
      if (c.complete) latest = "step " + std::to_string(c.step);
    ErrorContext c;
    c.file = o_.root;
    c.key = "checkpoint.dir";
    c.rank = rank_;
    c.hint = "free space there, point checkpoint.dir at a larger disk, or lower checkpoint.keep_last; then `dsrun resume` continues from " + latest;
    throw Error("checkpoint at step " + std::to_string(job.step) + " did not fit: " + e.what() + ". It needs " + format_bytes(static_cast<double>(job.checkpoint_bytes)) +
                    " in all; " + format_bytes(free_disk_bytes(o_.root)) + " is free. " + removed + "; the newest complete checkpoint is " + latest,
                c);
  }
  if (rank_ == 0) {
    // Retention only now that a newer checkpoint is complete.
    for (const auto& old : checkpoints_to_remove(list_checkpoints(o_.root), o_.keep_last, o_.keep_every)) {
      remove_tree(old);
      saved.removed.push_back(old);
    }
  }
  saved.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(mutex_);
  done_.push_back(saved);
}

// ---- restoring ----

RestoredProgress restore_checkpoint(RankTrainingState& s, const std::string& dir) {
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  Communicator& world = s.mesh.world();
  const int rank = world.rank();
  CheckpointManifest m = read_checkpoint(dir, /*verify_files=*/false);
  ErrorContext c;
  c.file = path_join(dir, kManifestFile);
  c.rank = rank;
  const std::vector<std::string> states = s.optimizer.state_names();
  for (const auto& name : states)
    if (std::find(m.optimizer_states.begin(), m.optimizer_states.end(), name) == m.optimizer_states.end()) {
      c.key = "optimizer.kind";
      c.hint = "use the checkpoint's optimizer (" + m.optimizer + ")";
      throw Error("the checkpoint has no optimizer state \"" + name + "\" (it was written by " + m.optimizer + ")", c);
    }
  CheckpointReader reader(dir, m, /*verify_checksums=*/true);

  // The model must be the one that was saved: every parameter of this rank's units there with its
  // whole shape, and nothing there that no rank's model has (a removed layer, a head the model
  // now ties to its embedding, silently dropped otherwise). Every rank holds only its own stage's
  // units, so the names are gathered: every rank then sees, and reports, the same.
  Communicator& tensor = s.mesh.along(MeshDim::Tensor);
  const std::vector<ParameterUnit> units = s.model.parameter_units();
  const std::vector<std::vector<std::string>> names = unit_parameter_names(s.model, units);
  std::vector<std::string> problems;
  std::string mine;
  for (size_t k = 0; k < units.size(); ++k)
    for (size_t i = 0; i < names[k].size(); ++i) {
      const std::string& name = names[k][i];
      mine += name + "\n";
      const TensorSplit split = i < units[k].splits.size() ? units[k].splits[i] : TensorSplit{};
      const std::vector<int64_t> whole = tensor_whole_shape(s.zero.units().shape(k, i), split, tensor.world_size());
      const StoredParam* p = reader.find(name);
      if (!p) problems.push_back("no parameter " + name);
      else if (p->shape != whole || !tensor_split_problem(p->shape, split, tensor.world_size()).empty())
        problems.push_back(name + " has shape [" + join_numbers(p->shape) + "] in the checkpoint, this model [" + join_numbers(whole) + "]");
    }
  std::set<std::string> in_model;
  for (const std::string& names : all_gather_strings(world, mine)) {
    std::istringstream lines(names);
    for (std::string name; std::getline(lines, name);) in_model.insert(name);
  }
  for (const StoredParam& p : m.params)
    if (!in_model.count(p.name)) problems.push_back("unexpected " + p.name + " (in the checkpoint, not in this model)");
  if (!problems.empty()) {
    c.key = "model";
    c.hint = "resume with the checkpoint's model settings; to start a different model from these weights, export them and use model.init_from";
    throw Error("checkpoint does not fit this model: " + join(problems, "; "), c);
  }

  std::vector<std::string> kinds{"master"};
  kinds.insert(kinds.end(), states.begin(), states.end());
  std::vector<float> values;
  for (const ShardPiece& piece : shard_pieces(s, PieceUse::Read)) {
    const StoredParam& p = *reader.find(piece.name);
    const int64_t n = piece.end - piece.begin;
    values.resize(static_cast<size_t>(n));
    for (const std::string& kind : kinds) {
      reader.read(p, kind, piece.region, piece.begin, piece.end, values.data());
      shard_of(s, kind, piece.unit).narrow(0, piece.shard_offset, n).copy_(torch::from_blob(values.data(), {n}, torch::kFloat32));
    }
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
    if (!e && ends_with(b.key(), "moe.expert_bias")) {
      ErrorContext bias = c;
      bias.key = "model.moe.balance";
      bias.hint = "the checkpoint was written with balance = \"aux_loss\": resume with that, or export it and start a new run from its weights (model.init_from)";
      throw Error("the checkpoint has no MoE selection bias (" + b.key() + ")", bias);
    }
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
    // ("retried": since 2026-11-27; earlier checkpoints had no retries)
    s.scaler->restore({j.at("scale").get<double>(), j.at("hysteresis_left").get<int>(), j.at("clean_steps").get<int64_t>(), j.at("skipped").get<int64_t>(),
                       j.value("retried", int64_t{0})});
  }
  s.zero.publish_master();
  torch::Tensor bytes = torch::tensor({static_cast<int64_t>(reader.bytes_read())}, torch::kInt64);
  world.all_reduce_sum(bytes);  // also: every rank has read its part
  RestoredProgress p;
  p.step = m.step;
  p.hook_state = rank_state.value("hook_state", std::string());
  p.from_world = m.world_size;
  p.from_stage = m.zero_stage;
  p.format_version = m.format_version;
  p.bytes_read = static_cast<uint64_t>(bytes.item<int64_t>());
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
      if (piece.copy) {  // (DeepSeek-V3's copies of the embedding and head in its MTP layer: the first copy is read)
        if (it != index.end()) used[piece.name] = true;
        continue;
      }
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
  // Buffers that are model state (the MoE selection bias): taken when the weights have them, else
  // they keep their initial values (weights trained with the balance loss have none).
  for (const auto& b : model.module().named_buffers()) {
    const std::string name = hf_buffer_name(b.key(), spec);
    auto it = index.find(name);
    if (name.empty() || it == index.end()) continue;
    used[it->first] = true;
    if (it->second.second->shape != b.value().sizes().vec()) {
      problems.push_back(it->first + " has shape [" + join_numbers(it->second.second->shape) + "], the model needs [" + join_numbers(b.value().sizes().vec()) + "]");
      continue;
    }
    copies.push_back({b.value(), it->second.first, it->second.second});
  }
  // FP8 weights (DeepSeek-V3's release) carry their 128 x 128 blocks' scales beside them: checked
  // here with the rest, before any weight is written into the model.
  for (const Copy& copy : copies) {
    if (copy.entry->dtype != "F8_E4M3") continue;
    const std::string scale = copy.entry->name + "_scale_inv";
    if (index.count(scale)) used[scale] = true;
    else problems.push_back(copy.entry->name + " is FP8 (F8_E4M3) and has no " + scale + " beside it (copy the *_scale_inv tensors along, or convert the weights to bf16 first)");
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
    std::vector<float> values;
    if (copy.entry->dtype == "F8_E4M3") {
      const auto& scale = index.at(copy.entry->name + "_scale_inv");  // (its presence checked above)
      values = read_fp8_blockwise(*copy.file, *copy.entry, *scale.first, *scale.second);
    } else {
      values = copy.file->read_f32(*copy.entry, 0, copy.entry->numel());
    }
    copy.target.copy_(torch::from_blob(values.data(), copy.target.sizes(), torch::kFloat32));
  }
}

}  // namespace dsrun
