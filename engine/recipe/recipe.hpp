// The validated recipe: plain structs with every default filled in and every unit converted
// (bytes, FLOP/s). Built only by the loader after validation; downstream code asserts, never re-checks.
#pragma once

#include "engine/recipe/kinds.hpp"
#include "engine/recipe/model_spec.hpp"

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dsrun {

struct RunOptions {
  std::string name;
  std::string description;
  std::vector<std::string> tags;
  uint64_t seed = 1234;
  int64_t steps = 100;
  int max_restarts = 0;
  double step_timeout_s = 600;
  double startup_timeout_s = 0;  // 0: "auto", the plan's Plan::startup_timeout_seconds
  std::string time_limit;        // a batch job's limit as Slurm reads it ("" : the partition's default)
  int64_t time_limit_minutes = 0;
};

// `dsrun run --slurm`: what the plan cannot know about the cluster.
struct SlurmOptions {
  std::string partition, account, qos, constraint;
  std::vector<std::string> sbatch;  // further #SBATCH options
};

// Slurm's --time forms: "M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S" -> whole minutes (rounded
// up, as Slurm does); nullopt when the text is none of them or is zero.
std::optional<int64_t> parse_time_limit_minutes(const std::string& text);

// The collectives' names (kinds.hpp) feed the schema, the loader, the probe and the plan.
inline constexpr const auto& kCollectives = EnumNames<Collective>::table;
// Its probed key, "hardware.all_reduce_gbs", and its name in words, "all-reduce".
inline std::string collective_key(Collective op) { return "hardware." + std::string(to_string(op)) + "_gbs"; }
inline std::string collective_words(Collective op) {
  std::string words = to_string(op);
  for (char& ch : words) ch = ch == '_' ? '-' : ch;
  return words;
}

// What `dsrun probe` measured of a node's collectives: bus bandwidth (nccl-tests' busbw: the bytes
// each rank moves over the time) for each group size, with every group of that size in the node
// running at once, as a layout's groups do. Empty: the plan takes link_bandwidth × comm_efficiency.
struct CollectiveBandwidths {
  std::vector<int> ranks;                            // group sizes measured, ascending
  std::array<std::vector<double>, 4> bus_bandwidth;  // bytes/s, indexed by Collective, one per group size (or empty)
  double point_to_point = 0;                         // bytes/s each way between two devices, every pair at once; 0: not probed
  // The bus bandwidth of `op` over `group` ranks of a node: the figure of the largest group size
  // measured that is not larger (the smallest measured for smaller groups); 0 when not probed.
  double of(Collective op, int group) const {
    const std::vector<double>& v = bus_bandwidth[static_cast<size_t>(op)];
    if (v.empty()) return 0;
    size_t i = 0;
    while (i + 1 < ranks.size() && ranks[i + 1] <= group) ++i;
    return v[i];
  }
};

struct HardwareSpec {
  std::string name;
  Device device = Device::Cpu;
  int nodes = 1;
  int devices_per_node = 1;
  double memory_bytes = 0;        // per device; for cpu, the node's memory shared by its ranks
  double host_memory_bytes = 0;   // per node
  double peak_flops_fp32 = 0;     // per device, FLOP/s
  double peak_flops_bf16 = 0;     // 0: unsupported
  double peak_flops_fp16 = 0;
  double peak_flops_fp8 = 0;  // dense FP8 tensor cores (fp32 accumulation); 0: none
  double memory_bandwidth = 0;    // bytes/s
  std::string link;               // shm | pcie | nvlink | ethernet | infiniband
  double link_bandwidth = 0;      // bytes/s per device per direction
  bool p2p = true;
  double inter_node_bandwidth = 0;
  double host_link_bandwidth = 0;
  double disk_write_bandwidth = 0;  // under checkpoint.dir, per node (bytes/s)
  double disk_read_bandwidth = 0;   // the same, read from disk (bytes/s)
  double host_optimizer_bandwidth = 0;  // the offloaded step's bytes touched per second, per node; 0: host_memory_bandwidth
  double host_step_beside_compute = 1.7;  // the delayed update's host step beside the GPU's compute, over its time alone
  double host_memory_bandwidth = 0;
  double matmul_efficiency = 0.5;
  double grouped_matmul_efficiency = 0.6;  // GPUs: the routed experts' grouped products, fraction of peak
  double attention_efficiency = 0;         // GPUs: the attention kernels, fraction of peak; 0: matmul_efficiency
  double fp8_matmul_efficiency = 0.6;      // GPUs: scaled FP8 products, fraction of peak_flops_fp8
  double fp8_grouped_matmul_efficiency = 0.34;  // GPUs: the routed experts' grouped scaled FP8 products, likewise
  double comm_efficiency = 0.8;
  double network_efficiency = 0.8;   // of inter_node_bandwidth: the network's own, not the node link's (comm_efficiency)
  CollectiveBandwidths collectives;  // probed; empty: link_bandwidth × comm_efficiency
  // GPUs: of a collective that runs beside compute (gradient reductions in backward, ZeRO-3's
  // gathers), the share of its time the step still pays, NCCL's kernels taking SMs and memory
  // bandwidth from the products beside them (probed).
  double overlap_cost = 1;
  double runtime_memory_bytes = 0;
  double host_runtime_memory_bytes = 0;  // a GPU rank process's own host memory
  double host_build_memory_bytes = 0;    // the same while it builds the model, before NCCL and the CUDA libraries grow it
  double host_nccl_memory_bytes = 0;     // NCCL's host side, in a GPU rank of a job of several ranks
  double fragmentation = 0.05;

  int total_devices() const { return nodes * devices_per_node; }
  bool ranks_share_memory() const { return device == Device::Cpu; }
};

struct ParallelOptions {
  std::optional<int> data_parallel;  // nullopt: auto (the devices left by tensor parallelism)
  int tensor = 1;                    // tensor-parallel ranks (innermost mesh dimension)
  bool tensor_across_nodes = false;  // allow a tensor group to span nodes (refused otherwise: its traffic is every layer's)
  bool sequence_parallel = false;    // activations between tensor-parallel regions split along the sequence
  int pipeline = 1;                  // pipeline stages (outermost mesh dimension)
  PipelineScheduleKind pipeline_schedule = PipelineScheduleKind::OneFOneB;
  int virtual_stages = 1;            // model chunks per pipeline rank (interleaved schedule)
  int expert = 1;                    // expert-parallel ranks, within the data-parallel ones (divides data_parallel)
  double expert_imbalance = 1.25;    // planning: the busiest expert rank's routed tokens over the mean
  int context = 1;                   // ranks splitting each sequence (context parallelism)
  int ranks_per_replica() const { return tensor * pipeline * context; }  // ranks one data-parallel replica spans
  // Keys given as "auto": the plan searches these dimensions of the layout (engine/plan/layout_search);
  // until then the values above are placeholders (1, 1f1b, 1, off, 1).
  struct Searched {
    bool tensor = false, pipeline = false, schedule = false, virtual_stages = false, sequence_parallel = false, expert = false, context = false;
    bool any() const { return tensor || pipeline || schedule || virtual_stages || sequence_parallel || expert || context; }
  };
  Searched search;
  int data_parallel_or_auto(const HardwareSpec& h) const;
  std::optional<int> zero_stage;     // nullopt: auto
  Offload offload = Offload::None;
  bool offload_auto = false;    // "auto": the least offload that fits (make_plan); `offload` is then a placeholder (none)
  bool delayed_update = false;  // offload: the host step of step t runs beside step t+1 (docs/plan.md)
  Checkpointing activation_checkpointing = Checkpointing::None;
  double bucket_bytes = 25e6;
};

struct LossScaleOptions {
  int initial_power = 16;
  int64_t window = 1000;
  int hysteresis = 2;
  double min_scale = 1;
  int overflow_retries = 8;  // runs again on the same batch at half the scale before a skip
};

struct PrecisionOptions {
  DType dtype = DType::Fp32;
  // Gradients accumulated over micro-batches and reduced over ranks in this dtype; nullopt: auto
  // (the plan decides: ExecutionModes::gradient_dtype).
  std::optional<DType> grad_dtype;
  Fp8Scaling fp8 = Fp8Scaling::None;  // the blocks' linear layers' products (bf16 outputs, fp32 accumulation)
  LossScaleOptions loss_scale;
};

struct BatchOptions {
  int64_t global = 8;
  std::optional<int64_t> micro;  // nullopt: auto
  int64_t seq_len = 128;
  // Decoders: tokens whose logits exist at once in the fused output projection + cross-entropy;
  // 0: whole logits (the projection, then the loss); nullopt: auto (loss_chunk_tokens()).
  std::optional<int64_t> loss_chunk_tokens;
};

// A chunk's fp32 logits under batch.loss_chunk_tokens = "auto": small beside a model's activations,
// large enough that each chunk's products run at full speed. (The plan may take a whole micro-batch
// in one chunk instead, where that fits: engine/plan/plan_choice.cpp, choose_layout.)
constexpr double kAutoLossChunkBytes = 256.0 * 1024 * 1024;
// ... and at least this many tokens: the head's weight gradient is summed chunk by chunk, and its
// products over fewer rows run well below speed (on an H100, V2-Lite's 102,400-entry vocabulary
// in 655-token chunks cost 5.5% of its step against 2,048-token ones).
constexpr int64_t kAutoLossChunkMinTokens = 2048;
// Tokens per loss chunk for a rank holding `local_vocab` of the vocabulary (0: not fused), before
// the plan's choice: the chunk a run uses is its plan's (Plan::loss_chunk_tokens).
int64_t loss_chunk_tokens(const BatchOptions& batch, int64_t local_vocab);

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::AdamW;
  double lr = 3e-4;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double momentum = 0.9;
  bool nesterov = false;
  double grad_clip = 1.0;  // 0: off
  // Every per-element state (Adam's m and v, SGD's momentum) in fp32, or in bf16 (DeepSeek-V3):
  // updated in fp32, rounded to nearest as stored. Checkpoints keep them in fp32 either way.
  DType state_dtype = DType::Fp32;
};

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::Cosine;
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.1;
  std::vector<double> milestones{0.8, 0.9};
  std::vector<double> factors{0.316, 0.1};
  double decay_fraction = 0.1;
  double pct_start = 0.25;
  double div_factor = 25;
  double final_div_factor = 1e4;
};

