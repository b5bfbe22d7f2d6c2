// Recipe -> Plan: the concrete distributed plan (ranks, batch math, memory per rank by component,
// communication, predicted speed, verdict). A pure function of the recipe and the host facts.
#pragma once

#include "engine/common/host.hpp"
#include "engine/plan/cost.hpp"
#include "engine/recipe/layout.hpp"
#include "engine/recipe/execution_modes.hpp"
#include "engine/recipe/recipe.hpp"

#include <optional>
#include <string>
#include <vector>

namespace dsrun {

// Bytes one rank holds for model states (ZeRO paper's accounting), on the device and on the host.
struct ModelStateBytes {
  double params = 0, grads = 0, master = 0, optimizer = 0;  // on the device
  double host = 0;                                         // offloaded to host memory
  double device_total() const { return params + grads + master + optimizer; }
  ModelStateBytes& operator+=(const ModelStateBytes& o) {
    params += o.params, grads += o.grads, master += o.master, optimizer += o.optimizer, host += o.host;
    return *this;
  }
};

struct ModelStateOptions {
  double params = 0;  // Ψ
  int data_parallel = 1;
  int zero_stage = 0;
  DType dtype = DType::Fp32;
  std::optional<DType> grad_dtype;  // the gradient buffer's and its host staging's (ExecutionModes::gradient_dtype); nullopt: dtype
  OptimizerKind optimizer = OptimizerKind::AdamW;
  double momentum = 0.9;  // SGD: 0 keeps no momentum buffer
  DType state_dtype = DType::Fp32;  // optimizer.state_dtype: each state's bytes per parameter
  Offload offload = Offload::None;
  bool same_memory = false;  // CPU ranks: host and device are one memory (the parameters are written in place)
  bool delayed_update = false;  // offload: a second gradient staging buffer, and a separate upload buffer
};
ModelStateBytes plan_model_states_per_rank(const ModelStateOptions& o);

struct MemoryBreakdown {
  ModelStateBytes states;
  double routed_expert_states = 0;  // of `states` (device and host): the routed experts this rank keeps
  double activations = 0;   // one micro-batch in flight
  double backward_peak = 0; // transient gradients at the start of backward (the logits')
  double comm_buffers = 0;  // gradient buckets, ZeRO-3 gathered layers
  double runtime = 0;       // CUDA context, NCCL, libraries
  double fragmentation = 0; // allocator slack
  // One GPU rank at ZeRO 0-2 (ZeroOptions::gradients_left_to_autograd): of states.grads, what is not
  // yet held at the activations' peak. Autograd makes the gradients as backward frees activations,
  // so the peak is the larger of the two, not their sum.
  double gradients_after_peak = 0;
  // execution.cuda_graphs with evaluation: the graph's pool keeps the step's peak between steps, so
  // an evaluation's forward (its largest piece: the head's logits) comes on top of it.
  double evaluation_beside_graph = 0;
  // CPU ranks: of comm_buffers, the gradients' reductions that take memory backward has freed from
  // the activations, so the peak is the larger of the two, not their sum (plan_memory.cpp).
  double comm_after_peak = 0;
  // What a step holds at its peak beyond the model states: activations, backward's transient and
  // the buffers (less the reductions that reuse freed activations).
  double step_transients() const { return activations + backward_peak + comm_buffers - comm_after_peak; }
  double total() const {
    return states.device_total() - gradients_after_peak + step_transients() + evaluation_beside_graph + runtime + fragmentation;
  }
};

// What one rank holds in host memory. On CPU ranks host and device are one memory: `device` is
// then the whole MemoryBreakdown, and the process is its runtime term.
struct HostMemory {
  double process = 0;      // a GPU rank process itself (hardware.host_runtime_memory_gib)
  double offloaded = 0;    // offloaded model states (MemoryBreakdown::states.host)
  double model_build = 0;  // transient while ZeRO builds the model: one unit's fp32 initial values
  double data = 0;         // the token stream, at the peak of loading (16 bytes per token)
  double device = 0;       // CPU ranks: MemoryBreakdown::total(), less what the build overlaps
  double checkpoint_staging = 0;  // checkpoint.async: this rank's share of a checkpoint, copied there and kept between saves
  double total() const { return process + offloaded + model_build + data + device + checkpoint_staging; }
};

struct CommTerm {
  std::string collective;  // "all-reduce gradients"
  double bytes = 0;        // sent per rank per step
  double seconds = 0;
  // Runs beside compute on GPUs (gradient reductions during backward, ZeRO-3's gathers) rather
  // than between the operations that need it (tensor, pipeline, expert) or after the step.
  bool beside_compute = false;
};

// What one rank of a pipeline stage holds (every rank, without a pipeline).
struct StageMemory {
  double model_state_bytes = 0;  // parameters, gradients, master and optimizer states (device and host)
  double device_bytes = 0;       // MemoryBreakdown::total() of the stage
  double host_bytes = 0;         // HostMemory::total() of the stage
};

// A value dsrun chose because the recipe said "auto", with why.
struct AutoChoice {
  std::string key;
  std::string value;
  std::string reason;
};

// One layout the search considered (parallel.* = "auto", `dsrun plan --layouts`), with what its
// plan predicts and why it was or was not chosen.
// Disk for checkpoints: what one takes (every rank's file: the fp32 master weights and optimizer
// states), how many the retention keeps at once over the run, against the free space there.
struct CheckpointDisk {
  double bytes = 0;     // one checkpoint, all ranks
  int64_t saves = 0;    // over run.steps: every checkpoint.every steps, and at the end
  int64_t kept = 0;     // at most on disk at once: keep_last (+1 while a new one is written) and the keep_every ones
  double needed = 0;    // kept x bytes
  double free = -1;     // under checkpoint.dir (or the store's directory); -1: not known here
  bool async = false;   // checkpoint.async
  double staging_per_rank = 0;  // a rank's share, copied to host memory at each save
  bool staging_pinned = false;  // copied from GPU memory (pinned staging); else from host memory (CPU ranks, offload)
  double copy_seconds = 0;      // that copy (device to host, or host to host)
  double write_seconds = 0;     // a node's share written at hardware.disk_write_gbs
  double read_seconds = 0;      // a resume reading a node's share back at hardware.disk_read_gbs
  double pause_seconds = 0;     // training stands still per save: the copy (async), or copy and write
};

struct LayoutRow {
  Layout layout;        // the ZeRO stage, micro batch and recomputation its plan chose
  std::string problem;  // why it cannot run at all ("" when it can); the numbers below are then 0
  bool fits = false;
  std::string binds;    // what does not fit: "device memory", "host memory" ("" when it fits)
  double memory_bytes = 0, capacity = 0, host_bytes = 0, host_capacity = 0;
  double step_seconds = 0, mfu = 0, bubble_fraction = 0, exposed_comm_seconds = 0;
  std::string verdict;  // "chosen", or why it loses
  std::string describe() const { return layout.describe(); }
};

struct Plan {
  std::string recipe;    // recipe path
  std::string hardware;  // hardware.name
  std::string model;     // model.name
  Device device = Device::Cpu;
  ModelArch arch = ModelArch::DeepSeek;

