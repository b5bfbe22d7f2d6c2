#include "engine/plan/plan.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/data/token_source.hpp"
#include "engine/parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <numeric>
#include <cmath>

namespace dsrun {

ModelStateBytes plan_model_states_per_rank(const ModelStateOptions& o) {
  DSRUN_ASSERT(o.data_parallel >= 1 && o.zero_stage >= 0 && o.zero_stage <= 3, "validated options");
  const double psi = o.params;
  const double shard = std::ceil(psi / o.data_parallel);  // shards are padded, never uneven
  const bool mixed = o.dtype != DType::Fp32;
  const double e = mixed ? 2 : 4;                          // working weights and gradients
  const double master_per_param = mixed ? 4 : 0;           // fp32 master copy (fp32 training updates in place)
  const double state = bytes_per_element(o.state_dtype);   // each per-element state
  double optimizer_per_param = 2 * state;                  // Adam: m and v
  if (o.optimizer == OptimizerKind::Sgd) optimizer_per_param = o.momentum > 0 ? state : 0;

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

// With data.separate_documents, the share of a whole row's causal attention that attention within
// documents computes: the mean over rows of Σ document² / seq_len², measured on up to 256 rows
// spread over the corpus (the variable-length kernel skips the rest). 1 without separate documents,
// and where the corpus cannot be read yet (planning before `dsrun prepare`): an upper bound.
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

// What each pipeline stage holds and computes (one stage, the whole model, without a pipeline).
struct StageCost {
  double rank_params = 0;         // after tensor parallelism's split, without the routed experts
  double rank_expert_params = 0;  // the routed experts one rank keeps (1/ep of them, split by tp)
  double flops_per_sample = 0, routed_flops_per_sample = 0;
  double activation_bytes_per_sample = 0, routed_activation_bytes_per_sample = 0, checkpointed_activation_bytes_per_sample = 0;
  int moe_layers = 0;
  bool has_head = false, has_blocks = false;
  bool tied_head_copy = false;  // tied embeddings: the head's copy of the embedding (not in ZeRO)
  double attention_flops_per_sample = 0;  // of flops_per_sample
  double largest_param = 0;  // elements of the stage's largest parameter, whole (before tensor parallelism's split)
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
  Planner(const Recipe& r, const HostFacts& host, PlanningOptions options = {}) : r_(r), host_(host), options_(options) {
    const HardwareSpec& hw = r.hardware;
    dp_ = r.parallel.data_parallel_or_auto(hw);
    tp_ = r.parallel.tensor;
    pp_ = r.parallel.pipeline;
    v_ = r.parallel.virtual_stages;
    ep_ = r.parallel.expert;
    imbalance_ = ep_ > 1 ? r.parallel.expert_imbalance : 1.0;
    placement_ = placement_of(hw, layout_with({}));
    ranks_per_node_ = placement_.ranks_per_node;
    kernel_ = hw.device == Device::Cuda ? AttentionKernel::Flash : AttentionKernel::Math;
    kernels_ = planned_kernels(hw.device, host.kernels);
    ModelCostOptions cost;
    cost.fused_elementwise = hw.device == Device::Cuda;
    cost.local_vocab = r.model.vocab / std::max(1, tp_);
    cost.loss_chunk_tokens = r.model.arch == ModelArch::DeepSeek ? loss_chunk_tokens(r.batch, cost.local_vocab) : 0;
    cost_options_ = cost;
    cost_ = model_cost(r.model, r.batch.seq_len, r.precision.dtype, kernel_, cost);
    attention_fraction_ = options.attention_fraction >= 0 ? options.attention_fraction : document_attention_fraction(r);
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
      st.attention_flops_per_sample += unit.attention_flops_per_sample;
      st.routed_flops_per_sample += unit.routed_flops_per_sample;
      st.activation_bytes_per_sample += unit.activation_bytes_per_sample;
      st.routed_activation_bytes_per_sample += unit.routed_activation_bytes_per_sample;
      st.checkpointed_activation_bytes_per_sample += unit.checkpointed_activation_bytes_per_sample;
      st.moe_layers += unit.routed_expert_params > 0 ? 1 : 0;
      st.largest_param = std::max(st.largest_param, unit.largest_param);
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
  Evaluation evaluate(const Choice& l) const {
    Evaluation worst;
    for (size_t s = 0; s < stages_.size(); ++s) {
      Evaluation ev = evaluate_stage(l, static_cast<int>(s));
      if (s == 0 || rank_total(ev) > rank_total(worst)) worst = ev;
    }
    return worst;
  }

  Evaluation evaluate_stage(const Choice& l, int stage) const {
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
    o.state_dtype = r_.optimizer.state_dtype;
    o.offload = r_.parallel.offload;
    o.same_memory = hw.ranks_share_memory();
    o.delayed_update = r_.parallel.delayed_update;
    MemoryBreakdown& m = ev.memory;
    const ExecutionModes modes = modes_for(l);
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
    if (r_.data.separate_documents) {
      const double s = static_cast<double>(r_.batch.seq_len);
      if (modes.variable_length_attention)  // each token's position (int64); the documents' starts are a few bytes
        m.activations += live * l.micro * s * 8;
      else  // the document mask (bool, then a bias in the compute dtype, s x s) and each token's rotary rows (fp32 cos and sin)
        m.activations += live * l.micro * (s * s * (1 + bytes_per_element(r_.precision.dtype)) + s * r_.model.head_dim() * 8);
    }
    // Backward's transient on top: the loss gradient at its start, or with recomputation whichever
    // is larger of that and one block's recomputed activations (they are never live together).
    // The math attention kernel's softmax backward (heads split over tensor ranks) adds its own
    // transient in each layer; with recomputation it comes on top of that layer's activations.
    // The fused projection and loss has one chunk's transient whatever the micro-batch. Where it
    // computes the gradients during forward (one tensor rank, not fp16), each micro-batch whose
    // backward is still to come keeps its weight gradient (a pipeline's last stage under GPipe).
    double head_backward = 0;
    // The head's weight gradient where the fused loss makes it during forward, else 0.
    const double head_gradient_in_forward = st.has_head && modes.loss_gradients_in_forward
                                                ? bytes_per_element(r_.precision.dtype) * static_cast<double>(r_.model.vocab / tp_) * static_cast<double>(r_.model.hidden)
                                                : 0;
    if (st.has_head && cost_.loss_chunk_tokens > 0) {
      head_backward = cost_.loss_chunk_bytes(static_cast<double>(l.micro * r_.batch.seq_len)) + (live - 1) * head_gradient_in_forward;
    } else if (st.has_head) {
      head_backward = l.micro * cost_.head_backward_bytes_per_sample;
    }
    const double attention_backward = st.has_blocks ? l.micro * cost_.attention_backward_bytes_per_sample / tp_ : 0;
    m.backward_peak = l.checkpointing && st.has_blocks ? std::max(head_backward, l.micro * cost_.recomputed_layer_bytes_per_sample + attention_backward)
                                                       : std::max(head_backward, attention_backward);
    // Gradients left to autograd come as backward frees activations, except that one: held at the peak.
    if (modes.gradients_left_to_autograd)
      m.gradients_after_peak = std::min(std::max(0.0, m.states.grads - head_gradient_in_forward), m.activations + m.backward_peak);
    const double e = bytes_per_element(r_.precision.dtype);
    if (l.stage == 3 && dp_ > 1) {
      // The layer being computed, the prefetched next one, and one layer's full gradient before reduce-scatter.
      m.comm_buffers = 3 * e * cost_.largest_unit_params / tp_;
      // Without recomputation autograd keeps every layer's gathered weights (matmuls save them for
      // backward) until that layer's backward has run: the whole model, gathered, at the end of forward.
      if (!l.checkpointing) m.comm_buffers += e * (st.rank_params + st.rank_expert_params);
    } else if (dp_ > 1 && (l.stage == 2 || (l.stage == 1 && hw.device != Device::Cuda))) {
      // Reductions in flight: at most two buckets, or one unit larger than that (zero.cpp). Stage
      // 2 reduces a flat copy of each unit's gradient, beside autograd's gradients of the unit
      // whose backward runs; Gloo has no reduce-scatter and all-reduces a copy (stage 1: of the
      // accumulated gradient; stage 2: of the flat copy). NCCL's stage 1 reduces in place.
      const double unit = e * cost_.largest_unit_params / tp_;
      const double in_flight = std::min(std::max(2 * r_.parallel.bucket_bytes, unit), (st.rank_params + st.rank_expert_params) * e);
      const bool gloo = hw.device != Device::Cuda;
      m.comm_buffers = l.stage == 1 ? in_flight : in_flight * (gloo ? 2 : 1) + unit;
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
    ev.host = host_memory(m, st);
    ev.host_needed = ev.host.total() * ranks_per_node_;
    ev.device_fits = on_device <= capacity_;
    ev.host_fits = ev.host_needed <= hw.host_memory_bytes;
    ev.fits = ev.device_fits && ev.host_fits;
    return ev;
  }

  // Every host byte a rank holds (docs/plan.md): its process, offloaded states, the model build's
  // transient, the data; on CPU ranks the device terms too. The build runs before training: on
  // CPU ranks only what it needs beyond training's transients adds to the peak.
  HostMemory host_memory(const MemoryBreakdown& m, const StageCost& st) const {
    const HardwareSpec& hw = r_.hardware;
    HostMemory h;
    h.offloaded = m.states.host;
    h.data = data_bytes_;
    // A decoder is built deferred, one unit at a time; a ResNet or weights from a file, whole.
    const bool deferred = r_.model.arch == ModelArch::DeepSeek && r_.model.init_from.empty();
    if (r_.checkpoint.async && checkpoint_saves() > 0) h.checkpoint_staging = checkpoint_bytes() / (dp_ * tp_ * pp_);
    if (hw.ranks_share_memory()) {
      const double build = 4 * (deferred ? cost_.largest_unit_params : cost_.params);
      h.device = m.total();
      h.model_build = std::max(0.0, build - (m.activations + m.backward_peak + m.comm_buffers));
    } else {
      // A GPU rank builds each unit on its device, one parameter's fp32 initial values at a time in
      // host memory (under tensor parallelism the whole weight, then this rank's slice of it),
      // before NCCL and the CUDA libraries grow the process: the build's peak is the process then
      // plus that, and counts where it passes the process as it trains (measured on 4 H200).
      const bool several = dp_ * tp_ * pp_ > 1;
      h.process = hw.host_runtime_memory_bytes + (several ? hw.host_nccl_memory_bytes : 0);
      const double build = deferred ? 4 * st.largest_param * (tp_ > 1 ? 1.0 + 1.0 / tp_ : 1.0) : 4 * cost_.params;
      h.model_build = std::max(0.0, hw.host_build_memory_bytes + build - (h.process + h.data + h.checkpoint_staging));
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
    p.layout = layout_with({});
    p.expert_imbalance = imbalance_;
    p.world_size = dp_ * tp_ * pp_;
    p.ranks_per_node = ranks_per_node_;
    p.global_batch = r_.batch.global;
    p.seq_len = r_.model.arch == ModelArch::DeepSeek ? r_.batch.seq_len : 0;
    p.dtype = r_.precision.dtype;
    p.attention = kernel_;
    if (r_.data.separate_documents) p.document_attention = modes_for({}).variable_length_attention ? "variable-length" : "masked";
    p.attention_fraction = attention_fraction_;
    p.memory_capacity = capacity_;
    p.host_memory_capacity = hw.host_memory_bytes;
    p.steps = r_.run.steps;
    if (!r_.parallel.data_parallel)
      p.choices.push_back({"parallel.data_parallel", std::to_string(dp_),
                           "every device: " + std::to_string(hw.nodes) + " node(s) x " + std::to_string(hw.devices_per_node)});

    choose_layout(p);  // (its last choice may change cost_: the loss chunk)
    p.loss_chunk_tokens = cost_.loss_chunk_tokens;
    std::vector<std::string> refused;
    p.modes = decide_execution_modes(r_, p.layout, cost_.loss_chunk_tokens, kernels_, &refused);
    for (std::string& why : refused) p.notes.push_back(std::move(why));
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

 private:
  // The schedule the ranks will run, simulated before launch as their transport runs it (Gloo's
  // queued sends on CPU ranks; NCCL's in-order rendezvous, each group of sends and receives
  // issued together, on GPUs): every receive meets its send and nothing waits forever.
  void check_pipeline(Plan& p) {
    if (pp_ == 1) return;
    for (auto [begin, end] : pieces_) p.pipeline_pieces.push_back({begin, end});
    const PipelineTransport transport = r_.hardware.device == Device::Cuda ? PipelineTransport::RendezvousCoalesced : PipelineTransport::Queued;
    const std::string problem = pipeline_schedule_problem(p.layout.schedule, pp_, static_cast<int>(p.accumulation), v_);
    p.pipeline_problem = problem.empty() && options_.full ? pipeline_deadlock_problem(p.layout.schedule, pp_, static_cast<int>(p.accumulation), v_, transport) : problem;
    p.bubble_fraction = bubble_fraction(p.accumulation);
    if (!p.pipeline_problem.empty()) {
      p.fits = false;
      if (p.binds.empty()) p.binds = "the pipeline schedule";
      p.verdict.push_back("the pipeline schedule cannot run: " + p.pipeline_problem);
    }
  }

  // These degrees with a choice: the value the rules check and the ranks run.
  Layout layout_with(const Choice& c) const {
    Layout l = layout_of_recipe(r_);  // every degree fixed here
    l.sequence_parallel &= tp_ > 1;
    l.zero_stage = c.stage, l.micro = c.micro, l.recomputation = c.checkpointing;
    return l;
  }
  // Whether the layout rules (engine/recipe/layout.cpp) allow a choice: the planner picks only what
  // the ranks will accept.
  bool allowed(const Choice& c, bool stage_decided = true, bool micro_decided = true) const {
    LayoutDecided d;
    d.zero_stage = stage_decided;
    d.micro = micro_decided;
    return layout_problems(r_, layout_with(c), d).empty();
  }

  std::vector<int> stage_candidates() const {
    if (r_.parallel.zero_stage) return {*r_.parallel.zero_stage};
    std::vector<int> out;
    for (int stage = 0; stage <= 3; ++stage)
      if (allowed({stage, false, 1}, /*stage_decided=*/true, /*micro_decided=*/false)) out.push_back(stage);
    DSRUN_ASSERT(!out.empty(), "a layout without a ZeRO stage it can run is refused by its rules");
    return out;
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
    // The rules decide which divide (the interleaved schedule wants multiples of the stages).
    auto ok = [&](int64_t micro) { return allowed({0, false, micro}, /*stage_decided=*/false); };
    for (int64_t d = 1; d * d <= per_rank; ++d)
      if (per_rank % d == 0) {
        if (ok(d)) out.push_back(d);
        if (d != per_rank / d && ok(per_rank / d)) out.push_back(per_rank / d);
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
    Choice chosen{stages.back(), ckpts.back(), smallest_micro};
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

    // 2. The largest micro-batch that fits under that layout (fewer accumulation steps, better
    //    kernels); a pipeline's the smallest, for the most micro-batches a step and the least bubble
    //    ((p-1)/(m+p-1): the whole per-rank batch as one micro-batch leaves a stage idle (p-1)/p of it).
    const bool least_bubble = pp_ > 1 && !r_.batch.micro;
    if (found && !least_bubble) {
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
      else if (least_bubble)
        reason = "a pipeline: the smallest micro batch, " + std::to_string(per_rank / chosen.micro) + " micro-batches a step, for the least bubble (" +
                 format_double(100 * bubble_fraction(per_rank / chosen.micro), 3) + "%)";
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

    // 3. The loss chunk left to auto: a micro-batch's whole logits in one chunk where their fp32
    // values take at most 1/32 of the device and the layout still fits (one projection each way and
    // no fp32 weight-gradient sum across chunks: the 1B at 8 x 2048 on an H100, 2,097-token chunks
    // against one, ran 0.7% slower), else 256 MiB chunks.
    if (found && !r_.batch.loss_chunk_tokens && cost_.loss_chunk_tokens > 0) {
      const int64_t tokens = chosen.micro * r_.batch.seq_len;
      const double logits_bytes = 4.0 * static_cast<double>(tokens) * static_cast<double>(cost_options_.local_vocab);
      if (tokens > cost_.loss_chunk_tokens && logits_bytes <= capacity_ / 32) {
        const ModelCost chunked = cost_;
        ModelCostOptions whole = cost_options_;
        whole.loss_chunk_tokens = tokens;
        cost_ = model_cost(r_.model, r_.batch.seq_len, r_.precision.dtype, kernel_, whole);
        if (evaluate(chosen).fits)
          p.choices.push_back({"batch.loss_chunk_tokens", std::to_string(tokens),
                               "a micro-batch's logits in one chunk: " + format_bytes(logits_bytes) + " of fp32 logits, at most 1/32 of the device, and the layout still fits"});
        else
          cost_ = chunked;
      }
    }

    Evaluation ev = evaluate(chosen);
    p.layout = layout_with(chosen);
    p.accumulation = r_.batch.global / (chosen.micro * dp_);
    DSRUN_ASSERT(p.accumulation * chosen.micro * dp_ == r_.batch.global, "batch divisibility was validated");
    p.tokens_per_step = static_cast<double>(r_.batch.global) * cost_.tokens_per_sample;
    p.memory = ev.memory;
    p.memory_stage = ev.stage;
    p.live_micro_batches = live_micro_batches(p.accumulation, ev.stage);
    for (size_t st = 0; st < stages_.size(); ++st) {
      const Evaluation stage = evaluate_stage(chosen, static_cast<int>(st));
      p.stage_memory.push_back({stage.memory.states.device_total() + stage.memory.states.host, stage.memory.total(), stage.host.total()});
    }
    p.host = ev.host;
    p.host_memory_needed = ev.host_needed;
    p.fits = ev.fits;
    p.binds = ev.binds();

    // The verdict names what binds first (device memory per rank, host memory per node), then
    // how the other fares: never "does not fit" followed by a bare "fits".
    const HardwareSpec& hw = r_.hardware;
    const double total = rank_total(ev);
    const std::string device_line = ev.device_fits ? "fits: " + format_bytes(total) + " of " + format_bytes(capacity_) + " per rank, headroom " +
                                                         format_bytes(capacity_ - total) + " (" + format_double(100.0 * (capacity_ - total) / capacity_, 3) + "%)"
                                                   : "needs " + format_bytes(total) + " per rank, " + format_bytes(capacity_) + " available (short by " +
                                                         format_bytes(total - capacity_) + ")";
    const std::string host_line = format_bytes(ev.host_needed) + " of " + format_bytes(hw.host_memory_bytes) + " per node (" + std::to_string(ranks_per_node_) +
                                  " rank(s) x " + format_bytes(ev.host.total()) + ")";
    const std::string host_short = "needs " + format_bytes(ev.host_needed) + " per node, " + format_bytes(hw.host_memory_bytes) + " available (short by " +
                                   format_bytes(ev.host_needed - hw.host_memory_bytes) + "; " + std::to_string(ranks_per_node_) + " rank(s) x " +
                                   format_bytes(ev.host.total()) + ")";
    if (!ev.device_fits) p.verdict.push_back("does not fit: device memory " + device_line);
    else if (!ev.host_fits) p.verdict.push_back("does not fit: host memory (hardware.host_memory_gib) " + host_short);
    else p.verdict.push_back(device_line);
    if (!ev.device_fits && !ev.host_fits) p.verdict.push_back("host memory does not fit either (hardware.host_memory_gib): " + host_short);
    else if (!ev.device_fits && (hw.device == Device::Cuda)) p.verdict.push_back("host memory fits: " + host_line);
    else if (ev.device_fits && !ev.host_fits) p.verdict.push_back("device memory fits: " + format_bytes(total) + " of " + format_bytes(capacity_) + " per rank");
    else if (hw.device == Device::Cuda) p.verdict.push_back("host memory fits: " + host_line);
    if (!p.fits && options_.full) suggest(p, chosen, ev);
  }

  // A checkpoint is every parameter's fp32 master copy and optimizer states, once over all ranks
  // (each rank writes its slice). One that cannot fit on the disk is refused before launch; the
  // ones the retention keeps at once not fitting is said.
  double checkpoint_bytes() const {
    const double states = r_.optimizer.kind == OptimizerKind::Sgd ? (r_.optimizer.momentum > 0 ? 4 : 0) : 8;
    return cost_.params * (4 + states);
  }
  int64_t checkpoint_saves() const {
    const CheckpointOptions& ck = r_.checkpoint;
    const int64_t steps = r_.run.steps;
    return (ck.every > 0 ? steps / ck.every : 0) + (ck.at_end && (ck.every <= 0 || steps % ck.every != 0) ? 1 : 0);
  }

  void plan_checkpoint_disk(Plan& p) {
    CheckpointDisk& d = p.checkpoint_disk;
    const CheckpointOptions& ck = r_.checkpoint;
    const HardwareSpec& hw = r_.hardware;
    d.bytes = checkpoint_bytes();
    const int64_t steps = r_.run.steps;
    d.saves = checkpoint_saves();
    // The pause: every rank copies its share to host staging memory (over PCIe from a GPU; a memory
    // copy, read and write, on CPU ranks and of offloaded states), then the files are written at the disk's bandwidth,
    // the node's ranks sharing it. Asynchronous saves pause for the copy alone.
    d.async = ck.async;
    d.staging_per_rank = d.bytes / p.world_size;
    d.staging_pinned = hw.device == Device::Cuda && p.layout.offload == Offload::None;
    d.copy_seconds = d.staging_per_rank / (d.staging_pinned ? hw.host_link_bandwidth * r_.hardware.comm_efficiency : hw.host_memory_bandwidth / 2);
    d.write_seconds = d.staging_per_rank * ranks_per_node_ / hw.disk_write_bandwidth;
    d.read_seconds = d.staging_per_rank * ranks_per_node_ / hw.disk_read_bandwidth;
    // Synchronous saves copy nothing from host memory (they write the shards as they stand);
    // from a GPU each slice comes down as it is written.
    d.pause_seconds = ck.async ? d.copy_seconds : (d.staging_pinned ? d.copy_seconds : 0) + d.write_seconds;
    // A save waits for the one before it: saves closer together than a write takes stall training.
    if (ck.async && ck.every > 0 && d.saves > 1 && d.write_seconds > ck.every * p.step_seconds)
      p.notes.push_back("checkpoints come every " + format_seconds(ck.every * p.step_seconds) + " of training but take " + format_seconds(d.write_seconds) +
                        " to write: each save waits for the one before (raise checkpoint.every, or set hardware.disk_write_gbs to the disk's measured checkpoint_write_MBps)");
    // A new checkpoint is complete before retention deletes the oldest: keep_last + 1 at that moment.
    int64_t forever = 0;
    if (ck.keep_every > 0 && ck.every > 0) forever = steps / std::lcm(ck.every, ck.keep_every);
    d.kept = std::min(d.saves, ck.keep_last + 1 + forever);
    d.needed = static_cast<double>(d.kept) * d.bytes;
    d.free = host_.checkpoint_free_bytes;
    // Only where the run would write: a plan for hardware this machine lacks is about other disks.
    if (d.free < 0 || d.saves == 0 || !p.hardware_present) return;
    if (d.bytes > d.free) {
      p.fits = false;
      if (p.binds.empty()) p.binds = "disk";
      p.verdict.insert(p.verdict.begin(), "does not fit: disk (checkpoint.dir): one checkpoint is " + format_bytes(d.bytes) + ", " + format_bytes(d.free) + " free there");
      p.suggestions.push_back("set checkpoint.dir to a disk with " + format_bytes(d.needed) + " free (" + std::to_string(d.kept) + " checkpoint(s) at once), or checkpoint.every = 0 and checkpoint.at_end = false to save none");
    } else if (d.needed > d.free) {
      p.verdict.push_back("disk (checkpoint.dir) holds " + std::to_string(static_cast<int64_t>(d.free / d.bytes)) + " checkpoint(s) of " + format_bytes(d.bytes) + " but the retention keeps up to " +
                          std::to_string(d.kept) + " at once (" + format_bytes(d.needed) + "): lower checkpoint.keep_last, or free space");
    }
  }

  // What would fit instead: the least invasive changes first, then more devices.
  void suggest(Plan& p, const Choice& current, const Evaluation& now) {
    if (now.device_fits && !now.host_fits) suggest_host(p, now);
    struct Option {
      Choice layout;
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
          if (off != r_.parallel.offload) sets += std::string(" --set parallel.offload=") + to_string(off);
          if (r_.batch.micro || per_rank > 1) sets += " --set batch.micro=1";
          options.push_back({{stage, ckpt, 1}, off, sets});
        }
    int shown = 0;
    for (const auto& o : options) {
      Recipe alt = r_;
      alt.parallel.offload = o.offload;
      Planner alt_planner(alt, host_);
      if (!alt_planner.allowed(o.layout)) continue;
      Evaluation ev = alt_planner.evaluate(o.layout);
      if (!ev.fits) continue;
      p.suggestions.push_back("fits with " + o.sets + " (" + alt_planner.usage(ev) + ")");
      if (++shown == 2) break;
    }
    // More GPUs of the same kind, with ZeRO-3, recomputation and micro batch 1 (CPU ranks share
    // one memory, so more of them never helps); not when only host memory binds.
    if (shown > 0 || r_.hardware.device != Device::Cuda || now.device_fits) {
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

  // Host memory binds: the key that says how much a node has, fewer ranks per node, and (below)
  // any layout change that holds less on the host.
  void suggest_host(Plan& p, const Evaluation& now) const {
    const double GiB = 1024.0 * 1024.0 * 1024.0;
    p.suggestions.push_back("if the nodes have more host memory, say so: --set hardware.host_memory_gib=" +
                            std::to_string(static_cast<int64_t>(std::ceil(now.host_needed / GiB))) + " (the plan needs " + format_bytes(now.host_needed) + " per node)");
    const int per_node = static_cast<int>(std::floor(r_.hardware.host_memory_bytes / std::max(1.0, now.host.total())));
    if (per_node >= 1 && per_node < ranks_per_node_)
      p.suggestions.push_back("at most " + std::to_string(per_node) + " rank(s) per node fit in " + format_bytes(r_.hardware.host_memory_bytes) + " (" +
                              format_bytes(now.host.total()) + " each): more hardware.nodes with fewer ranks on each (hardware.devices_per_node = " +
                              std::to_string(per_node) + ")");
  }

  // The parameters of one rank's ZeRO shards: its share of the rest over the data ranks, and of
  // its routed experts over the ranks keeping the same ones (shards are padded, never uneven).
  double shard_params() const { return std::ceil(rank_params_ / dp_) + std::ceil(rank_expert_params_ / (dp_ / ep_)); }

  // Where a group's members sit decides its price (docs/plan.md, "The network"): a group inside
  // one node runs at the bus bandwidth `dsrun probe` measured for its collective and size, else at
  // the device link × comm_efficiency (halved without GPU peer-to-peer: copies go through host
  // memory); a group that spans nodes at the smaller of that and each rank's share of its node's
  // network link. Ranks sit on nodes in rank order (the launcher's placement).
  struct GroupLink {
    double bandwidth = 0;  // bytes/s a member sends at
    int nodes = 1;         // nodes the group spans
  };
  double link_share() const {
    const HardwareSpec& hw = r_.hardware;
    return hw.link_bandwidth / (hw.device == Device::Cuda && !hw.p2p ? 2 : 1) * hw.comm_efficiency;
  }
  // `op` over `members` ranks of one node.
  double intra_node_bandwidth(Collective op, int members) const {
    const double probed = r_.hardware.collectives.of(op, members);
    return probed > 0 ? probed : link_share();
  }
  double point_to_point_bandwidth() const {
    const double probed = r_.hardware.collectives.point_to_point;
    return probed > 0 ? probed : link_share();
  }
  double inter_node_share() const { return r_.hardware.inter_node_bandwidth / placement_.ranks_per_node * r_.hardware.comm_efficiency; }
  // A mesh dimension's group of rank 0 (ranks 0, stride, ..., count of them) running `op`.
  GroupLink group_link(Collective op, int64_t stride, int64_t count) const {
    GroupLink g;
    g.nodes = placement_.nodes_spanned(0, stride, count);
    const int local = static_cast<int>((count + g.nodes - 1) / g.nodes);  // members on one node
    const double intra = intra_node_bandwidth(op, local);
    g.bandwidth = g.nodes > 1 ? std::min(intra, inter_node_share()) : intra;
    return g;
  }
  static std::string where(const GroupLink& g) { return g.nodes > 1 ? "across " + std::to_string(g.nodes) + " nodes" : "within a node"; }

  void predict_communication(Plan& p) {
    const double psi = rank_params_;
    const double e = bytes_per_element(r_.precision.dtype);
    const double a = static_cast<double>(p.accumulation);
    // ZeRO's collectives over a group of data ranks for `params` parameters (the routed experts'
    // over the dp/ep ranks keeping the same ones, with `of` naming them), priced by the group's link.
    auto data_parallel = [&](double params, int ranks, int64_t stride, const std::string& of) {
      if (ranks <= 1) return;
      const GroupLink reduce = group_link(p.layout.zero_stage == 0 ? Collective::AllReduce : Collective::ReduceScatter, stride, ranks);
      const GroupLink gather = group_link(Collective::AllGather, stride, ranks);
      const std::string at = ", " + where(reduce);
      // The updated parameters' gather follows the step; everything else runs beside compute.
      auto add = [&](const GroupLink& link, const std::string& what, double bytes, bool beside_compute) {
        if (bytes > 0) p.comm.push_back({what, bytes, bytes / link.bandwidth, beside_compute});
      };
      const double ring = (ranks - 1.0) / ranks;  // ring collectives: each rank sends (N-1)/N of the buffer per pass
      switch (p.layout.zero_stage) {
        case 0: add(reduce, "all-reduce gradients" + of + " (once per step" + at + ")", 2 * ring * params * e, true); break;
        case 1:
          add(reduce, "reduce-scatter gradients" + of + " (once per step" + at + ")", ring * params * e, true);
          add(gather, "all-gather updated parameters" + of + " (" + where(gather) + ")", ring * params * e, false);
          break;
        case 2:
          add(reduce, "reduce-scatter gradients" + of + " (every micro-batch" + at + ")", a * ring * params * e, true);
          add(gather, "all-gather updated parameters" + of + " (" + where(gather) + ")", ring * params * e, false);
          break;
        case 3:
          add(gather, "all-gather parameters" + of + " for forward (every micro-batch" + at + ")", a * ring * params * e, true);
          add(gather, "all-gather parameters" + of + " for backward (every micro-batch" + at + ")", a * ring * params * e, true);
          add(reduce, "reduce-scatter gradients" + of + " (every micro-batch" + at + ")", a * ring * params * e, true);
          break;
      }
    };
    // Data rank d sits tp ranks after d-1; the replicas of an expert shard sit tp·ep apart.
    data_parallel(psi, dp_, tp_, "");
    data_parallel(rank_expert_params_, dp_ / ep_, static_cast<int64_t>(tp_) * ep_, " of the routed experts");
    if (ep_ > 1) {
      // Each MoE layer sends every (token, choice) pair's row to its expert's rank and back, in
      // forward and again in backward (and once more when recomputed): [micro · s · k, h] each
      // way, of which (ep-1)/ep leaves the rank; the busiest rank's share is `imbalance` times
      // the mean. The ep ranks are consecutive data ranks: what goes to members on other nodes
      // crosses the network, the rest the node's link, both at once.
      const int moe_layers = busiest_stage_moe_layers();
      const double pairs = static_cast<double>(p.layout.micro) * r_.batch.seq_len * r_.model.moe.top_k;
      const double passes = p.layout.recomputation ? 6 : 4;
      const double rows = a * moe_layers * passes * pairs * r_.model.hidden * e * imbalance_;
      const GroupLink link = group_link(Collective::AllToAll, tp_, ep_);
      const double local = static_cast<double>(ep_) / link.nodes;  // members on this rank's node
      const double intra = rows * (local - 1) / ep_, inter = rows * (ep_ - local) / ep_;
      const double seconds = std::max(intra / intra_node_bandwidth(Collective::AllToAll, static_cast<int>(local)), inter > 0 ? inter / inter_node_share() : 0.0);
      p.comm.push_back({"all-to-all tokens to their experts and back (expert, " + std::to_string(static_cast<int>(passes)) + " per MoE layer, every micro-batch, " +
                            (link.nodes > 1 ? format_double(100 * inter / (intra + inter), 3) + "% across nodes" : "within a node") + ")",
                        intra + inter, seconds});
    }
    if (tp_ > 1) {
      // Megatron's tensor parallelism: per layer two all-reduces of the activations [b, s, h] in
      // forward and two in backward, every micro-batch, over the tensor group (consecutive ranks:
      // inside a node unless parallel.tensor_across_nodes says otherwise). Sequence parallelism
      // replaces each by a reduce-scatter and an all-gather: the same bytes.
      const double activation = static_cast<double>(p.layout.micro) * r_.batch.seq_len * r_.model.hidden * e;
      const double t = tp_, bytes = a * 4.0 * r_.model.layers * 2 * (t - 1) / t * activation;
      const GroupLink link = group_link(Collective::AllReduce, 1, tp_);
      p.comm.push_back({std::string(r_.parallel.sequence_parallel ? "reduce-scatter + all-gather activations (tensor, sequence-parallel, 4 per layer, every micro-batch, "
                                                                  : "all-reduce activations (tensor, 4 per layer, every micro-batch, ") +
                            where(link) + ")",
                        bytes, bytes / link.bandwidth});
    }
    if (pp_ > 1) {
      // Every chunk sends its output forward and its input's gradient back, every micro-batch:
      // [micro, seq, hidden] (1/t of it with sequence parallelism). Stages are the outermost
      // dimension, dp × tp ranks apart: a boundary crosses nodes when its two stages' ranks do
      // (interleaving also wraps from the last stage to the first). The busiest rank sits on a
      // crossing boundary when there is one.
      const int64_t stage_ranks = static_cast<int64_t>(dp_) * tp_;
      auto crosses = [&](int64_t from, int64_t to) {  // stage `from`'s ranks and stage `to`'s
        const int64_t lo = std::min(from, to), hi = std::max(from, to);
        return placement_.node_of(static_cast<int>(lo * stage_ranks)) != placement_.node_of(static_cast<int>((hi + 1) * stage_ranks - 1));
      };
      int boundaries = pp_ - 1, crossing = 0;
      for (int s = 0; s + 1 < pp_; ++s) crossing += crosses(s, s + 1) ? 1 : 0;
      if (v_ > 1) {
        ++boundaries;
        crossing += crosses(pp_ - 1, 0) ? 1 : 0;
      }
      const double intra = point_to_point_bandwidth(), inter = std::min(intra, inter_node_share());
      const double p2p_bw = crossing > 0 ? inter : intra;
      const double activation = static_cast<double>(p.layout.micro) * r_.batch.seq_len * r_.model.hidden * e / (r_.parallel.sequence_parallel ? tp_ : 1);
      const double bytes = 2 * a * v_ * activation;
      p.comm.push_back({"send/receive activations and their gradients (pipeline, every micro-batch, " +
                            (crossing > 0 ? std::to_string(crossing) + " of " + std::to_string(boundaries) + " stage boundaries across nodes" : "within a node") + ")",
                        bytes, bytes / p2p_bw});
      if (r_.model.tie_embeddings) {
        const double tied = 2 * cost_.embedding_params / tp_ * e;
        const bool tied_crosses = placement_.node_of(0) != placement_.node_of(static_cast<int>((pp_ - 1) * stage_ranks));
        p.comm.push_back({std::string("tied embedding to the last stage and its gradient back (pipeline, once per step, ") + (tied_crosses ? "across nodes" : "within a node") + ")",
                          tied, tied / (tied_crosses ? inter : intra)});
      }
    }
    for (const auto& c : p.comm) p.comm_seconds += c.seconds;

    // Overlap: on GPUs gradient collectives run on their own stream during backward (stages 0-1:
    // the last micro-batch's), ZeRO-3's gathers beside forward and backward; what outlasts that
    // window is exposed, and what it hides still slows the compute beside it by
    // hardware.overlap_cost of its time (`dsrun probe` measured 0.624 on 4 H200: NCCL's kernels
    // take SMs and memory bandwidth from the products). On CPU ranks Gloo competes for the same
    // cores: nothing overlaps.
    const double compute = compute_seconds(p);
    if (r_.hardware.device == Device::Cpu) {
      p.exposed_comm_seconds = p.comm_seconds;
    } else {
      double beside = 0, in_line = 0;
      for (const auto& c : p.comm) (c.beside_compute ? beside : in_line) += c.seconds;
      const double backward = compute * 2.0 / 3.0;
      const double window = p.layout.zero_stage <= 1 ? backward / a : p.layout.zero_stage == 2 ? backward : compute;
      p.comm_slowdown_seconds = r_.hardware.overlap_cost * std::min(beside, window);
      p.exposed_comm_seconds = std::max(0.0, beside - window) + in_line + p.comm_slowdown_seconds;
    }

    // Offload traffic over PCIe: gradient shard down, updated parameter shard up; ZeRO-3 parameter
    // offload also fetches the parameter shard for every forward and backward.
    if (p.layout.offload != Offload::None && r_.hardware.device == Device::Cuda) {
      const double shard = shard_params();
      double bytes = 2 * shard * e;
      if (p.layout.offload == Offload::OptimizerAndParams) bytes += 2 * a * shard * e;
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
    double per_sample = cost_.model_flops_per_sample + (p.layout.recomputation ? cost_.recompute_flops_per_sample : 0);
    p.hardware_flops_per_step = per_sample * static_cast<double>(r_.batch.global);
    // Within documents the model needs only each document's attention: MFU counts that.
    const double skipped_attention = r_.data.separate_documents ? (1 - attention_fraction_) * cost_.attention_flops_per_sample : 0;
    p.model_flops_per_step = (cost_.model_flops_per_sample - skipped_attention) * static_cast<double>(r_.batch.global);
    p.peak_flops = peak_flops();
    // A pipeline step lasts as long as its busiest stage's share of the work, stretched by the
    // bubble; under expert parallelism the busiest rank's routed experts compute `imbalance` times the mean.
    // On GPUs the routed experts run as grouped matrix products, at their own measured efficiency
    // (hardware.grouped_matmul_efficiency); on CPUs as one product per expert, like the rest.
    const double per_flop = p.hardware_flops_per_step / cost_.model_flops_per_sample / (dp_ * tp_);
    const double grouped_efficiency = r_.hardware.device == Device::Cuda ? r_.hardware.grouped_matmul_efficiency : r_.hardware.matmul_efficiency;
    // On GPUs with hardware.attention_efficiency given, attention is priced apart: the causal
    // flash kernels compute half of the 12·L·h·s FLOPs counted per token, at that efficiency;
    // otherwise the counted FLOPs at matmul_efficiency, like the rest. Within documents the
    // variable-length kernel computes attention_fraction_ of a whole row's.
    const bool gpu = r_.hardware.device == Device::Cuda;
    const bool apart = gpu && r_.hardware.attention_efficiency > 0;
    const double attention_efficiency = apart ? r_.hardware.attention_efficiency : r_.hardware.matmul_efficiency;
    const double attention_share = (p.modes.variable_length_attention ? attention_fraction_ : 1.0) * (apart ? 0.5 : 1.0);
    double busiest = 0;
    for (const StageCost& st : stages_) {
      const double attention = per_flop * st.attention_flops_per_sample;
      const double dense = per_flop * (st.flops_per_sample - st.routed_flops_per_sample) - attention, routed = per_flop * imbalance_ * st.routed_flops_per_sample;
      busiest = std::max(busiest, dense / (p.peak_flops * r_.hardware.matmul_efficiency) + routed / (p.peak_flops * grouped_efficiency) +
                                      attention * attention_share / (p.peak_flops * attention_efficiency));
    }
    return busiest / (1 - bubble_fraction(p.accumulation));
  }

  // The offload pipeline (docs/plan.md): gradients come down unit by unit during the last
  // micro-batch's backward; the host step starts once their norm is known and runs unit by unit in
  // forward order, each unit's parameters going up as soon as they are written, and the next
  // step's first micro-batch waits for each unit in its forward (so that forward, and no more,
  // overlaps the host step's tail). The delayed update runs the whole host step beside the next
  // step's compute instead. ZeRO-3 parameter fetches from the host are prefetched a unit ahead:
  // hidden behind compute where they take less time than it.
  double hidden_offload_seconds(const Plan& p, double shard, double e) const {
    const double link = r_.hardware.host_link_bandwidth;
    const double micro_batches = static_cast<double>(std::max<int64_t>(1, p.accumulation));
    const double forward = p.compute_seconds / 3 / micro_batches, backward = 2 * p.compute_seconds / 3 / micro_batches;
    const double down = shard * e / link;
    const double up = p.layout.offload == Offload::OptimizerAndParams ? 0 : shard * e / link;
    const double fetch = std::max(0.0, p.offload_seconds - down - up - p.compute_seconds);
    const double host = p.optimizer_seconds;
    const double exposed_down = std::max(0.0, down - backward);
    double exposed = 0;
    if (r_.parallel.delayed_update) {
      // Beside compute the host step runs slower than alone (hardware.host_step_beside_compute, measured)
      // and shares host memory with the copies the GPU makes meanwhile.
      const double host_beside = host * r_.hardware.host_step_beside_compute + p.offload_seconds * link / (r_.hardware.host_memory_bandwidth / ranks_per_node_);
      const double device_side = p.compute_seconds + p.exposed_comm_seconds + exposed_down + std::max(0.0, up - p.compute_seconds / 3) + fetch;
      exposed = std::max(device_side, host_beside) - p.compute_seconds - p.exposed_comm_seconds;
    } else {
      exposed = exposed_down + std::max(0.0, std::max(host, up) - forward) + fetch;
    }
    // Negative where the delayed update's host step, slowed beside compute, outlasts the compute by
    // more than the host step and the copies take alone: the step grows by the difference.
    return r_.parallel.delayed_update ? host + p.offload_seconds - exposed : std::max(0.0, host + p.offload_seconds - exposed);
  }

  // The most MoE layers a pipeline stage holds (every layer without pipelining).
  int busiest_stage_moe_layers() const {
    int moe_layers = 0;
    for (const StageCost& st : stages_) moe_layers = std::max(moe_layers, st.moe_layers);
    return moe_layers;
  }

  // Memory-bound work the FLOPs leave out, on GPUs (on CPUs matmul_efficiency absorbs it), per
  // rank: the cross-entropy converts its slice of the logits to fp32 and runs log-softmax forward
  // and backward, about 24 + 2e bytes per token and vocabulary entry; a MoE layer moves each
  // token's k rows through dispatch, the experts' return to pair order and the weighted sum, about
  // 14·k·h·e bytes per token forward and backward (docs/plan.md; measured in docs/benchmarks.md).
  double elementwise_seconds() const {
    if (r_.hardware.device != Device::Cuda || r_.model.arch != ModelArch::DeepSeek) return 0;
    const double e = bytes_per_element(r_.precision.dtype);
    const double tokens = static_cast<double>(r_.batch.global) * static_cast<double>(r_.batch.seq_len) / dp_;
    const int moe_layers = busiest_stage_moe_layers();
    // Fused with the projection (cost_.loss_chunk_tokens > 0): the products write fp32 logits, the
    // log-sum-exp reads them, one kernel reads them again and writes the gradient: 12 + e bytes.
    // Where backward recomputes the logits (not loss_gradients_in_forward): that again, and a third product.
    const bool fused_loss = cost_.loss_chunk_tokens > 0, recomputed = fused_loss && !modes_for({}).loss_gradients_in_forward;  // (no choice changes it)
    const double loss_bytes = !fused_loss ? 24 + 2 * e : recomputed ? 2 * (12 + e) : 12 + e;
    const double loss = loss_bytes * static_cast<double>(r_.model.vocab) / tp_;
    const double recomputed_logits = recomputed ? tokens * 2.0 * r_.model.hidden * r_.model.vocab / tp_ / (peak_flops() * r_.hardware.matmul_efficiency) : 0;
    const double permutation = 14.0 * r_.model.moe.top_k * r_.model.hidden * e * moe_layers;
    return tokens * (loss + permutation) / r_.hardware.memory_bandwidth + recomputed_logits;
  }

  void predict_time(Plan& p) {
    p.compute_seconds = compute_seconds(p);
    // The optimizer step is memory-bound. Per parameter of the shard it reads and writes the fp32
    // weights (8 bytes) and each state (8 bytes each in fp32, 4 in bf16: Adam's m and v, SGD's
    // momentum), reads the gradient, and with mixed precision writes the working copy.
    const double e = bytes_per_element(r_.precision.dtype);
    const bool mixed = r_.precision.dtype != DType::Fp32;
    int states = r_.optimizer.kind == OptimizerKind::Sgd ? (r_.optimizer.momentum > 0 ? 1 : 0) : 2;
    double touched = 8 + 2.0 * bytes_per_element(r_.optimizer.state_dtype) * states + e + (mixed ? e : 0);
    const double shard = p.layout.zero_stage >= 1 ? shard_params() : rank_params_ + rank_expert_params_;
    // Offloaded, the step runs on the host, whose memory bandwidth the node's ranks share.
    const bool host_step = p.layout.offload != Offload::None && r_.hardware.device == Device::Cuda;
    // On a GPU the gradient also passes through memory outside the step: autograd accumulates it
    // (3e) into the gradient buffer, or, left to autograd on one rank, into the first micro-batch's
    // gradient for each later one. dsrun's Adam kernel (engine/train/adam_kernel.h) reads it in the
    // working dtype and writes the working copy in the same pass: no fp32 copy, no separate publication.
    // The norm (clipping, the metric) reads it once more before the step: e.
    if (r_.hardware.device == Device::Cuda && !host_step) {
      const double micro_batches = static_cast<double>(p.accumulation);
      touched += 3 * e * (p.modes.gradients_left_to_autograd ? (micro_batches - 1) / micro_batches : 1);
      touched += e;
    }
    // Offloaded, the fused host step's own measured throughput (hardware.host_optimizer_gbs, `dsrun
    // probe`) where given: it runs below the memory's bandwidth where the cores, not the memory, bind.
    const double host_bandwidth = r_.hardware.host_optimizer_bandwidth > 0 ? r_.hardware.host_optimizer_bandwidth : r_.hardware.host_memory_bandwidth;
    const double bandwidth = host_step ? host_bandwidth / ranks_per_node_ : r_.hardware.memory_bandwidth;
    p.optimizer_seconds = shard * touched / bandwidth;
    p.offload_hidden_seconds = host_step ? hidden_offload_seconds(p, shard, e) : 0;
    p.elementwise_seconds = elementwise_seconds();
    p.step_seconds = p.compute_seconds + p.elementwise_seconds + p.exposed_comm_seconds + p.optimizer_seconds + p.offload_seconds - p.offload_hidden_seconds;
    p.tokens_per_second = p.tokens_per_step / p.step_seconds;
    p.mfu = p.model_flops_per_step / (p.step_seconds * p.peak_flops * p.world_size);
    p.total_seconds = p.step_seconds * static_cast<double>(r_.run.steps);
    // Start-up scales with what it must do: every rank builds (or reads) the fp32 weights of its
    // units and loads its data; 0.5 GB/s is slow on purpose, so a healthy start never times out.
    const double startup_bytes = 4 * (rank_params_ + rank_expert_params_) + data_bytes_;
    p.startup_timeout_seconds = r_.run.startup_timeout_s > 0 ? r_.run.startup_timeout_s : 120 + startup_bytes / 0.5e9;
  }

  void check_hardware_present(Plan& p) {
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

  void add_notes(Plan& p) {
    const HardwareSpec& hw = r_.hardware;
    if (pp_ > 1 && p.accumulation < pp_)
      p.notes.push_back("fewer micro-batches a step (" + std::to_string(p.accumulation) + ") than pipeline stages (" + std::to_string(pp_) + "): each stage idles " +
                        format_double(100 * p.bubble_fraction, 3) + "% of the step; on 4 GPUs such a run (the 7B, pipeline 2 x data 2, one micro-batch) stopped at its first step "
                        "with NCCL's \"Message truncated\" (docs/benchmarks.md): a smaller batch.micro gives at least " + std::to_string(pp_) + " micro-batches");
    if (hw.ranks_share_memory())
      p.notes.push_back("CPU ranks share the node's " + format_bytes(hw.memory_bytes) + "; each rank's share is " + format_bytes(capacity_));
    if (kernel_ == AttentionKernel::Math && r_.model.arch == ModelArch::DeepSeek)
      p.notes.push_back("attention on CPU keeps the s x s probabilities of every head (no flash kernel in libtorch 1.13)");
    if (hw.device == Device::Cuda && !hw.p2p && dp_ > 1)
      p.notes.push_back("no GPU peer-to-peer: collectives go through host memory (half the link bandwidth assumed); NCCL needs NCCL_P2P_DISABLE=1 here");
    if (hw.device == Device::Cpu && p.layout.offload != Offload::None)
      p.notes.push_back("offload on CPU ranks moves nothing (host and device memory are the same); the same code path runs, with separate host copies");
    if (p.layout.zero_stage > 0 && dp_ == 1) p.notes.push_back("ZeRO stage " + std::to_string(p.layout.zero_stage) + " with one rank shards nothing");
    if (p.offload_hidden_seconds < 0)
      p.notes.push_back("the delayed update's host step, " + format_double(hw.host_step_beside_compute, 3) + " times slower beside compute (hardware.host_step_beside_compute), outlasts the step's compute by " +
                        format_seconds(-p.offload_hidden_seconds) + " more than it takes alone: more sequences per step (batch.global) hide it, and without parallel.delayed_update "
                        "the step may be shorter");
    if (hw.device == Device::Cuda && pp_ > 1)
      p.notes.push_back("pipeline on GPUs: each run of a stage's sends and receives goes out as one NCCL group (Megatron-LM's send_forward_recv_backward); "
                        "the schedule was simulated under NCCL's semantics (in-order rendezvous per pair) before launch (docs/parallelism.md, \"On GPUs\")");
    int64_t shard_pad = static_cast<int64_t>(std::ceil(rank_params_ / dp_) * dp_ - rank_params_);
    if (p.layout.zero_stage > 0 && shard_pad > 0)
      p.notes.push_back(format_count(cost_.params) + " parameters do not divide by " + std::to_string(dp_) + " ranks: shards are padded by " +
                        std::to_string(shard_pad) + " elements");
    if (hw.device == Device::Cuda && r_.model.moe.enabled())
      p.notes.push_back("routed experts run as grouped matrix products at " + format_double(100 * hw.grouped_matmul_efficiency, 3) + "% of peak FLOP/s (" +
                        std::to_string(r_.model.moe.routed_experts / ep_) + " per MoE layer on a rank; hardware.grouped_matmul_efficiency)");
    const bool probed = !hw.collectives.ranks.empty();
    p.notes.push_back("speed assumes " + format_double(100 * hw.matmul_efficiency, 3) + "% of peak FLOP/s and " +
                      (probed ? "the probed bus bandwidth of each collective and group size within a node (hardware.collective_ranks, hardware.*_gbs)"
                              : format_double(100 * hw.comm_efficiency, 3) + "% of link bandwidth") +
                      " (hardware.matmul_efficiency" + (probed ? "" : ", comm_efficiency") + ")");
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

}  // namespace

Plan plan_candidate(const Recipe& recipe, const HostFacts& host, const PlannedData& data) {
  PlanningOptions o;
  o.full = false;
  o.data_bytes = data.bytes;
  o.attention_fraction = data.attention_fraction;
  return Planner(recipe, host, o).plan();
}

PlannedData planned_data(const Recipe& recipe) { return {data_bytes(recipe, recipe.batch.seq_len), document_attention_fraction(recipe)}; }

Plan plan_fixed_layout(const Recipe& recipe, const HostFacts& host) {
  DSRUN_ASSERT(!recipe.parallel.search.any(), "the search fixes every degree before planning");
  return Planner(recipe, host).plan();
}

}  // namespace dsrun
