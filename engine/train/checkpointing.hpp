// A rank's side of checkpoints: every rank writes its slice of the master weights and optimizer
// states (tensor- and pipeline-parallel runs: whole parameters, gathered) plus its own small state
// (scaler, RNG, buffers); rank 0 commits the manifest. Also the restore (any layout from any
// other) and initialising a model from safetensors weights.
#pragma once

#include "engine/checkpoint/checkpoint.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/train/loss_scaler.hpp"
#include "engine/train/optimizer.hpp"

#include <string>
#include <vector>

namespace dsrun {

// The live training state a checkpoint captures (references; nothing is owned).
struct RankTrainingState {
  Model& model;
  ZeroDataParallel& zero;
  ShardOptimizer& optimizer;
  DynamicLossScaler* scaler;  // fp16 only
  DeviceMesh& mesh;           // the world saves and commits; model-parallel runs gather along data and tensor
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

struct SavedCheckpoint {
  std::string path;
  int64_t step = 0;
  uint64_t bytes = 0;            // all files of the checkpoint
  std::string checksum;          // the manifest's, which lists every file's
  std::vector<std::string> removed;  // older checkpoints retention deleted
};

// Collective: every rank calls it at the same step. Returns the result on every rank.
SavedCheckpoint save_checkpoint(RankTrainingState& s, const CheckpointRunFacts& facts, const std::string& root, int64_t step,
                                const std::string& hook_state, int64_t keep_last, int64_t keep_every);

struct RestoredProgress {
  int64_t step = 0;              // steps completed; training goes on with step + 1
  std::string hook_state;
  int from_world = 1, from_stage = 0;
};

// Loads the checkpoint in `dir` into the live state (re-cutting shards when the world size or
// ZeRO stage differs; cutting each parameter to this rank's tensor slice and pipeline stage when
// either layout is model-parallel) and publishes the weights to every rank. Collective.
RestoredProgress restore_checkpoint(RankTrainingState& s, const std::string& dir);

// model.init_from: copies Hugging Face-named safetensors weights (a file, or every .safetensors
// file of a directory) into the model before ZeRO takes it. Throws listing every mismatch.
void load_pretrained_weights(Model& model, const ModelSpec& spec, const std::string& path);

}  // namespace dsrun
