// Sharded checkpoints on disk: the layout (a directory per step, one safetensors file per rank, a
// manifest, a completion marker written last), verification, retention, and re-cutting shards for
// another world size. No torch: the launcher and `dsrun export` use it too.
#pragma once

#include "engine/checkpoint/safetensors.hpp"
#include "engine/data/data_identity.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dsrun {

// A checkpoint stores every flat unit of parameter space (as ZeRO lays it out) cut into world-size
// slices: rank r holds elements [r * ceil(n / world), ...) of each unit, whatever the ZeRO stage.
// That layout is the same for stage 0 and 3, so a checkpoint loads into any stage and any world size.
// Tensor- and pipeline-parallel runs store one unit per parameter, each whole (its full shape,
// whatever slices the ranks held) in the file of the rank that gathered it: `slices` says where.
// Either way every parameter is logical, so any layout resumes from any other.
struct CheckpointParam {
  std::string name;            // the model's parameter name, "block0.attn.wqkv.weight"
  std::vector<int64_t> shape;
  int64_t offset = 0;          // first element within the unit
};

struct CheckpointSlice {
  int rank = 0;                // whose file holds elements [begin, end) of the unit
  int64_t begin = 0, end = 0;
};

struct CheckpointUnit {
  std::string name;            // "embedding", "block 3", "head"
  int64_t numel = 0;
  std::vector<CheckpointParam> params;
  std::vector<CheckpointSlice> slices;  // empty: checkpoint_slice(numel, world_size, r) in rank r's file
};

struct CheckpointFile {
  std::string name;            // "rank00001.safetensors", relative to the checkpoint directory
  int rank = 0;
  uint64_t bytes = 0;
  std::string checksum;        // "xxh3:..."
};

struct CheckpointManifest {
  int format_version = 1;
  std::string run_id;
  int64_t step = 0;            // optimizer steps completed; training continues with step + 1
  int64_t samples_seen = 0;    // the data position: the next sample index is samples_seen
  int world_size = 1;
  int zero_stage = 0;
  std::string dtype;           // compute dtype; the stored weights are the fp32 master copy
  std::string optimizer;       // "adamw", "adam", "sgd"
  std::vector<std::string> optimizer_states;  // per-element states stored beside "master"
  int64_t optimizer_steps = 0;  // Adam's t (differs from step when fp16 skipped steps)
  double created_at = 0;
  std::string config_toml;     // the resolved config the ranks ran
  std::vector<DataFileIdentity> data_files;  // what the run read, to refuse a resume whose data changed (empty: not recorded)
  std::vector<CheckpointUnit> units;
  std::vector<CheckpointFile> files;
};

constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kCompleteMarker = "COMPLETE";

std::string checkpoint_dir_name(int64_t step);  // "step_00000100"
std::string rank_file_name(int rank);           // "rank00003.safetensors"
std::string unit_tensor_name(size_t unit, const std::string& kind);  // "unit3.master"
// Elements [begin, end) of an n-element unit that `rank` of `world` stores.
std::pair<int64_t, int64_t> checkpoint_slice(int64_t numel, int world, int rank);

std::string manifest_to_json(const CheckpointManifest& m);
CheckpointManifest manifest_from_json(const std::string& text, const std::string& path);

// Rank 0, once every rank's file is written: the manifest, then the marker holding its checksum.
// Until the marker exists the checkpoint does not. Returns the manifest's checksum.
std::string commit_checkpoint(const std::string& dir, const CheckpointManifest& m);

struct CheckpointInfo {
  int64_t step = 0;
  std::string path;
  bool complete = false;  // has its marker
};
// Every step directory under `root`, oldest first (incomplete ones too).
std::vector<CheckpointInfo> list_checkpoints(const std::string& root);

// The manifest of a complete checkpoint. Throws naming the file and step when the marker is
// missing, the manifest does not match it, or (verify_files) a file is missing, truncated or corrupt.
CheckpointManifest read_checkpoint(const std::string& dir, bool verify_files);

// The newest complete checkpoint under `root` at or before `max_step` (-1: any). With `fallback`,
// checkpoints that fail verification are skipped and why goes into `skipped`; without, they throw.
std::optional<CheckpointInfo> find_checkpoint(const std::string& root, int64_t max_step, bool fallback, std::vector<std::string>* skipped = nullptr);

// Retention: the newest `keep_last` complete checkpoints stay, and every one whose step is a
// multiple of `keep_every` (> 0); incomplete ones older than the newest complete one go too.
std::vector<std::string> checkpoints_to_remove(const std::vector<CheckpointInfo>& all, int64_t keep_last, int64_t keep_every);

// Reads ranges of units from a checkpoint's rank files, whichever world size wrote them.
class CheckpointReader {
 public:
  // verify_checksums: each rank file's checksum is checked when it is first opened.
  CheckpointReader(std::string dir, CheckpointManifest manifest, bool verify_checksums = false);
  const CheckpointManifest& manifest() const { return m_; }
  // Elements [begin, end) (clipped to the unit) of tensor `kind` of unit `unit` into out[0, end - begin).
  void read_unit(const std::string& kind, size_t unit, int64_t begin, int64_t end, float* out);
  // One rank's file, opened (and parsed) once.
  const SafetensorsFile& rank_file(int rank);
  // A parameter's full value (or optimizer state `kind`), gathered from the slices that hold it.
  std::vector<float> read_param(size_t unit, const CheckpointParam& p, const std::string& kind = "master");

 private:
  std::string dir_;
  CheckpointManifest m_;
  bool verify_ = false;
  std::map<int, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace dsrun
