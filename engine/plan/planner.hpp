// The planner for one layout's degrees, shared by its files: memory (plan_memory.cpp), the choice of
// ZeRO stage, micro batch and recomputation (plan_choice.cpp), time (plan_time.cpp), the plan (plan.cpp).
#pragma once

#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"
#include "engine/recipe/execution_modes.hpp"
#include "engine/recipe/layout.hpp"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

// Private to engine/plan/: make_plan and its search reach it through plan.hpp's functions.
namespace dsrun::planning {

// What the planner chooses for a fixed set of degrees: the ZeRO stage, recomputation, micro batch.
struct Choice {
  int stage = 0;
  bool checkpointing = false;
  int64_t micro = 1;
};

struct Evaluation {
  int stage = 0;           // the pipeline stage with the most to hold (0 without pipeline parallelism)
  MemoryBreakdown memory;
  HostMemory host;         // per rank
  double host_needed = 0;  // per node
  bool device_fits = false, host_fits = false;
  bool fits = false;
  std::string binds() const { return !device_fits ? "device memory" : !host_fits ? "host memory" : ""; }
};

// Bytes of the data set as the ranks load it (int64 tokens of text, or fp32 images), at the peak of
// loading: the whole stream twice; token files are mapped, not loaded. Reads file sizes (docs/plan.md).
double data_bytes(const Recipe& r, int64_t seq_len);

// With data.separate_documents, the share of a whole row's causal attention that attention within
// documents computes: the mean over rows of Σ document² / seq_len², measured on up to 256 rows
// spread over the corpus (the variable-length kernel skips the rest). 1 without separate documents,
// and where the corpus cannot be read yet (planning before `dsrun prepare`): an upper bound.
double document_attention_fraction(const Recipe& r);

// What each pipeline stage holds and computes (one stage, the whole model, without a pipeline).
struct StageCost {
  double rank_params = 0;         // after tensor parallelism's split, without the routed experts
  double rank_expert_params = 0;  // the routed experts one rank keeps (1/ep of them, split by tp)
  double flops_per_sample = 0, routed_flops_per_sample = 0;
  double activation_bytes_per_sample = 0, routed_activation_bytes_per_sample = 0, checkpointed_activation_bytes_per_sample = 0;
  int moe_layers = 0;
  int layers = 0;  // transformer blocks
  bool has_head = false, has_blocks = false;
  bool tied_head_copy = false;  // tied embeddings: the head's copy of the embedding (not in ZeRO)
  double attention_flops_per_sample = 0;  // of flops_per_sample
  double largest_param = 0;  // elements of the stage's largest parameter, whole (before tensor parallelism's split)
  double fp8_flops_per_sample = 0, fp8_params = 0, fp8_widths = 0;  // the FP8 linear layers' (ModelCost::Unit)
  // Of fp8_params, those of units without routed experts: under ZeRO-3 only their gathered weights are
  // freed after forward (a MoE unit's bf16 router and grouped experts keep views of its gathered buffer).
  double fp8_params_dense_units = 0;
  double fp8_activation_saving_per_token = 0;
  // The routed experts' parameters one rank computes with (its 1/ep, split by tp), with or without
  // expert parallelism: what execution.fp8_routed_experts quantises each micro-batch and keeps in FP8.
  double local_routed_params = 0;
};

// A candidate of the layout search is planned without its schedule's simulation or suggestions
// (the chosen layout gets both), on the data size measured once.
struct PlanningOptions {
  bool full = true;
  double data_bytes = -1;          // < 0: measure
  double attention_fraction = -1;  // < 0: measure (document_attention_fraction)
};

class Planner {
 public:
  Planner(const Recipe& r, const HostFacts& host, PlanningOptions options = {});
  Plan plan();  // the whole plan: layout choices, memory, communication, time, verdict

 private:
  // ---- memory (plan_memory.cpp): what a rank holds under a choice, per pipeline stage

  // What one rank keeps of `units`: tensor parallelism splits every weight but the norms and the
  // MoE routers over tp ranks; expert parallelism keeps 1/ep of the routed experts (apart: ZeRO
  // shards them over the dp/ep ranks keeping the same ones).
  void add_units(StageCost& st, int begin, int end) const;

  // Pipeline parallelism: the units (pipeline numbering) cut into stages × virtual stages pieces
  // of balanced FLOPs; rank r runs pieces r, r + stages, ... Without it, one stage: the model.
  void split_into_stages();

  // Micro-batches whose activations a stage holds at once (in whole stages' worth): 1F1B keeps up
  // to p - s on stage s, GPipe all of them; interleaving's warm-up holds (p-s-1)·2 + (v-1)·p + 1
  // chunks of 1/v each (Narayanan et al. 2021; pipeline_schedule's simulation agrees, in its tests).
  double live_micro_batches(int64_t accumulation, int stage) const;

  // The idle share of a pipeline step: (p-1)/(m+p-1), interleaved (p-1)/(v·m+p-1).
  double bubble_fraction(int64_t accumulation) const;

