// A rank's side of checkpoints: every rank writes the slices of master weights and optimizer states
// its ZeRO shards hold (one format for every layout) plus its own small state (scaler, RNG,
// buffers), synchronously or from a writer thread; rank 0 commits. Also the restore (any layout
// from any other, and from the two older formats) and initialising a model from safetensors.
#pragma once

#include "engine/checkpoint/checkpoint.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/train/loss_scaler.hpp"
#include "engine/train/optimizer.hpp"

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dsrun {

// The live training state a checkpoint captures (references; nothing is owned).
struct RankTrainingState {
  Model& model;
  ZeroDataParallel& zero;
  ShardOptimizer& optimizer;
  DynamicLossScaler* scaler;  // fp16 only
  DeviceMesh& mesh;           // the world saves; the tensor dimension says which slice of a parameter a rank holds
};

// Run-level facts the manifest records.
struct CheckpointRunFacts {
  std::string run_id;
  std::string config_toml;
  std::string dtype, optimizer;
  int zero_stage = 0;
  int64_t global_batch = 0;
  std::vector<DataFileIdentity> data_files;  // what the run reads
};

struct CheckpointSaveOptions {
  std::string root;           // where step_N/ directories go (checkpoint.dir)
  int64_t keep_last = 3, keep_every = 0;
  bool async = false;         // checkpoint.async: write from a thread while training goes on
};

struct SavedCheckpoint {
  std::string path;
  int64_t step = 0;
  std::string why;               // "interval", "end", "requested"
  uint64_t bytes = 0;            // all files of the checkpoint (rank 0; this rank's file elsewhere)
  std::string checksum;          // the manifest's, which lists every file's
  std::vector<std::string> removed;  // older checkpoints retention deleted
  bool async = false;
  double pause_seconds = 0;      // training stood still: the copy to staging, or the whole save when synchronous
  double waited_seconds = 0;     // of the pause, waiting for the previous save's write (saves closer than a write takes)
  double write_seconds = 0;      // from the end of the pause until this rank's part (rank 0: the commit) was done
};

// One rank's checkpoint saves. save() is collective (every rank, the same step); with async it
// returns once this rank's slices are copied to host staging memory (kept, and reused, between
// saves) and a writer thread writes them; the next save, or wait(), waits for it. Rank 0's writer
// commits the step when every rank's file is written (each leaves a small marker beside it), then
// applies retention. A failed write removes the step's directory and fails the run, naming the bytes.
class CheckpointSaver {
 public:
  CheckpointSaver(CheckpointSaveOptions options, int rank, int world);
  ~CheckpointSaver();  // abandons a write under way: its step stays incomplete, never "latest"
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  void save(RankTrainingState& s, const CheckpointRunFacts& facts, int64_t step, const std::string& hook_state, const std::string& why);
  // Asynchronous: allocates the staging memory now (pinning gigabytes takes seconds), so that the
  // first save pauses no longer than the others. Not collective.
  void reserve(RankTrainingState& s);
  // Saves that have finished since the last call, oldest first; rethrows a failed one's error.
  std::vector<SavedCheckpoint> finished();
  // Waits for the save under way, then as finished().
  std::vector<SavedCheckpoint> wait();

 private:
  struct Job;
  void run_job(Job& job);
  void commit(Job& job);
  [[noreturn]] void abandon(const Job& job);
  void collect();  // joins a finished or running writer into done_ / error_

  CheckpointSaveOptions o_;
  int rank_ = 0, world_ = 1;
  // Asynchronous saves: every slice's master and states, back to back, kept between saves (pinned
  // when copied from a GPU). Synchronous saves need none.
  torch::Tensor staging_;
  std::unique_ptr<Job> job_;
  std::thread writer_;
  std::atomic<bool> cancel_{false};
  std::mutex mutex_;
  std::vector<SavedCheckpoint> done_;
  std::exception_ptr error_;
};

struct RestoredProgress {
  int64_t step = 0;              // steps completed; training goes on with step + 1
  std::string hook_state;
  int from_world = 1, from_stage = 0, format_version = 3;
  uint64_t bytes_read = 0;       // by every rank
  double seconds = 0;
};

// Loads the checkpoint in `dir` into the live state, each rank reading the slices its shards hold
// (its tensor region of each parameter of its stage, the range within its ZeRO shard) by name,
// whatever layout wrote them, and publishes the weights to every rank. Collective.
RestoredProgress restore_checkpoint(RankTrainingState& s, const std::string& dir);

// model.init_from: copies Hugging Face-named safetensors weights (a file, or every .safetensors
// file of a directory) into the model before ZeRO takes it. Throws listing every mismatch.
void load_pretrained_weights(Model& model, const ModelSpec& spec, const std::string& path);

}  // namespace dsrun
