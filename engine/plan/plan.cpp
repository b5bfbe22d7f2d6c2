#include "engine/plan/plan.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <algorithm>
#include <cmath>

namespace dsrun {

ModelStateBytes plan_model_states_per_rank(const ModelStateOptions& o) {
  DSRUN_ASSERT(o.data_parallel >= 1 && o.zero_stage >= 0 && o.zero_stage <= 3, "validated options");
  const double psi = o.params;
  const double shard = std::ceil(psi / o.data_parallel);  // shards are padded, never uneven
  const bool mixed = o.dtype != DType::Fp32;
  const double e = mixed ? 2 : 4;                          // working weights and gradients
  const double master_per_param = mixed ? 4 : 0;           // fp32 master copy (fp32 training updates in place)
  double optimizer_per_param = 8;                          // Adam: fp32 m and v
  if (o.optimizer == OptimizerKind::Sgd) optimizer_per_param = o.momentum > 0 ? 4 : 0;

  ModelStateBytes b;
  b.params = (o.zero_stage >= 3 ? shard : psi) * e;
  b.grads = (o.zero_stage >= 2 ? shard : psi) * e;
  b.master = (o.zero_stage >= 1 ? shard : psi) * master_per_param;
  b.optimizer = (o.zero_stage >= 1 ? shard : psi) * optimizer_per_param;
  if (o.offload != Offload::None) {
    // ZeRO-Offload: master weights and optimizer states live on the host, with the gradient shard
    // in the working dtype that the fused host step reads. fp32 training has no separate master
    // copy on the device, but the host step needs the weights.
    // Buffers of the shard in the working dtype (pinned on GPU ranks): the gradient, copied out of
    // the reduction so that the host step can read it beside the next step (the delayed update
    // keeps two); and on GPU ranks, unless the parameter shard itself lives on the host, the
    // parameters going up (the delayed update always has one: parameters change between steps).
    const bool upload = o.delayed_update || (!o.same_memory && o.offload != Offload::OptimizerAndParams);
    const double staging = shard * e * ((o.delayed_update ? 2 : 1) + (upload ? 1 : 0));
    b.host = b.master + b.optimizer + staging + (mixed ? 0 : shard * 4);
    b.master = b.optimizer = 0;
  }
  if (o.offload == Offload::OptimizerAndParams) {
    b.host += b.params;
    b.params = 0;  // gathered layers still pass through the device: counted as communication buffers
  }
  return b;
}

namespace {

struct Layout {
  int stage = 0;
  bool checkpointing = false;
  int64_t micro = 1;
};

struct Evaluation {
  int stage = 0;           // the pipeline stage with the most to hold (0 without pipeline parallelism)
  MemoryBreakdown memory;
  HostMemory host;         // per rank
  double host_needed = 0;  // per node
  bool fits = false;
};

// Bytes of the data set as the ranks load it (int64 tokens of text, or fp32 images), at the peak of
// loading: the whole stream twice; token files are mapped, not loaded. Reads file sizes (docs/plan.md).
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

// What each pipeline stage holds and computes (one stage, the whole model, without a pipeline).
struct StageCost {
  double rank_params = 0;         // after tensor parallelism's split, without the routed experts
  double rank_expert_params = 0;  // the routed experts one rank keeps (1/ep of them, split by tp)
  double flops_per_sample = 0, routed_flops_per_sample = 0;
  double activation_bytes_per_sample = 0, routed_activation_bytes_per_sample = 0, checkpointed_activation_bytes_per_sample = 0;
  int moe_layers = 0;
  bool has_head = false, has_blocks = false;
  bool tied_head_copy = false;  // tied embeddings: the head's copy of the embedding (not in ZeRO)
};

// A candidate of the layout search is planned without its schedule's simulation or suggestions
// (the chosen layout gets both), on the data size measured once.
struct PlanningOptions {
  bool full = true;
  double data_bytes = -1;  // < 0: measure
};

class Planner {
 public:
  Planner(const Recipe& r, const HostFacts& host, PlanningOptions options = {}) : r_(r), host_(host), options_(options) {
    const HardwareSpec& hw = r.hardware;
    dp_ = r.parallel.data_parallel_or_auto(hw);
    tp_ = r.parallel.tensor;
    pp_ = r.parallel.pipeline;
    v_ = r.parallel.virtual_stages;
    ep_ = r.parallel.expert;
    imbalance_ = ep_ > 1 ? r.parallel.expert_imbalance : 1.0;
    ranks_per_node_ = (dp_ * tp_ * pp_ + hw.nodes - 1) / hw.nodes;
    kernel_ = hw.device == Device::Cuda ? AttentionKernel::Flash : AttentionKernel::Math;
    cost_ = model_cost(r.model, r.batch.seq_len, r.precision.dtype, kernel_, /*fused_elementwise=*/hw.device == Device::Cuda);
    capacity_ = hw.ranks_share_memory() ? hw.memory_bytes / ranks_per_node_ : hw.memory_bytes;
    data_bytes_ = options.data_bytes >= 0 ? options.data_bytes : data_bytes(r, r.batch.seq_len);
    split_into_stages();
  }

  // What one rank keeps of `units`: tensor parallelism splits every weight but the norms and the
  // MoE routers over tp ranks; expert parallelism keeps 1/ep of the routed experts (apart: ZeRO
  // shards them over the dp/ep ranks keeping the same ones).
  void add_units(StageCost& st, int begin, int end) const {
    double params = 0, replicated = 0, routed = 0;
    for (int u = begin; u < end; ++u) {
      const ModelCost::Unit& unit = cost_.units[u];
      params += unit.params;
      replicated += tp_ > 1 ? unit.tensor_replicated_params : 0;
      routed += ep_ > 1 ? unit.routed_expert_params : 0;  // (without expert parallelism they are the blocks' like any weight)
      st.flops_per_sample += unit.flops_per_sample;
      st.routed_flops_per_sample += unit.routed_flops_per_sample;
      st.activation_bytes_per_sample += unit.activation_bytes_per_sample;
      st.routed_activation_bytes_per_sample += unit.routed_activation_bytes_per_sample;
      st.checkpointed_activation_bytes_per_sample += unit.checkpointed_activation_bytes_per_sample;
      st.moe_layers += unit.routed_expert_params > 0 ? 1 : 0;
      st.has_blocks |= u > 0 && u + 1 < static_cast<int>(cost_.units.size());
    }
    st.rank_params += (params - routed - replicated) / tp_ + replicated;
    st.rank_expert_params += routed / (tp_ * ep_);
  }