  // The stage that needs the most memory decides.
  Evaluation evaluate(const Choice& l) const;

  Evaluation evaluate_stage(const Choice& l, int stage) const;

  // Every host byte a rank holds (docs/plan.md): its process, offloaded states, the model build's
  // transient, the data; on CPU ranks the device terms too. The build runs before training: on
  // CPU ranks only what it needs beyond training's transients adds to the peak.
  HostMemory host_memory(const MemoryBreakdown& m, const StageCost& st) const;

  double rank_total(const Evaluation& ev) const {
    return ev.memory.total() + (r_.hardware.ranks_share_memory() ? ev.memory.states.host : 0);
  }

  // ---- the plan's checks (plan.cpp)

  // The schedule the ranks will run, simulated before launch as their transport runs it (Gloo's
  // queued sends on CPU ranks; NCCL's in-order rendezvous, each group of sends and receives
  // issued together, on GPUs): every receive meets its send and nothing waits forever.
  void check_pipeline(Plan& p);

  // ---- choice (plan_choice.cpp): ZeRO stage, recomputation, micro batch, loss chunk; suggestions

  // These degrees with a choice: the value the rules check and the ranks run.
  Layout layout_with(const Choice& c) const;
  // Whether the layout rules (engine/recipe/layout.cpp) allow a choice: the planner picks only what
  // the ranks will accept.
  bool allowed(const Choice& c, bool stage_decided = true, bool micro_decided = true) const;

  std::vector<int> stage_candidates() const;
  std::vector<bool> checkpointing_candidates() const;
  std::vector<int64_t> micro_candidates() const;

  std::string usage(const Evaluation& ev) const {
    return format_bytes(rank_total(ev)) + " of " + format_bytes(capacity_);
  }

  void choose_layout(Plan& p);
  // A choice and whether anything fits with it (when not, the most the rules allow is shown).
  struct Chosen {
    Choice choice;
    bool fits = false;
  };
  // 1. The lowest ZeRO stage (and recomputation only if needed) that fits the smallest micro-batch.
  Chosen choose_stage_and_recomputation(Plan& p, int64_t smallest_micro);
  // 2. The largest micro-batch that fits under that layout; a pipeline's smallest (least bubble).
  int64_t choose_micro(Plan& p, const Chosen& c, const std::vector<int64_t>& micros);
  // 3. A micro-batch's whole logits in one loss chunk, where that is small and still fits.
  void choose_loss_chunk(Plan& p, const Chosen& c);
  Evaluation settle(Plan& p, const Choice& chosen);
  void memory_verdict(Plan& p, const Evaluation& ev) const;

  // ---- the checkpoint's disk (plan_memory.cpp)

  // A checkpoint is every parameter's fp32 master copy and optimizer states, once over all ranks
  // (each rank writes its slice). One that cannot fit on the disk is refused before launch; the
  // ones the retention keeps at once not fitting is said.
  double checkpoint_bytes() const;
  int extra_communicators() const;  // NCCL communicators past the two host_nccl_memory covers
  int64_t checkpoint_saves() const;

  void plan_checkpoint_disk(Plan& p);

  // ---- suggestions (plan_choice.cpp)

  // What would fit instead: the least invasive changes first, then more devices.
  void suggest(Plan& p, const Choice& current, const Evaluation& now);

  // Host memory binds: the key that says how much a node has, fewer ranks per node, and (below)
  // any layout change that holds less on the host.
  void suggest_host(Plan& p, const Evaluation& now) const;

  // ---- time (plan_time.cpp): communication priced by where each group sits, compute, offload

  // The parameters of one rank's ZeRO shards: its share of the rest over the data ranks, and of
  // its routed experts over the ranks keeping the same ones (shards are padded, never uneven).
  double shard_params() const {
    return std::ceil(rank_params_ / degrees_.data_ranks()) + std::ceil(rank_expert_params_ / (degrees_.data_ranks() / degrees_.expert));
  }

  // ---- context parallelism (plan_memory.cpp)

  // Tokens of each sequence a rank holds: all of them, or its context share.
  double rank_sequence() const { return static_cast<double>(r_.batch.seq_len) / degrees_.context; }
  // Keys and values per token in elements, over every tensor rank's heads: what a layer gathers
  // from its context group (multi-head and grouped-query attention: the KV heads; latent
  // attention: each head's key and value, as the layer makes them) and what its attention keeps
  // for backward over the whole sequence (every query head's: grouped-query heads repeated).
  struct ContextKvWidth {
    double gathered = 0, kept = 0;
  };
  ContextKvWidth context_kv_width() const;
  // Of the scores a sample's attention would compute over the whole sequence, the share the
  // context ranks compute together: each chunk against the chunks up to its own, (2c+1)/(4c).
  double context_score_share() const { return (2.0 * degrees_.context + 1) / (4.0 * degrees_.context); }