  // topology: the chosen layout (degrees, schedule, ZeRO stage, micro batch, recomputation, offload)
  Layout layout;
  int nodes = 1, devices_per_node = 1, world_size = 1, ranks_per_node = 1;
  double expert_imbalance = 1;  // planned: the busiest expert rank's tokens over the mean
  // The model's units (pipeline numbering: embedding, blocks, head) cut into stages × virtual
  // stages pieces [begin, end), balanced by FLOPs; rank r of the pipeline runs pieces r, r + stages, ...
  std::vector<std::pair<int, int>> pipeline_pieces;
  double bubble_fraction = 0;   // the pipeline's idle share of a step
  std::string pipeline_problem; // why the schedule cannot run ("" when it can)
  int memory_stage = 0;         // the pipeline stage `memory` describes: the one with the most to hold
  double live_micro_batches = 1;  // whose activations that stage holds at once
  std::vector<StageMemory> stage_memory;  // per pipeline stage (one entry without a pipeline); `memory` is stage memory_stage's

  // batch math: global = layout.micro × accumulation × layout.data
  int64_t global_batch = 0, accumulation = 0, seq_len = 0;
  double tokens_per_step = 0;  // samples per step for images

  DType dtype = DType::Fp32;
  Fp8Scaling fp8 = Fp8Scaling::None;  // precision.fp8
  double fp8_quantization_seconds = 0;  // of elementwise_seconds: its operands' quantisation
  AttentionKernel attention = AttentionKernel::Flash;
  // data.separate_documents: attention within documents, by the variable-length kernel (GPUs in
  // fp16/bf16) or a mask; what share of whole rows' attention the documents leave (measured).
  std::string document_attention;  // "" without separate documents, else "variable-length" or "masked"
  double attention_fraction = 1;
  ExecutionModes modes;            // how each step executes (the fused loss's chunk among them), decided here and pinned for the ranks