  // Pipeline parallelism: the units (pipeline numbering) cut into stages × virtual stages pieces
  // of balanced FLOPs; rank r runs pieces r, r + stages, ... Without it, one stage: the model.
  void split_into_stages() {
    if (cost_.units.empty()) {  // images: one stage, the whole model
      stages_.push_back({cost_.params, 0, cost_.model_flops_per_sample, 0, cost_.activation_bytes_per_sample, 0, cost_.checkpointed_activation_bytes_per_sample, 0, true, true, false});
    } else {
      std::vector<double> flops;
      for (const auto& u : cost_.units) flops.push_back(u.flops_per_sample);
      pieces_ = pp_ > 1 ? balanced_split(flops, pp_ * v_) : std::vector<std::pair<int, int>>{};
      stages_.assign(pp_, StageCost{});
      if (pp_ == 1) {  // the whole model: its totals (the units' sums, but for the norms' few FLOPs)
        StageCost& st = stages_[0];
        add_units(st, 0, static_cast<int>(cost_.units.size()));
        st.flops_per_sample = cost_.model_flops_per_sample;
        st.activation_bytes_per_sample = cost_.activation_bytes_per_sample;
        st.checkpointed_activation_bytes_per_sample = cost_.checkpointed_activation_bytes_per_sample;
        st.has_head = st.has_blocks = true;
      }
      for (size_t g = 0; g < pieces_.size(); ++g) {
        StageCost& st = stages_[g % pp_];
        add_units(st, pieces_[g].first, pieces_[g].second);
        if (pieces_[g].second == static_cast<int>(cost_.units.size())) {
          st.has_head = true;
          st.tied_head_copy = r_.model.tie_embeddings;
        }
      }
    }
    for (const StageCost& st : stages_) {
      rank_params_ = std::max(rank_params_, st.rank_params);
      rank_expert_params_ = std::max(rank_expert_params_, st.rank_expert_params);
    }
  }

  // Micro-batches whose activations a stage holds at once (in whole stages' worth): 1F1B keeps up
  // to p - s on stage s, GPipe all of them; interleaving's warm-up holds (p-s-1)·2 + (v-1)·p + 1
  // chunks of 1/v each (Narayanan et al. 2021; pipeline_schedule's simulation agrees, in its tests).
  double live_micro_batches(int64_t accumulation, int stage) const {
    if (pp_ == 1) return 1;
    const double m = static_cast<double>(accumulation);
    switch (r_.parallel.pipeline_schedule) {
      case PipelineScheduleKind::GPipe: return m;
      case PipelineScheduleKind::OneFOneB: return std::min<double>(pp_ - stage, m);
      case PipelineScheduleKind::Interleaved: return std::min<double>((pp_ - stage - 1) * 2.0 + (v_ - 1) * pp_ + 1, m * v_) / v_;
    }
    return 1;
  }

  // The idle share of a pipeline step: (p-1)/(m+p-1), interleaved (p-1)/(v·m+p-1).
  double bubble_fraction(int64_t accumulation) const {
    if (pp_ == 1) return 0;
    const double m = static_cast<double>(accumulation) * (r_.parallel.pipeline_schedule == PipelineScheduleKind::Interleaved ? v_ : 1);
    return (pp_ - 1.0) / (m + pp_ - 1.0);
  }

  // The stage that needs the most memory decides.
  Evaluation evaluate(const Layout& l) const {
    Evaluation worst;
    for (size_t s = 0; s < stages_.size(); ++s) {
      Evaluation ev = evaluate_stage(l, static_cast<int>(s));
      if (s == 0 || rank_total(ev) > rank_total(worst)) worst = ev;
    }
    return worst;
  }

