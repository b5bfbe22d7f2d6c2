// The planner's spine: its set-up from the recipe, plan() calling the memory, choice and time
// files in order, the checks and notes; the entry points the layout search and make_plan call.
#include "engine/plan/plan.hpp"
#include "engine/plan/planner.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/data/token_source.hpp"
#include "engine/parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <numeric>
#include <optional>
#include <cmath>

namespace dsrun {

ModelStateBytes plan_model_states_per_rank(const ModelStateOptions& o) {
  DSRUN_ASSERT(o.data_parallel >= 1 && o.zero_stage >= 0 && o.zero_stage <= 3, "validated options");
  const double psi = o.params;
  const double shard = std::ceil(psi / o.data_parallel);  // shards are padded, never uneven
  const bool mixed = o.dtype != DType::Fp32;
  const double e = mixed ? 2 : 4;                          // working weights
  const double g = bytes_per_element(o.grad_dtype.value_or(o.dtype));  // gradients: accumulated, reduced, staged
  const double master_per_param = mixed ? 4 : 0;           // fp32 master copy (fp32 training updates in place)
  const double state = bytes_per_element(o.state_dtype);   // each per-element state
  double optimizer_per_param = 2 * state;                  // Adam: m and v
  if (o.optimizer == OptimizerKind::Sgd) optimizer_per_param = o.momentum > 0 ? state : 0;

  ModelStateBytes b;
  b.params = (o.zero_stage >= 3 ? shard : psi) * e;
  b.grads = (o.zero_stage >= 2 ? shard : psi) * g;
  b.master = (o.zero_stage >= 1 ? shard : psi) * master_per_param;
  b.optimizer = (o.zero_stage >= 1 ? shard : psi) * optimizer_per_param;
  if (o.offload != Offload::None) {
    // ZeRO-Offload: master weights and optimizer states live on the host, with the gradient shard
    // in the gradient dtype that the fused host step reads. fp32 training has no separate master
    // copy on the device, but the host step needs the weights.
    // Buffers of the shard in the working dtype (pinned on GPU ranks): the gradient, copied out of
    // the reduction so that the host step can read it beside the next step (the delayed update
    // keeps two); and on GPU ranks, unless the parameter shard itself lives on the host, the
    // parameters going up (the delayed update always has one: parameters change between steps).
    const bool upload = o.delayed_update || (!o.same_memory && o.offload != Offload::OptimizerAndParams);
    const double staging = shard * (g * (o.delayed_update ? 2 : 1) + (upload ? e : 0));
    b.host = b.master + b.optimizer + staging + (mixed ? 0 : shard * 4);
    b.master = b.optimizer = 0;
  }
  if (o.offload == Offload::OptimizerAndParams) {
    b.host += b.params;
    b.params = 0;  // gathered layers still pass through the device: counted as communication buffers
  }
  return b;
}

namespace planning {

double data_bytes(const Recipe& r, int64_t seq_len) {
  const DataOptions& d = r.data;
  if (r.model.arch == ModelArch::ResNet) {
    const ResNetSpec& n = r.model.resnet;
    const double images = d.kind == DataKind::Cifar10 ? 60000 : 2048 + 256;
    return images * n.channels * n.image_size * n.image_size * 4 * 2;
  }
  double tokens = 0;
  if (d.kind == DataKind::Synthetic) {
    tokens = static_cast<double>(std::max<int64_t>(1 << 20, 64 * (seq_len + 1)));
  } else if (d.kind == DataKind::Tokens) {
    return 0;  // token files are mapped: their pages are the page cache's, not the rank's (docs/data.md)
  } else {
    std::vector<std::string> files = is_directory(d.path) ? data_directory_files(d.path, "") : std::vector<std::string>{d.path};
    for (const auto& f : files) tokens += static_cast<double>(std::max<int64_t>(0, file_size(f)));  // text: a token a byte
  }
  return tokens * 16;
}

double document_attention_fraction(const Recipe& r) {
  const DataOptions& d = r.data;
  if (!d.separate_documents || d.kind != DataKind::Tokens || r.model.arch != ModelArch::DeepSeek) return 1;
  std::vector<std::string> paths{d.path};
  paths.insert(paths.end(), d.blend.begin(), d.blend.end());
  for (const std::string& path : paths)
    if (!path.empty() && !file_exists(path) && !is_directory(path)) return 1;
  const TokenCorpus corpus(token_corpus_options(d, r.model.vocab, r.batch.seq_len, static_cast<uint64_t>(r.run.seed)));
  const int64_t windows = corpus.train_windows(), samples = std::min<int64_t>(256, windows);
  if (samples <= 0) return 1;
  const double s = static_cast<double>(r.batch.seq_len);
  double sum = 0;
  Window w;
  for (int64_t i = 0; i < samples; ++i) {
    corpus.train_window(i * windows / samples, w);
    double squares = 0, start = 0;
    for (int32_t next : w.document_starts) {
      const double end = std::min<double>(next, s);
      squares += (end - start) * (end - start);
      start = end;
    }
    squares += (s - start) * (s - start);
    sum += squares / (s * s);
  }
  return sum / static_cast<double>(samples);
}

Planner::Planner(const Recipe& r, const HostFacts& host, PlanningOptions options) : r_(r), host_(host), options_(options) {
  const HardwareSpec& hw = r.hardware;
  degrees_ = layout_of_recipe(r);
  imbalance_ = degrees_.expert > 1 ? r.parallel.expert_imbalance : 1.0;
  placement_ = placement_of(hw, layout_with({}));
  ranks_per_node_ = placement_.ranks_per_node;
  kernel_ = hw.device == Device::Cuda ? AttentionKernel::Flash : AttentionKernel::Math;
  kernels_ = planned_kernels(hw.device, host.kernels);
  ModelCostOptions cost;
  cost.fused_elementwise = hw.device == Device::Cuda;
  cost.local_vocab = r.model.vocab / std::max(1, degrees_.tensor);
  cost.loss_chunk_tokens = r.model.arch == ModelArch::DeepSeek ? loss_chunk_tokens(r.batch, cost.local_vocab) : 0;
  cost_options_ = cost;
  cost_ = model_cost(r.model, r.batch.seq_len, r.precision.dtype, kernel_, cost);
  attention_fraction_ = options.attention_fraction >= 0 ? options.attention_fraction : document_attention_fraction(r);
  capacity_ = hw.ranks_share_memory() ? hw.memory_bytes / ranks_per_node_ : hw.memory_bytes;
  data_bytes_ = options.data_bytes >= 0 ? options.data_bytes : data_bytes(r, r.batch.seq_len);
  split_into_stages();
}

Plan Planner::plan() {
  const HardwareSpec& hw = r_.hardware;
  Plan p;
  p.recipe = r_.path;
  p.hardware = hw.name;
  p.model = r_.model.name.empty() ? std::string(to_string(r_.model.arch)) : r_.model.name;
  p.device = hw.device;
  p.arch = r_.model.arch;
  p.nodes = hw.nodes;
  p.devices_per_node = hw.devices_per_node;
  p.layout = layout_with({});
  p.expert_imbalance = imbalance_;
  p.world_size = degrees_.world();
  p.ranks_per_node = ranks_per_node_;
  p.global_batch = r_.batch.global;
  p.seq_len = r_.model.arch == ModelArch::DeepSeek ? r_.batch.seq_len : 0;
  p.dtype = r_.precision.dtype;
  p.fp8 = r_.precision.fp8;
  p.attention = kernel_;
  p.attention_fraction = attention_fraction_;
  p.memory_capacity = capacity_;
  p.host_memory_capacity = hw.host_memory_bytes;
  p.steps = r_.run.steps;
  if (!r_.parallel.data_parallel)
    p.choices.push_back({"parallel.data_parallel", std::to_string(degrees_.data),
                         "every device: " + std::to_string(hw.nodes) + " node(s) x " + std::to_string(hw.devices_per_node)});

  choose_layout(p);  // (its last choice may change cost_: the loss chunk)
  std::vector<RefusedMode> refused;
  p.modes = decide_execution_modes(r_, p.layout, cost_.loss_chunk_tokens, kernels_, &refused);
  for (const RefusedMode& m : refused) p.notes.push_back(m.describe());
  if (!r_.precision.grad_dtype && r_.precision.dtype != DType::Fp32)
    p.choices.push_back({"precision.grad_dtype", to_string(p.modes.gradient_dtype), gradient_dtype_rule(r_, p.layout).second});
  if (r_.data.separate_documents) p.document_attention = p.modes.variable_length_attention ? "variable-length" : "masked";
  if (!(kernels_ == host_.kernels))
    p.notes.push_back("execution modes planned for dsrun's GPU build (scripts/gpu_build.sh): this build has no CUDA kernels");
  p.cost = cost_;
  check_pipeline(p);
  predict_communication(p);
  predict_time(p);
  check_hardware_present(p);
  plan_checkpoint_disk(p);
  add_notes(p);
  return p;
}

void Planner::check_pipeline(Plan& p) {
  if (degrees_.pipeline == 1) return;
  for (auto [begin, end] : pieces_) p.pipeline_pieces.push_back({begin, end});
  const PipelineTransport transport = r_.hardware.device == Device::Cuda ? PipelineTransport::RendezvousCoalesced : PipelineTransport::Queued;
  const std::string problem = pipeline_schedule_problem(p.layout.schedule, degrees_.pipeline, static_cast<int>(p.accumulation), degrees_.virtual_stages);
  p.pipeline_problem = problem.empty() && options_.full ? pipeline_deadlock_problem(p.layout.schedule, degrees_.pipeline, static_cast<int>(p.accumulation), degrees_.virtual_stages, transport) : problem;
  p.bubble_fraction = bubble_fraction(p.accumulation);
  if (!p.pipeline_problem.empty()) {
    p.fits = false;
    if (p.binds.empty()) p.binds = "the pipeline schedule";
    p.verdict.push_back("the pipeline schedule cannot run: " + p.pipeline_problem);
  }
}

void Planner::check_hardware_present(Plan& p) {
  const HardwareSpec& hw = r_.hardware;
  if (hw.device == Device::Cuda) {
    int needed = std::min(ranks_per_node_, hw.devices_per_node);
    if (host_.cuda_devices < needed) {
      p.hardware_present = false;
      p.hardware_message = "this machine has " + std::to_string(host_.cuda_devices) + " NVIDIA GPU(s)" +
                           (host_.cuda_visible.empty() ? std::string() : " visible (CUDA_VISIBLE_DEVICES=" + host_.cuda_visible + ")") + "; the recipe is for \"" + hw.name +
                           "\" (" + std::to_string(hw.nodes) + " node(s) x " + std::to_string(hw.devices_per_node) + " GPUs), " + std::to_string(needed) +
                           " rank(s) on this node (hardware.devices_per_node). The plan holds anywhere; running it needs that hardware: "
                           "fix: --set hardware.devices_per_node=" + std::to_string(std::max(1, host_.cuda_devices)) + " with a layout for that many, or run where the GPUs are.";
    }
  } else if (ranks_per_node_ > host_.cpu_cores) {
    p.notes.push_back(std::to_string(ranks_per_node_) + " CPU ranks on " + std::to_string(host_.cpu_cores) +
                      " cores: ranks will share cores and run slower than predicted");
  }
}

void Planner::add_notes(Plan& p) {
  const HardwareSpec& hw = r_.hardware;
  // On 4 H200s such a step stopped in NCCL's connection set-up ("Message truncated" in
  // bootstrap.cc, or a hang): the first stage opened both directions to the second at once, the
  // second one. PipelineStage now opens every pair both ways before the schedule runs.
  if (degrees_.pipeline > 1 && p.accumulation < degrees_.pipeline)
    p.notes.push_back("fewer micro-batches a step (" + std::to_string(p.accumulation) + ") than pipeline stages (" + std::to_string(degrees_.pipeline) + "): each stage idles " +
                      format_double(100 * p.bubble_fraction, 3) + "% of the step (a batch.micro giving at least " + std::to_string(degrees_.pipeline) + " micro-batches shrinks it)" +
                      (hw.device == Device::Cuda ? "; on GPUs such a step stopped NCCL's connection set-up until the stages opened their connections both ways at start "
                                                   "(2026-11-27); since, pipeline 2 alone has run so on 2 H200s, the layouts that failed (pipeline 2 x data 2, pipeline 4) not yet "
                                                   "(docs/benchmarks.md)"
                                                 : ""));
  if (hw.ranks_share_memory())
    p.notes.push_back("CPU ranks share the node's " + format_bytes(hw.memory_bytes) + "; each rank's share is " + format_bytes(capacity_));
  if (kernel_ == AttentionKernel::Math && r_.model.arch == ModelArch::DeepSeek)
    p.notes.push_back("attention on CPU keeps the s x s probabilities of every head (no flash kernel in libtorch 1.13)");
  if (hw.device == Device::Cuda && !hw.p2p && degrees_.data_ranks() > 1)
    p.notes.push_back("no GPU peer-to-peer: collectives go through host memory (half the link bandwidth assumed); NCCL needs NCCL_P2P_DISABLE=1 here");
  if (hw.device == Device::Cpu && p.layout.offload != Offload::None)
    p.notes.push_back("offload on CPU ranks moves nothing (host and device memory are the same); the same code path runs, with separate host copies");
  if (p.layout.zero_stage > 0 && degrees_.data_ranks() == 1) p.notes.push_back("ZeRO stage " + std::to_string(p.layout.zero_stage) + " with one rank shards nothing");
  if (p.offload_hidden_seconds < 0)
    p.notes.push_back("the delayed update's host step, " + format_double(hw.host_step_beside_compute, 3) + " times slower beside compute (hardware.host_step_beside_compute), outlasts the step's compute by " +
                      format_seconds(-p.offload_hidden_seconds) + " more than it takes alone: more sequences per step (batch.global) hide it, and without parallel.delayed_update "
                      "the step may be shorter");
  if (hw.device == Device::Cuda && degrees_.pipeline > 1)
    p.notes.push_back("pipeline on GPUs: each run of a stage's sends and receives goes out as one NCCL group (Megatron-LM's send_forward_recv_backward); "
                      "the schedule was simulated under NCCL's semantics (in-order rendezvous per pair) before launch (docs/parallelism.md, \"On GPUs\")");
  const int data_ranks = degrees_.data_ranks();
  int64_t shard_pad = static_cast<int64_t>(std::ceil(rank_params_ / data_ranks) * data_ranks - rank_params_);
  if (p.layout.zero_stage > 0 && shard_pad > 0)
    p.notes.push_back(format_count(cost_.params) + " parameters do not divide by " + std::to_string(data_ranks) + " ranks: shards are padded by " +
                      std::to_string(shard_pad) + " elements");
  if (hw.device == Device::Cuda && r_.model.moe.enabled())
    p.notes.push_back("routed experts run as grouped matrix products at " + format_double(100 * hw.grouped_matmul_efficiency, 3) + "% of peak FLOP/s (" +
                      std::to_string(r_.model.moe.routed_experts / degrees_.expert) + " per MoE layer on a rank; hardware.grouped_matmul_efficiency)");
  if (p.modes.fp8_routed_experts)
    p.notes.push_back("the routed experts' forward and input-gradient products run in FP8 at " + format_double(100 * hw.fp8_grouped_matmul_efficiency, 3) +
                      "% of the FP8 peak (hardware.fp8_grouped_matmul_efficiency), their weights quantised each micro-batch (" +
                      format_double(routed_rows_per_expert(r_, p.layout), 4) + " rows an expert a micro-batch) and kept transposed in FP8 until backward");
  const bool probed = !hw.collectives.ranks.empty();
  p.notes.push_back("speed assumes " + format_double(100 * hw.matmul_efficiency, 3) + "% of peak FLOP/s and " +
                    (probed ? "the probed bus bandwidth of each collective and group size within a node (hardware.collective_ranks, hardware.*_gbs)"
                            : format_double(100 * hw.comm_efficiency, 3) + "% of link bandwidth") +
                    " (hardware.matmul_efficiency" + (probed ? "" : ", comm_efficiency") + ")");
}

}  // namespace planning

using planning::Planner;
using planning::PlanningOptions;

namespace {

// A higher ZeRO stage is taken only where it plans this much faster: the plan's own step error is a
// few percent, and the lower stage runs fewer collectives.
constexpr double kStageGain = 0.01;

// parallel.zero_stage = "auto" over several data ranks: the lowest stage that fits, unless a higher
// one plans faster, which it does where it lets a larger micro batch fit (DeepSeek-LLM-7B's shape on
// 4 H200 in FP8: ZeRO-0 fits micro 1, 1.021 s a step; ZeRO-3 micro 4, 0.945 s).
Plan plan_fastest_stage(const Recipe& recipe, const HostFacts& host, PlanningOptions o) {
  Plan lowest = Planner(recipe, host, o).plan();
  if (recipe.parallel.zero_stage || lowest.layout.data_ranks() < 2 || !lowest.fits) return lowest;
  std::optional<Recipe> faster;
  double best = lowest.step_seconds * (1 - kStageGain);
  for (int stage = lowest.layout.zero_stage + 1; stage <= 3; ++stage) {
    Recipe r = recipe;
    r.parallel.zero_stage = stage;
    Layout l = lowest.layout;
    l.zero_stage = stage;
    LayoutDecided decided;
    decided.micro = recipe.batch.micro.has_value();
    if (!layout_problems(r, l, decided).empty()) continue;
    PlanningOptions quick = o;
    quick.full = false;
    Plan q = Planner(r, host, quick).plan();
    if (q.fits && q.step_seconds < best) faster = r, best = q.step_seconds;
  }
  if (!faster) return lowest;
  Plan p = Planner(*faster, host, o).plan();
  if (!p.fits) return lowest;  // (planned whole, as the quick plan was: the same memory)
  const std::string why = "stage " + std::to_string(lowest.layout.zero_stage) + " is the lowest that fits, at micro batch " + std::to_string(lowest.layout.micro) +
                          ", " + format_seconds(lowest.step_seconds) + " a step; stage " + std::to_string(p.layout.zero_stage) + " fits micro batch " +
                          std::to_string(p.layout.micro) + ", " + format_seconds(p.step_seconds) + " a step (" + format_bytes(p.memory.total()) + " of " +
                          format_bytes(p.memory_capacity) + ")";
  // Where the planner puts the stage's choice: first of its own (before recomputation, the micro batch, the loss chunk).
  auto own = std::find_if(p.choices.begin(), p.choices.end(), [](const AutoChoice& c) {
    return c.key == "parallel.activation_checkpointing" || c.key == "batch.micro" || c.key == "batch.loss_chunk_tokens";
  });
  p.choices.insert(own, {"parallel.zero_stage", std::to_string(p.layout.zero_stage), why});
  return p;
}

}  // namespace

Plan plan_candidate(const Recipe& recipe, const HostFacts& host, const PlannedData& data) {
  PlanningOptions o;
  o.full = false;
  o.data_bytes = data.bytes;
  o.attention_fraction = data.attention_fraction;
  return plan_fastest_stage(recipe, host, o);
}

PlannedData planned_data(const Recipe& recipe) { return {planning::data_bytes(recipe, recipe.batch.seq_len), planning::document_attention_fraction(recipe)}; }

Plan plan_fixed_layout(const Recipe& recipe, const HostFacts& host) {
  DSRUN_ASSERT(!recipe.parallel.search.any(), "the search fixes every degree before planning");
  // The data measured once for every stage planned (it reads the corpus).
  const PlannedData data = planned_data(recipe);
  PlanningOptions o;
  o.data_bytes = data.bytes;
  o.attention_fraction = data.attention_fraction;
  return plan_fastest_stage(recipe, host, o);
}

}  // namespace dsrun