  // Where a group's members sit decides its price (docs/plan.md, "The network"): a group inside
  // one node runs at the bus bandwidth `dsrun probe` measured for its collective and size, else at
  // the device link × comm_efficiency (halved without GPU peer-to-peer: copies go through host
  // memory); a group that spans nodes at the smaller of that and each rank's share of its node's
  // network link. Ranks sit on nodes in rank order (the launcher's placement).
  struct GroupLink {
    double bandwidth = 0;  // bytes/s a member sends at
    int nodes = 1;         // nodes the group spans
  };
  double link_share() const;
  // `op` over `members` ranks of one node.
  double intra_node_bandwidth(Collective op, int members) const;
  double point_to_point_bandwidth() const;
  // A node's network link shared by its ranks, at the network's own efficiency (not the node
  // link's comm_efficiency, which a probed template measures on NVLink or PCIe).
  double inter_node_share() const { return r_.hardware.inter_node_bandwidth / placement_.ranks_per_node * r_.hardware.network_efficiency; }
  // A mesh dimension's group of rank 0 (ranks 0, stride, ..., count of them) running `op`.
  GroupLink group_link(Collective op, int64_t stride, int64_t count) const;
  static std::string where(const GroupLink& g) { return g.nodes > 1 ? "across " + std::to_string(g.nodes) + " nodes" : "within a node"; }

  void predict_communication(Plan& p);
  // Its terms: ZeRO's collectives over a group of data ranks, the experts' all-to-all, the tensor
  // group's activations, the pipeline's sends; then overlap and the offload's host-link traffic.
  void add_data_parallel_terms(Plan& p, double params, int ranks, int64_t stride, const std::string& of) const;
  void add_expert_terms(Plan& p) const;
  void add_tensor_terms(Plan& p) const;
  void add_context_terms(Plan& p) const;
  void add_pipeline_terms(Plan& p) const;
  void price_overlap(Plan& p) const;
  void price_offload_traffic(Plan& p) const;

  double peak_flops() const;

  double compute_seconds(Plan& p) const;

  // The offload pipeline (docs/plan.md): gradients come down unit by unit during the last
  // micro-batch's backward; the host step starts once their norm is known and runs unit by unit in
  // forward order, each unit's parameters going up as soon as they are written, and the next
  // step's first micro-batch waits for each unit in its forward (so that forward, and no more,
  // overlaps the host step's tail). The delayed update runs the whole host step beside the next
  // step's compute instead. ZeRO-3 parameter fetches from the host are prefetched a unit ahead:
  // hidden behind compute where they take less time than it.
  double hidden_offload_seconds(const Plan& p, double shard, double e) const;

  // The most MoE layers a pipeline stage holds (every layer without pipelining).
  int busiest_stage_moe_layers() const;

  // Memory-bound work the FLOPs leave out, on GPUs (on CPUs matmul_efficiency absorbs it), per
  // rank: the cross-entropy converts its slice of the logits to fp32 and runs log-softmax forward
  // and backward, about 24 + 2e bytes per token and vocabulary entry; a MoE layer moves each
  // token's k rows through dispatch, the experts' return to pair order and the weighted sum, about
  // 14·k·h·e bytes per token forward and backward (docs/plan.md; measured in docs/benchmarks.md).
  double elementwise_seconds(const Plan& p) const;
  double fp8_quantization_seconds(const Plan& p) const;
  double fp8_routed_quantization_bytes(const Plan& p, double tokens) const;

  void predict_time(Plan& p);

  // ---- the plan's last checks and notes (plan.cpp)

  void check_hardware_present(Plan& p);

  void add_notes(Plan& p);

  // ---- what every part reads: the recipe, the degrees, the model's cost, the stages

  const Recipe& r_;
  HostFacts host_;
  PlanningOptions options_;
  double data_bytes_ = 0;
  Layout degrees_;  // the recipe's degrees, all fixed here (the search fixed them); choices come from layout_with
  double imbalance_ = 1;  // expert parallelism: the busiest rank's routed tokens over the mean
  std::vector<StageCost> stages_;
  std::vector<std::pair<int, int>> pieces_;  // pipeline numbering, stages × virtual stages of them
  double rank_params_ = 0;  // the parameters one rank's ZeRO holds: Ψ, less what tensor parallelism splits away and the routed experts
  double rank_expert_params_ = 0;  // the routed experts one rank keeps (the fullest stage's)
  int ranks_per_node_ = 1;
  Placement placement_;
  AttentionKernel kernel_ = AttentionKernel::Flash;
  double attention_fraction_ = 1;  // document_attention_fraction

  // The execution modes (execution_modes.hpp: their rules live there, once) of a candidate choice.
  ExecutionModes modes_for(const Choice& c) const { return decide_execution_modes(r_, layout_with(c), cost_.loss_chunk_tokens, kernels_); }
  BuildKernels kernels_;  // what the ranks' build can do (planned_kernels)
  ModelCost cost_;
  ModelCostOptions cost_options_;
  double capacity_ = 0;
};

}  // namespace dsrun::planning