  Evaluation evaluate_stage(const Layout& l, int stage) const {
    const HardwareSpec& hw = r_.hardware;
    const StageCost& st = stages_[stage];
    const double live = live_micro_batches(r_.batch.global / (l.micro * dp_), stage);
    Evaluation ev;
    ev.stage = stage;
    ModelStateOptions o;
    o.params = st.rank_params;
    o.data_parallel = dp_;
    o.zero_stage = l.stage;
    o.dtype = r_.precision.dtype;
    o.optimizer = r_.optimizer.kind;
    o.momentum = r_.optimizer.momentum;
    o.offload = r_.parallel.offload;
    o.same_memory = hw.ranks_share_memory();
    o.delayed_update = r_.parallel.delayed_update;
    MemoryBreakdown& m = ev.memory;
    m.states = plan_model_states_per_rank(o);
    if (st.rank_expert_params > 0) {  // routed experts: ZeRO over the dp/ep ranks keeping the same ones
      o.params = st.rank_expert_params;
      o.data_parallel = dp_ / ep_;
      const ModelStateBytes experts = plan_model_states_per_rank(o);
      m.states += experts;
      m.routed_expert_states = experts.device_total() + experts.host;
    }
    // Expert parallelism: the busiest rank's experts get `imbalance` times the mean tokens.
    const double routed_extra = (imbalance_ - 1) * st.routed_activation_bytes_per_sample;
    m.activations = live * l.micro * (l.checkpointing ? st.checkpointed_activation_bytes_per_sample : st.activation_bytes_per_sample + routed_extra);
    // Tensor parallelism without sequence parallelism (Korthikanti et al. 2022, eq. 2): of a
    // layer's 34·sbh activation bytes, 24·sbh are split over t ranks and 10·sbh (norms, dropout-free
    // residuals, the region inputs) stay whole. Applied to the total until the terms are split one by one.
    // With sequence parallelism the 10·sbh are split too (eq. 4): everything is 1/t.
    if (tp_ > 1 && !l.checkpointing) m.activations *= r_.parallel.sequence_parallel ? 1.0 / tp_ : (10.0 + 24.0 / tp_) / 34.0;
    if (r_.data.separate_documents) {  // the document mask (bool, then a bias in the compute dtype, s x s) and each token's rotary rows (fp32 cos and sin)
      const double s = static_cast<double>(r_.batch.seq_len);
      m.activations += live * l.micro * (s * s * (1 + bytes_per_element(r_.precision.dtype)) + s * r_.model.head_dim() * 8);
    }
    // Backward's transient on top: the loss gradient at its start, or with recomputation whichever
    // is larger of that and one block's recomputed activations (they are never live together).
    const double head_backward = st.has_head ? cost_.head_backward_bytes_per_sample : 0;
    m.backward_peak = l.micro * (l.checkpointing && st.has_blocks ? std::max(head_backward, cost_.recomputed_layer_bytes_per_sample) : head_backward);
    const double e = bytes_per_element(r_.precision.dtype);
    if (l.stage == 3 && dp_ > 1) {
      // The layer being computed, the prefetched next one, and one layer's full gradient before reduce-scatter.
      m.comm_buffers = 3 * e * cost_.largest_unit_params / tp_;
      // Without recomputation autograd keeps every layer's gathered weights (matmuls save them for
      // backward) until that layer's backward has run: the whole model, gathered, at the end of forward.
      if (!l.checkpointing) m.comm_buffers += e * (st.rank_params + st.rank_expert_params);
    } else if (dp_ > 1) {
      m.comm_buffers = 2 * std::min(r_.parallel.bucket_bytes, (st.rank_params + st.rank_expert_params) * e);  // bucket being reduced + the next
    }
    // Expert parallelism: a MoE layer's tokens in flight, sent and received ([micro · s · k, h] each way).
    if (ep_ > 1 && st.moe_layers > 0) m.comm_buffers += 2 * imbalance_ * l.micro * r_.batch.seq_len * r_.model.moe.top_k * r_.model.hidden * e;
    // Tied embeddings over a pipeline: the last stage's copy of this tensor rank's embedding slice, and its gradient.
    if (st.tied_head_copy) m.comm_buffers += 2 * e * cost_.embedding_params / tp_;
    m.runtime = hw.runtime_memory_bytes;
    m.fragmentation = hw.fragmentation * (m.states.device_total() + m.activations + m.backward_peak + m.comm_buffers);
    double on_device = m.total();
    if (hw.ranks_share_memory()) on_device += m.states.host;  // "host" and "device" are the same memory on CPU ranks
    ev.host = host_memory(m);
    ev.host_needed = ev.host.total() * ranks_per_node_;
    ev.fits = on_device <= capacity_ && ev.host_needed <= hw.host_memory_bytes;
    return ev;
  }

  // Every host byte a rank holds (docs/plan.md): its process, offloaded states, the model build's
  // transient, the data; on CPU ranks the device terms too. The build runs before training: on
  // CPU ranks only what it needs beyond training's transients adds to the peak.
  HostMemory host_memory(const MemoryBreakdown& m) const {
    const HardwareSpec& hw = r_.hardware;
    HostMemory h;
    h.offloaded = m.states.host;
    h.data = data_bytes_;
    // A decoder is built deferred, one unit at a time; a ResNet or weights from a file, whole.
    const bool deferred = r_.model.arch == ModelArch::DeepSeek && r_.model.init_from.empty();
    const double build = 4 * (deferred ? cost_.largest_unit_params : cost_.params);
    if (hw.ranks_share_memory()) {
      h.device = m.total();
      h.model_build = std::max(0.0, build - (m.activations + m.backward_peak + m.comm_buffers));
    } else {
      h.process = hw.host_runtime_memory_bytes;
      h.model_build = build;
    }
    return h;
  }

  double rank_total(const Evaluation& ev) const {
    return ev.memory.total() + (r_.hardware.ranks_share_memory() ? ev.memory.states.host : 0);
  }

  Plan plan() {
    const HardwareSpec& hw = r_.hardware;
    Plan p;
    p.recipe = r_.path;
    p.hardware = hw.name;
    p.model = r_.model.name.empty() ? std::string(to_string(r_.model.arch)) : r_.model.name;
    p.device = hw.device;
    p.arch = r_.model.arch;
    p.nodes = hw.nodes;
    p.devices_per_node = hw.devices_per_node;
    p.data_parallel = dp_;
    p.tensor_parallel = tp_;
    p.pipeline_parallel = pp_;
    p.expert_parallel = ep_;
    p.expert_imbalance = imbalance_;
    p.sequence_parallel = r_.parallel.sequence_parallel && tp_ > 1;
    p.world_size = dp_ * tp_ * pp_;
    p.ranks_per_node = ranks_per_node_;
    p.global_batch = r_.batch.global;
    p.seq_len = r_.model.arch == ModelArch::DeepSeek ? r_.batch.seq_len : 0;
    p.dtype = r_.precision.dtype;
    p.offload = r_.parallel.offload;
    p.attention = kernel_;
    p.cost = cost_;
    p.memory_capacity = capacity_;
    p.host_memory_capacity = hw.host_memory_bytes;
    p.steps = r_.run.steps;
    if (!r_.parallel.data_parallel)
      p.choices.push_back({"parallel.data_parallel", std::to_string(dp_),
                           "every device: " + std::to_string(hw.nodes) + " node(s) x " + std::to_string(hw.devices_per_node)});

    choose_layout(p);
    check_pipeline(p);
    predict_communication(p);
    predict_time(p);
    check_hardware_present(p);
    add_notes(p);
    return p;
  }

 private:
  // The schedule the ranks will run, simulated before launch: every receive meets its send, and
  // the bubble the step time counts.
  void check_pipeline(Plan& p) {
    p.pipeline_schedule = r_.parallel.pipeline_schedule;
    p.virtual_stages = v_;
    if (pp_ == 1) return;
    for (auto [begin, end] : pieces_) p.pipeline_pieces.push_back({begin, end});
    const std::string problem = pipeline_schedule_problem(p.pipeline_schedule, pp_, static_cast<int>(p.accumulation), v_);
    PipelineSimulation sim;
    if (problem.empty() && options_.full) sim = simulate(build_pipeline_schedule(p.pipeline_schedule, pp_, static_cast<int>(p.accumulation), v_), 1.0 / v_, 2.0 / v_);
    p.pipeline_problem = problem.empty() ? sim.problem : problem;
    p.bubble_fraction = bubble_fraction(p.accumulation);
    if (!p.pipeline_problem.empty()) {
      p.fits = false;
      p.verdict.push_back("the pipeline schedule cannot run: " + p.pipeline_problem);
    }
  }