struct DataOptions {
  DataKind kind = DataKind::Synthetic;
  std::string path;  // resolved against the recipe's directory
  std::string tokenizer = "bytes";
  double val_fraction = 0.05;
  bool shuffle = true;
  // tokens: a mixture of sources (paths, resolved) with weights, instead of `path`.
  std::vector<std::string> blend;
  std::vector<double> blend_weights;
  std::string val_path;                 // tokens: validation source; empty: each file's tail
  TokenFormat format = TokenFormat::Auto;
  int token_width = 0;                  // nanoGPT's headerless files
  int64_t document_token = -1;          // llm.c/nanoGPT document separator; -1: the format's
  bool separate_documents = false;      // positions restart and attention stays in each document
  bool augment = false;                 // images: random crop (4-pixel zero padding) and flip
};

// A mixture takes at most this many sources (a directory is one source): the blend table is u16.
constexpr size_t kMaxBlendSources = 4096;

// What is wrong with a mixture of `sources` with these weights (empty: equal), every problem: one
// check for the recipe (each at its line) and the corpus (data/token_source.cpp: the first thrown, for callers without one).
struct MixtureProblem {
  std::string key, message, hint;
  std::vector<std::string> related;  // other keys the problem involves
};
std::vector<MixtureProblem> mixture_problems(size_t sources, const std::vector<double>& weights);

