// Sharded checkpoints on disk: the layout (a directory per step, one safetensors file per rank, a
// manifest, a completion marker written last), verification, retention, and re-cutting shards for
// another world size. No torch: the launcher and `dsrun export` use it too.
#pragma once

#include "engine/checkpoint/safetensors.hpp"
#include "engine/common/tensor_region.hpp"
#include "engine/data/data_identity.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dsrun {

// The one format (version 3): every parameter is stored as slices, each a flat range of a region of
// it (tensor parallelism's part, TensorRegion) held by one rank's file, as PyTorch DCP stores
// sharded tensors. ZeRO's shard of a rank is such a range, so every layout writes its own slices
// without gathering and reads any other's by name. Versions 1 (flat ZeRO units cut into world-size
// slices) and 2 (whole parameters from model-parallel runs) are read into the same slices.
struct ParamSlice {
  int rank = 0;                // whose file holds it
  TensorRegion region;         // the part of the parameter the range is of
  int64_t begin = 0, end = 0;  // elements of the region, row-major
  std::string tensor;          // in the file: tensor "<tensor>.<kind>" (version 3: the parameter's name; 1-2: "unit3")
  int64_t tensor_offset = 0;   // element of that tensor where the slice starts
};

struct StoredParam {
  std::string name;            // the model's parameter name, "block0.attn.wqkv.weight"
  std::vector<int64_t> shape;  // the whole parameter's
  std::vector<ParamSlice> slices;
};

struct CheckpointFile {
  std::string name;            // "rank00001.safetensors", relative to the checkpoint directory
  int rank = 0;
  uint64_t bytes = 0;
  std::string checksum;        // "xxh3:..."
};

struct CheckpointManifest {
  int format_version = 3;
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
  std::vector<StoredParam> params;  // read from any version; written as version 3
  std::vector<CheckpointFile> files;
};

constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kCompleteMarker = "COMPLETE";

std::string checkpoint_dir_name(int64_t step);  // "step_00000100"
std::string rank_file_name(int rank);           // "rank00003.safetensors"
std::string slice_tensor_name(const std::string& tensor, const std::string& kind);  // "block0.norm.weight.master"
// Elements [begin, end) of an n-element flat unit that `rank` of `world` stores (ZeRO's shards).
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

// Reads parts of parameters from a checkpoint's rank files, whichever layout wrote them.
class CheckpointReader {
 public:
  // verify_checksums: each rank file's checksum is checked when it is first opened.
  CheckpointReader(std::string dir, CheckpointManifest manifest, bool verify_checksums = false);
  const CheckpointManifest& manifest() const { return m_; }
  const StoredParam* find(const std::string& name) const;
  // Elements [begin, end) of `region` of parameter p's tensor `kind` ("master" or an optimizer
  // state), row-major, into out[0, end - begin). Straight from the slices of the same region
  // when they cover the range; otherwise from the whole parameter, assembled.
  void read(const StoredParam& p, const std::string& kind, const TensorRegion& region, int64_t begin, int64_t end, float* out);
  std::vector<float> read_whole(const StoredParam& p, const std::string& kind = "master");
  // One rank's file, opened (and parsed) once.
  const SafetensorsFile& rank_file(int rank);
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  void read_slice(const StoredParam& p, const ParamSlice& s, const std::string& kind, int64_t begin, int64_t end, float* out);
  std::string dir_;
  CheckpointManifest m_;
  bool verify_ = false;
  std::map<int, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> by_name_;
  uint64_t bytes_read_ = 0;
};

}  // namespace dsrun