  std::vector<int> stage_candidates() const {
    if (r_.parallel.zero_stage) return {*r_.parallel.zero_stage};
    if (pp_ > 1) return {0, 1, 2};  // ZeRO-3 is refused with pipeline parallelism
    if (r_.parallel.offload == Offload::OptimizerAndParams) return {3};
    if (r_.parallel.offload == Offload::Optimizer) return {1, 2, 3};
    return {0, 1, 2, 3};
  }
  std::vector<bool> checkpointing_candidates() const {
    switch (r_.parallel.activation_checkpointing) {
      case Checkpointing::None: return {false};
      case Checkpointing::Full: return {true};
      case Checkpointing::Auto: return {false, true};
    }
    return {false};
  }
  std::vector<int64_t> micro_candidates() const {  // largest first
    if (r_.batch.micro) return {*r_.batch.micro};
    // Divisors of the per-rank batch, found in pairs up to its square root (batches can be huge).
    int64_t per_rank = r_.batch.global / dp_;
    std::vector<int64_t> out;
    // The interleaved schedule needs the micro-batches per step in multiples of the stages.
    auto allowed = [&](int64_t micro) { return r_.parallel.pipeline_schedule != PipelineScheduleKind::Interleaved || (per_rank / micro) % pp_ == 0; };
    for (int64_t d = 1; d * d <= per_rank; ++d)
      if (per_rank % d == 0) {
        if (allowed(d)) out.push_back(d);
        if (d != per_rank / d && allowed(per_rank / d)) out.push_back(per_rank / d);
      }
    std::sort(out.rbegin(), out.rend());
    return out;
  }

  std::string usage(const Evaluation& ev) const {
    return format_bytes(rank_total(ev)) + " of " + format_bytes(capacity_);
  }

  void choose_layout(Plan& p) {
    const std::vector<int> stages = stage_candidates();
    const std::vector<bool> ckpts = checkpointing_candidates();
    const std::vector<int64_t> micros = micro_candidates();
    const int64_t smallest_micro = micros.back();

    // 1. The lowest ZeRO stage (and recomputation only if needed) that fits the smallest micro-batch.
    Layout chosen{stages.back(), ckpts.back(), smallest_micro};
    bool found = false;
    std::string stage_reason, ckpt_reason;
    for (int stage : stages) {
      for (bool ckpt : ckpts) {
        Evaluation ev = evaluate({stage, ckpt, smallest_micro});
        if (ev.fits) {
          chosen = {stage, ckpt, smallest_micro};
          found = true;
          break;
        }
      }
      if (found) break;
    }
    if (!r_.parallel.zero_stage) {
      Evaluation ev = evaluate(chosen);
      if (!found) stage_reason = "no stage fits; the highest allowed is shown";
      else if (chosen.stage == stages.front())
        stage_reason = dp_ == 1 ? "one data-parallel rank: ZeRO has nothing to shard; stage " + std::to_string(chosen.stage) + " fits (" + usage(ev) + ")"
                                : "the lowest stage, and it fits (" + usage(ev) + ")";
      else {
        Evaluation lower = evaluate({chosen.stage - 1, chosen.checkpointing, smallest_micro});
        stage_reason = "stage " + std::to_string(chosen.stage - 1) + " would need " + format_bytes(rank_total(lower)) + " of " +
                       format_bytes(capacity_) + "; stage " + std::to_string(chosen.stage) + " is the lowest that fits (" + usage(ev) + ")";
      }
      p.choices.push_back({"parallel.zero_stage", std::to_string(chosen.stage), stage_reason});
    }
    if (r_.parallel.activation_checkpointing == Checkpointing::Auto) {
      if (!chosen.checkpointing)
        ckpt_reason = "activations fit without recomputation, which would cost about a third more compute";
      else {
        Evaluation without = evaluate({chosen.stage, false, smallest_micro});
        ckpt_reason = "without recomputation micro batch " + std::to_string(smallest_micro) + " needs " + format_bytes(rank_total(without)) +
                      " of " + format_bytes(capacity_) + "; full recomputation keeps each block's input only";
      }
      p.choices.push_back({"parallel.activation_checkpointing", chosen.checkpointing ? "full" : "none", ckpt_reason});
    }

    // 2. The largest micro-batch that fits under that layout (fewer accumulation steps, better kernels).
    if (found) {
      for (int64_t micro : micros) {
        if (evaluate({chosen.stage, chosen.checkpointing, micro}).fits) {
          chosen.micro = micro;
          break;
        }
      }
    }
    if (!r_.batch.micro) {
      int64_t per_rank = r_.batch.global / dp_;
      std::string reason;
      if (!found) reason = "nothing fits; the smallest micro batch is shown";
      else if (chosen.micro == per_rank) reason = "the whole per-rank batch (" + std::to_string(per_rank) + ") fits: no accumulation";
      else {
        int64_t next = 0;
        for (int64_t m : micros)
          if (m > chosen.micro) next = m;  // the next larger divisor
        if (next == 0) {
          reason = "the largest that leaves the interleaved schedule a multiple of " + std::to_string(pp_) + " micro-batches per step";
        } else {
          Evaluation bigger = evaluate({chosen.stage, chosen.checkpointing, next});
          reason = "largest divisor of the per-rank batch " + std::to_string(per_rank) + " that fits; micro " + std::to_string(next) +
                   " would need " + format_bytes(rank_total(bigger)) + " of " + format_bytes(capacity_);
        }
      }
      p.choices.push_back({"batch.micro", std::to_string(chosen.micro), reason});
    }

    Evaluation ev = evaluate(chosen);
    p.zero_stage = chosen.stage;
    p.activation_checkpointing = chosen.checkpointing;
    p.micro_batch = chosen.micro;
    p.accumulation = r_.batch.global / (chosen.micro * dp_);
    DSRUN_ASSERT(p.accumulation * chosen.micro * dp_ == r_.batch.global, "batch divisibility was validated");
    p.tokens_per_step = static_cast<double>(r_.batch.global) * cost_.tokens_per_sample;
    p.memory = ev.memory;
    p.memory_stage = ev.stage;
    p.live_micro_batches = live_micro_batches(p.accumulation, ev.stage);
    for (size_t st = 0; st < stages_.size(); ++st) {
      const ModelStateBytes states = evaluate_stage(chosen, static_cast<int>(st)).memory.states;
      p.stage_model_state_bytes.push_back(states.device_total() + states.host);
    }
    p.host = ev.host;
    p.host_memory_needed = ev.host_needed;
    p.fits = ev.fits;

    double total = rank_total(ev);
    if (total <= capacity_)
      p.verdict.push_back("fits: " + format_bytes(total) + " of " + format_bytes(capacity_) + " per rank, headroom " +
                          format_bytes(capacity_ - total) + " (" + format_double(100.0 * (capacity_ - total) / capacity_, 3) + "%)");
    else
      p.verdict.push_back("does not fit: needs " + format_bytes(total) + " per rank, " + format_bytes(capacity_) + " available (short by " +
                          format_bytes(total - capacity_) + ")");
    if (r_.hardware.device == Device::Cuda || ev.host_needed > r_.hardware.host_memory_bytes)
      p.verdict.push_back(std::string(ev.host_needed <= r_.hardware.host_memory_bytes ? "host memory fits: " : "host memory does not fit (hardware.host_memory_gib): ") +
                          format_bytes(ev.host_needed) + " of " + format_bytes(r_.hardware.host_memory_bytes) + " per node (" +
                          std::to_string(ranks_per_node_) + " rank(s) x " + format_bytes(ev.host.total()) + ")");
    if (!p.fits && options_.full) suggest(p, chosen);
  }