  ModelCost cost;
  MemoryBreakdown memory;       // per rank, on the device
  double memory_capacity = 0;   // per rank
  HostMemory host;                  // per rank
  double host_memory_needed = 0;    // per node: host.total() × ranks per node
  double host_memory_capacity = 0;  // per node
  bool fits = false;
  std::string binds;  // what does not fit: "device memory", "host memory", "the pipeline schedule" ("" when it fits)

  std::vector<CommTerm> comm;
  double comm_seconds = 0, exposed_comm_seconds = 0;
  // GPUs: what the collectives beside compute still cost it (hardware.overlap_cost of the hidden part).
  double comm_slowdown_seconds = 0;

  double peak_flops = 0;                 // per device, for the dtype
  double hardware_flops_per_step = 0;    // all ranks, recomputation included
  double model_flops_per_step = 0;       // all ranks, the MFU numerator
  double compute_seconds = 0, optimizer_seconds = 0, offload_seconds = 0;
  // GPUs: memory-bound work beside the matrix products (the cross-entropy over the vocabulary,
  // MoE layers' token permutation), at hardware.memory_bandwidth.
  double elementwise_seconds = 0;
  double offload_hidden_seconds = 0;     // of optimizer + offload: what runs beside the device's compute (negative: the delayed update's host step, slowed beside compute, adds that much)
  double step_seconds = 0, tokens_per_second = 0, mfu = 0, total_seconds = 0;
  // Launch to the first step: run.startup_timeout_s, or for "auto" 120 s plus the model's build
  // (or weights read) and the data at 0.5 GB/s. The launcher and the ranks' rendezvous use it.
  double startup_timeout_seconds = 0;
  int64_t steps = 0;
  CheckpointDisk checkpoint_disk;

  std::vector<AutoChoice> choices;
  std::vector<LayoutRow> layouts;        // the best layouts searched, the chosen first (empty: nothing was "auto")
  int64_t layouts_searched = 0;          // all candidates; those past `layouts` are left out of the plan
  std::vector<std::string> verdict;      // why it fits or not
  std::vector<std::string> suggestions;  // what would fit instead
  std::vector<std::string> notes;        // assumptions worth seeing

  bool hardware_present = true;   // does this machine have the recipe's devices?
  std::string hardware_message;
};

// The plan: the recipe's layout, or for "auto" layout keys the fastest searched layout that fits
// (engine/plan/make_plan.cpp; the search in layout_search.cpp plans each candidate with the planner below).
Plan make_plan(const Recipe& recipe, const HostFacts& host);

// The planner (engine/plan/planner.hpp and its files) for fixed degrees: it chooses the ZeRO stage, micro batch
// and recomputation left "auto", simulates the pipeline schedule and suggests what would fit.
Plan plan_fixed_layout(const Recipe& recipe, const HostFacts& host);
// For the layout search: one candidate's plan without the schedule simulation or suggestions,
// with what it reads of the data already measured (planned_data).
struct PlannedData {
  double bytes = -1;               // the data set as the ranks load it
  double attention_fraction = -1;  // separate documents: the share of whole rows' attention computed
};
PlannedData planned_data(const Recipe& recipe);
Plan plan_candidate(const Recipe& recipe, const HostFacts& host, const PlannedData& data);

// Every layout of the recipe's hardware for the keys it leaves "auto" (all five with
// every_key), each planned once; the fastest that fits first, then the slower, then those that
// do not fit, then the impossible.
struct LayoutSearch {
  std::vector<LayoutRow> rows;
  int64_t left_out = 0;  // candidates not listed: more pipeline stages than the model has layers
  std::string note;      // what the search changed from the recipe to find a layout that fits, if anything
};
LayoutSearch search_layouts(const Recipe& recipe, const HostFacts& host, bool every_key = false);

std::string render_plan(const Plan& plan);  // the readable table
std::string render_layouts(const LayoutSearch& search, const Recipe& recipe);  // `dsrun plan --layouts`
std::string layouts_to_json(const LayoutSearch& search);
std::string plan_to_json(const Plan& plan); // the same, for machines

}  // namespace dsrun