struct EvalOptions {
  int64_t every = 0;
  int64_t batches = 4;
};

struct CheckpointOptions {
  int64_t every = 0;
  int64_t keep_last = 3;
  int64_t keep_every = 0;
  std::string dir;
  bool at_end = true;
  bool async = false;      // resolved: written by the user, else true on GPUs
  bool async_set = false;  // the recipe or command line wrote it (else the plan may choose synchronous)
};

struct LoggingOptions {
  int64_t every = 1;
  std::string level = "info";
  bool tensorboard = true;
  bool progress = true;
};

struct HookOptions {
  std::string script;  // resolved against the recipe's directory; empty: no hooks
  HookErrorPolicy on_error = HookErrorPolicy::Fail;
  int64_t instruction_limit = 10000000;
  double time_limit_seconds = 10;
  double memory_limit_bytes = 64e6;
  std::map<std::string, std::string> options;  // key -> value as TOML text
};

// [execution]: how a step executes where the plan and the engine must agree
// (execution_modes.hpp). A mode absent here is "auto", the plan's to decide; false turns it off.
// The launcher pins the plan's decisions for the ranks.
struct ExecutionOptions {
  std::map<std::string, bool> forced;  // by ExecutionModeRow::name
};

struct Recipe {
  std::string path;  // the recipe file ("" for text given directly)
  RunOptions run;
  HardwareSpec hardware;
  ModelSpec model;
  ParallelOptions parallel;
  PrecisionOptions precision;
  BatchOptions batch;
  OptimizerOptions optimizer;
  ScheduleOptions schedule;
  DataOptions data;
  EvalOptions eval;
  CheckpointOptions checkpoint;
  LoggingOptions logging;
  HookOptions hooks;
  SlurmOptions slurm;
  ExecutionOptions execution;
};

// The model sizes tensor parallelism splits, each of which its degree must divide: the recipe's
// errors and the layout search read this one table.
struct TensorSplitSize {
  const char* key;   // "model.heads"
  int64_t value;
  const char* why;   // "each rank computes whole attention heads"
};
std::vector<TensorSplitSize> tensor_split_sizes(const ModelSpec& m);

// The divisor of n closest to `near`, for fixes such as "use a divisor of 4096 such as 32".
int64_t closest_divisor(int64_t n, int64_t near);

int bytes_per_element(DType d);

}  // namespace dsrun