  // What would fit instead: the least invasive changes first, then more devices.
  void suggest(Plan& p, const Layout& current) {
    struct Option {
      Layout layout;
      Offload offload;
      std::string sets;
    };
    std::vector<Option> options;
    const int64_t per_rank = r_.batch.global / dp_;
    // Least invasive first: a higher stage, then recomputation, and offload (slow) last.
    for (Offload off : {Offload::None, Offload::Optimizer, Offload::OptimizerAndParams})
      for (int stage = std::max(current.stage, 0); stage <= 3; ++stage)
        for (bool ckpt : {false, true}) {
          if (off == Offload::Optimizer && stage == 0) continue;
          if (off == Offload::OptimizerAndParams && stage != 3) continue;
          std::string sets = "--set parallel.zero_stage=" + std::to_string(stage);
          if (ckpt) sets += " --set parallel.activation_checkpointing=full";
          if (off != Offload::None) sets += std::string(" --set parallel.offload=") + to_string(off);
          if (r_.batch.micro || per_rank > 1) sets += " --set batch.micro=1";
          options.push_back({{stage, ckpt, 1}, off, sets});
        }
    int shown = 0;
    for (const auto& o : options) {
      Recipe alt = r_;
      alt.parallel.offload = o.offload;
      Planner alt_planner(alt, host_);
      Evaluation ev = alt_planner.evaluate(o.layout);
      if (!ev.fits) continue;
      p.suggestions.push_back("fits with " + o.sets + " (" + alt_planner.usage(ev) + ")");
      if (++shown == 2) break;
    }
    // More GPUs of the same kind, with ZeRO-3, recomputation and micro batch 1 (CPU ranks share
    // one memory, so more of them never helps).
    if (shown > 0 || r_.hardware.device != Device::Cuda) {
      if (p.suggestions.empty()) p.suggestions.push_back("no configuration of this hardware fits: choose a smaller model or more memory");
      return;
    }
    for (int n = dp_ + 1; n <= 65536; n = n < 64 ? n + 1 : n * 2) {
      Recipe alt = r_;
      alt.parallel.data_parallel = n;
      alt.batch.global = n;  // only the memory per rank matters here
      // More nodes of this kind (each with its own host memory), not more GPUs in one node.
      alt.hardware.nodes = std::max(alt.hardware.nodes, (n + alt.hardware.devices_per_node - 1) / alt.hardware.devices_per_node);
      Planner alt_planner(alt, host_);
      if (alt_planner.evaluate({3, true, 1}).fits) {
        p.suggestions.push_back("with ZeRO-3, full recomputation and micro batch 1, " + std::to_string(n) +
                                " GPUs of this kind would fit (batch.global must then be a multiple of " + std::to_string(n) + ")");
        break;
      }
    }
    if (p.suggestions.empty()) p.suggestions.push_back("no configuration of this hardware fits: choose a smaller model or larger devices");
  }

  // The parameters of one rank's ZeRO shards: its share of the rest over the data ranks, and of
  // its routed experts over the ranks keeping the same ones (shards are padded, never uneven).
  double shard_params() const { return std::ceil(rank_params_ / dp_) + std::ceil(rank_expert_params_ / (dp_ / ep_)); }

  double link_bandwidth() const {
    const HardwareSpec& hw = r_.hardware;
    double bw = hw.link_bandwidth;
    if (hw.device == Device::Cuda && !hw.p2p) bw /= 2;  // every transfer is copied through host memory
    if (hw.nodes > 1 && dp_ > ranks_per_node_) bw = std::min(bw, hw.inter_node_bandwidth / ranks_per_node_);
    return bw * hw.comm_efficiency;
  }

  void predict_communication(Plan& p) {
    const double psi = rank_params_;
    const double e = bytes_per_element(r_.precision.dtype);
    const double bw = link_bandwidth();
    const double a = static_cast<double>(p.accumulation);
    auto add = [&](std::string what, double bytes) {
      if (bytes <= 0) return;
      p.comm.push_back({std::move(what), bytes, bytes / bw});
    };
    // ZeRO's collectives over `ranks` data ranks for `params` parameters (the routed experts' over
    // the dp/ep ranks keeping the same ones, with `of` naming them).
    auto data_parallel = [&](double params, int ranks, const std::string& of) {
      if (ranks <= 1) return;
      const double ring = (ranks - 1.0) / ranks;  // ring collectives: each rank sends (N-1)/N of the buffer per pass
      switch (p.zero_stage) {
        case 0: add("all-reduce gradients" + of + " (once per step)", 2 * ring * params * e); break;
        case 1:
          add("reduce-scatter gradients" + of + " (once per step)", ring * params * e);
          add("all-gather updated parameters" + of, ring * params * e);
          break;
        case 2:
          add("reduce-scatter gradients" + of + " (every micro-batch)", a * ring * params * e);
          add("all-gather updated parameters" + of, ring * params * e);
          break;
        case 3:
          add("all-gather parameters" + of + " for forward (every micro-batch)", a * ring * params * e);
          add("all-gather parameters" + of + " for backward (every micro-batch)", a * ring * params * e);
          add("reduce-scatter gradients" + of + " (every micro-batch)", a * ring * params * e);
          break;
      }
    };
    data_parallel(psi, dp_, "");
    data_parallel(rank_expert_params_, dp_ / ep_, " of the routed experts");
    if (ep_ > 1) {
      // Each MoE layer sends every (token, choice) pair's row to its expert's rank and back, in
      // forward and again in backward (and once more when recomputed): [micro · s · k, h] each
      // way, of which (ep-1)/ep leaves the rank; the busiest rank's share is `imbalance` times
      // the mean. Within the node while the ep ranks fit in it (they are consecutive data ranks).
      int moe_layers = 0;
      for (const StageCost& st : stages_) moe_layers = std::max(moe_layers, st.moe_layers);
      const double pairs = static_cast<double>(p.micro_batch) * r_.batch.seq_len * r_.model.moe.top_k;
      const double passes = p.activation_checkpointing ? 6 : 4;
      const double bytes = a * moe_layers * passes * pairs * r_.model.hidden * e * (ep_ - 1.0) / ep_ * imbalance_;
      const bool across_nodes = r_.hardware.nodes > 1 && ep_ * tp_ > ranks_per_node_;
      const double ep_bw = (across_nodes ? r_.hardware.inter_node_bandwidth / ranks_per_node_ : r_.hardware.link_bandwidth) * r_.hardware.comm_efficiency;
      p.comm.push_back({"all-to-all tokens to their experts and back (expert, " + std::to_string(static_cast<int>(passes)) + " per MoE layer, every micro-batch)", bytes, bytes / ep_bw});
    }
    if (tp_ > 1) {
      // Megatron's tensor parallelism: per layer two all-reduces of the activations [b, s, h] in
      // forward and two in backward, every micro-batch; within the node (tp ranks are consecutive).
      // Sequence parallelism replaces each by a reduce-scatter and an all-gather: the same bytes.
      const double activation = static_cast<double>(p.micro_batch) * r_.batch.seq_len * r_.model.hidden * e;
      const double t = tp_, bytes = a * 4.0 * r_.model.layers * 2 * (t - 1) / t * activation;
      const double node_bw = r_.hardware.link_bandwidth * r_.hardware.comm_efficiency;
      p.comm.push_back({r_.parallel.sequence_parallel ? "reduce-scatter + all-gather activations (tensor, sequence-parallel, 4 per layer, every micro-batch)"
                                                      : "all-reduce activations (tensor, 4 per layer, every micro-batch)",
                        bytes, bytes / node_bw});
    }
    if (pp_ > 1) {
      // Every chunk sends its output forward and its input's gradient back, every micro-batch:
      // [micro, seq, hidden] (1/t of it with sequence parallelism). Stages are the outermost
      // dimension: neighbours sit dp × tp ranks apart, on another node once that passes a node.
      const double activation = static_cast<double>(p.micro_batch) * r_.batch.seq_len * r_.model.hidden * e / (r_.parallel.sequence_parallel ? tp_ : 1);
      const bool across_nodes = r_.hardware.nodes > 1 && dp_ * tp_ >= ranks_per_node_;
      const double p2p_bw = (across_nodes ? r_.hardware.inter_node_bandwidth / ranks_per_node_ : r_.hardware.link_bandwidth) * r_.hardware.comm_efficiency;
      const double bytes = 2 * a * v_ * activation;
      p.comm.push_back({"send/receive activations and their gradients (pipeline, every micro-batch)", bytes, bytes / p2p_bw});
      if (r_.model.tie_embeddings) {
        const double tied = 2 * cost_.embedding_params / tp_ * e;
        p.comm.push_back({"tied embedding to the last stage and its gradient back (pipeline, once per step)", tied, tied / p2p_bw});
      }
    }
    for (const auto& c : p.comm) p.comm_seconds += c.seconds;

    // Overlap: on GPUs gradient collectives run on their own stream during backward; on CPU ranks
    // Gloo competes for the same cores, so nothing overlaps.
    const double compute = compute_seconds(p);
    if (r_.hardware.device == Device::Cpu) {
      p.exposed_comm_seconds = p.comm_seconds;
    } else {
      double overlappable_work = 0, not_overlapped = 0;
      for (const auto& c : p.comm) {
        // The updated parameters' gather follows the step; tensor-parallel collectives sit between
        // the layers' matmuls that need their results.
        if (c.collective.rfind("all-gather updated", 0) == 0 || c.collective.find("(tensor") != std::string::npos || c.collective.find("(pipeline") != std::string::npos ||
            c.collective.find("(expert") != std::string::npos)
          not_overlapped += c.seconds;
        else overlappable_work += c.seconds;
      }
      double backward = compute * 2.0 / 3.0;
      double window = p.zero_stage <= 1 ? backward / a : p.zero_stage == 2 ? backward : compute;
      p.exposed_comm_seconds = std::max(0.0, overlappable_work - window) + not_overlapped;
    }

    // Offload traffic over PCIe: gradient shard down, updated parameter shard up; ZeRO-3 parameter
    // offload also fetches the parameter shard for every forward and backward.
    if (p.offload != Offload::None && r_.hardware.device == Device::Cuda) {
      const double shard = shard_params();
      double bytes = 2 * shard * e;
      if (p.offload == Offload::OptimizerAndParams) bytes += 2 * a * shard * e;
      p.offload_seconds = bytes / r_.hardware.host_link_bandwidth;
    }
  }

  double peak_flops() const {
    const HardwareSpec& hw = r_.hardware;
    switch (r_.precision.dtype) {
      case DType::Bf16: return hw.peak_flops_bf16;
      case DType::Fp16: return hw.peak_flops_fp16;
      case DType::Fp32: return hw.peak_flops_fp32;
    }
    return hw.peak_flops_fp32;
  }

  double compute_seconds(Plan& p) const {
    double per_sample = cost_.model_flops_per_sample + (p.activation_checkpointing ? cost_.recompute_flops_per_sample : 0);
    p.hardware_flops_per_step = per_sample * static_cast<double>(r_.batch.global);
    p.model_flops_per_step = cost_.model_flops_per_sample * static_cast<double>(r_.batch.global);
    p.peak_flops = peak_flops();
    // A pipeline step lasts as long as its busiest stage's share of the work, stretched by the
    // bubble; under expert parallelism the busiest rank's routed experts compute `imbalance` times the mean.
    // On GPUs each routed expert a rank runs also costs hardware.expert_call_ms per micro-batch
    // (the experts run one after another, launch-bound: docs/benchmarks.md).
    const double a = static_cast<double>(p.accumulation);
    const double experts_per_rank = r_.model.moe.enabled() ? static_cast<double>(r_.model.moe.routed_experts) / ep_ : 0;
    double busiest = 0;
    for (const StageCost& st : stages_) {
      const double flops = p.hardware_flops_per_step * (st.flops_per_sample + (imbalance_ - 1) * st.routed_flops_per_sample) / cost_.model_flops_per_sample / (dp_ * tp_);
      const double expert_calls = r_.hardware.device == Device::Cuda ? a * st.moe_layers * experts_per_rank * r_.hardware.expert_call_seconds : 0;
      busiest = std::max(busiest, flops / (p.peak_flops * r_.hardware.matmul_efficiency) + expert_calls);
    }
    return busiest / (1 - bubble_fraction(p.accumulation));
  }

  // The offload pipeline (docs/plan.md): gradients come down unit by unit during backward; the
  // host step starts once their norm is known and runs unit by unit in forward order, each unit's
  // parameters going up as soon as they are written, and the next forward waits for each unit
  // (so it overlaps the host step's tail). The delayed update runs the whole host step beside the
  // next step's compute instead. ZeRO-3 parameter fetches from the host are prefetched a unit
  // ahead: hidden behind compute where they take less time than it.
  double hidden_offload_seconds(const Plan& p, double shard, double e) const {
    const double link = r_.hardware.host_link_bandwidth;
    const double forward = p.compute_seconds / 3, backward = p.compute_seconds - forward;
    const double down = shard * e / link;
    const double up = p.offload == Offload::OptimizerAndParams ? 0 : shard * e / link;
    const double fetch = std::max(0.0, p.offload_seconds - down - up - p.compute_seconds);
    const double host = p.optimizer_seconds;
    const double exposed_down = std::max(0.0, down - backward);
    double exposed = 0;
    if (r_.parallel.delayed_update) {
      // Beside compute the host step shares host memory with the copies the GPU makes meanwhile.
      const double host_beside = host + p.offload_seconds * link / (r_.hardware.host_memory_bandwidth / ranks_per_node_);
      const double device_side = p.compute_seconds + p.exposed_comm_seconds + exposed_down + std::max(0.0, up - forward) + fetch;
      exposed = std::max(device_side, host_beside) - p.compute_seconds - p.exposed_comm_seconds;
    } else {
      exposed = exposed_down + std::max(0.0, std::max(host, up) - forward) + fetch;
    }
    return std::max(0.0, host + p.offload_seconds - exposed);
  }

  void predict_time(Plan& p) {
    p.compute_seconds = compute_seconds(p);
    // The optimizer step is memory-bound. Per parameter of the shard it reads and writes the fp32
    // weights (8 bytes) and each fp32 state (8 bytes each: Adam's m and v, SGD's momentum), reads
    // the gradient, and with mixed precision writes the working copy.
    const double e = bytes_per_element(r_.precision.dtype);
    const bool mixed = r_.precision.dtype != DType::Fp32;
    int states = r_.optimizer.kind == OptimizerKind::Sgd ? (r_.optimizer.momentum > 0 ? 1 : 0) : 2;
    double touched = 8 + 8.0 * states + e + (mixed ? e : 0);
    const double shard = p.zero_stage >= 1 ? shard_params() : rank_params_ + rank_expert_params_;
    // Offloaded, the step runs on the host, whose memory bandwidth the node's ranks share.
    const bool host_step = p.offload != Offload::None && r_.hardware.device == Device::Cuda;
    const double bandwidth = host_step ? r_.hardware.host_memory_bandwidth / ranks_per_node_ : r_.hardware.memory_bandwidth;
    p.optimizer_seconds = shard * touched / bandwidth;
    p.offload_hidden_seconds = host_step ? hidden_offload_seconds(p, shard, e) : 0;
    p.step_seconds = p.compute_seconds + p.exposed_comm_seconds + p.optimizer_seconds + p.offload_seconds - p.offload_hidden_seconds;
    p.tokens_per_second = p.tokens_per_step / p.step_seconds;
    p.mfu = p.model_flops_per_step / (p.step_seconds * p.peak_flops * p.world_size);
    p.total_seconds = p.step_seconds * static_cast<double>(r_.run.steps);
  }

  void check_hardware_present(Plan& p) {
    const HardwareSpec& hw = r_.hardware;
    if (hw.device == Device::Cuda) {
      int needed = std::min(ranks_per_node_, hw.devices_per_node);
      if (host_.cuda_devices < needed) {
        p.hardware_present = false;
        p.hardware_message = "this machine has " + std::to_string(host_.cuda_devices) + " NVIDIA GPU(s); the recipe is for \"" + hw.name +
                             "\" (" + std::to_string(hw.nodes) + " node(s) x " + std::to_string(hw.devices_per_node) +
                             " GPUs). The plan holds anywhere; running it needs that hardware.";
      }
    } else if (ranks_per_node_ > host_.cpu_cores) {
      p.notes.push_back(std::to_string(ranks_per_node_) + " CPU ranks on " + std::to_string(host_.cpu_cores) +
                        " cores: ranks will share cores and run slower than predicted");
    }
  }

  void add_notes(Plan& p) {
    const HardwareSpec& hw = r_.hardware;
    if (hw.ranks_share_memory())
      p.notes.push_back("CPU ranks share the node's " + format_bytes(hw.memory_bytes) + "; each rank's share is " + format_bytes(capacity_));
    if (kernel_ == AttentionKernel::Math && r_.model.arch == ModelArch::DeepSeek)
      p.notes.push_back("attention on CPU keeps the s x s probabilities of every head (no flash kernel in libtorch 1.13)");
    if (hw.device == Device::Cuda && !hw.p2p && dp_ > 1)
      p.notes.push_back("no GPU peer-to-peer: collectives go through host memory (half the link bandwidth assumed); NCCL needs NCCL_P2P_DISABLE=1 here");
    if (hw.device == Device::Cpu && p.offload != Offload::None)
      p.notes.push_back("offload on CPU ranks moves nothing (host and device memory are the same); the same code path runs, with separate host copies");
    if (p.zero_stage > 0 && dp_ == 1) p.notes.push_back("ZeRO stage " + std::to_string(p.zero_stage) + " with one rank shards nothing");
    if (hw.device == Device::Cuda && pp_ > 1)
      p.notes.push_back("pipeline on GPUs: NCCL runs a pair's sends and receives in order, and the engine does not yet batch a stage's send with the "
                        "neighbour's receive (Megatron-LM's send_forward_recv_backward): activations larger than NCCL's buffer may stall 1F1B "
                        "(docs/parallelism.md, \"On GPUs\"); tested on CPU ranks (Gloo) only");
    int64_t shard_pad = static_cast<int64_t>(std::ceil(rank_params_ / dp_) * dp_ - rank_params_);
    if (p.zero_stage > 0 && shard_pad > 0)
      p.notes.push_back(format_count(cost_.params) + " parameters do not divide by " + std::to_string(dp_) + " ranks: shards are padded by " +
                        std::to_string(shard_pad) + " elements");
    if (hw.device == Device::Cuda && r_.model.moe.enabled())
      p.notes.push_back("routed experts run one after another: each costs " + format_double(hw.expert_call_seconds * 1e3, 3) + " ms per micro-batch beyond its FLOPs (" +
                        std::to_string(r_.model.moe.routed_experts / ep_) + " per MoE layer on a rank; hardware.expert_call_ms)");
    p.notes.push_back("speed assumes " + format_double(100 * hw.matmul_efficiency, 3) + "% of peak FLOP/s and " +
                      format_double(100 * hw.comm_efficiency, 3) + "% of link bandwidth (hardware.matmul_efficiency, comm_efficiency)");
  }

  const Recipe& r_;
  HostFacts host_;
  PlanningOptions options_;
  double data_bytes_ = 0;
  int dp_ = 1, tp_ = 1, pp_ = 1, v_ = 1, ep_ = 1;
  double imbalance_ = 1;  // expert parallelism: the busiest rank's routed tokens over the mean
  std::vector<StageCost> stages_;
  std::vector<std::pair<int, int>> pieces_;  // pipeline numbering, stages × virtual stages of them
  double rank_params_ = 0;  // the parameters one rank's ZeRO holds: Ψ, less what tensor parallelism splits away and the routed experts
  double rank_expert_params_ = 0;  // the routed experts one rank keeps (the fullest stage's)
  int ranks_per_node_ = 1;
  AttentionKernel kernel_ = AttentionKernel::Flash;
  ModelCost cost_;
  double capacity_ = 0;
};

}  // namespace

Plan plan_candidate(const Recipe& recipe, const HostFacts& host, double data_bytes) {
  PlanningOptions o;
  o.full = false;
  o.data_bytes = data_bytes;
  return Planner(recipe, host, o).plan();
}

double planned_data_bytes(const Recipe& recipe) { return data_bytes(recipe, recipe.batch.seq_len); }

Plan make_plan(const Recipe& recipe, const HostFacts& host) {
  if (!recipe.parallel.search.any()) return Planner(recipe, host).plan();
  // "auto" layout keys: the fastest predicted layout that fits (or the first, if none fits).
  std::vector<LayoutRow> rows = search_layouts(recipe, host);
  if (rows.empty() || !rows.front().problem.empty()) {
    ErrorContext c;
    c.key = "parallel.tensor";
    c.hint = "set parallel.tensor and parallel.pipeline to degrees the model divides by";
    throw Error(rows.empty() ? "no layout of this hardware can run the model" : "no layout of this hardware can run the model: " + rows.front().problem, c);
  }
  const LayoutRow& best = rows.front();
  Plan p = Planner(with_layout(recipe, best), host).plan();
  const ParallelOptions::Searched& searched = recipe.parallel.search;
  // The first searched key carries why; the others belong to the same layout.
  std::string why = rows.size() > 1 ? best.verdict + "; next: " + rows[1].describe() + ", " + rows[1].verdict : best.verdict;
  auto choose = [&](const char* key, const std::string& value) {
    p.choices.push_back({key, value, why});
    why = "the same layout";
  };
  if (searched.tensor) choose("parallel.tensor", std::to_string(best.tensor));
  if (searched.pipeline) choose("parallel.pipeline", std::to_string(best.pipeline));
  if (searched.schedule && best.pipeline > 1) choose("parallel.pipeline_schedule", to_string(best.schedule));
  if (searched.virtual_stages && best.pipeline > 1) choose("parallel.virtual_stages", std::to_string(best.virtual_stages));
  if (searched.expert) choose("parallel.expert", std::to_string(best.expert));
  if (searched.sequence_parallel) p.choices.push_back({"parallel.sequence_parallel", best.sequence_parallel ? "true" : "false", best.tensor > 1 ? "same traffic as without, 1/tensor of the activations between regions" : "no tensor parallelism"});
  p.layouts = std::move(rows);
  return p;
}

}  // namespace dsrun
