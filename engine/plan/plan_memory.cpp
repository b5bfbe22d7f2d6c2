// What a rank holds under a choice: model states, activations, transients, host memory, each
// pipeline stage; the checkpoint's disk and staging (docs/plan.md, memory).
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/parallel/pipeline_schedule.hpp"
#include "engine/plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dsrun::planning {

void Planner::add_units(StageCost& st, int begin, int end) const {
  double params = 0, replicated = 0, routed = 0, all_routed = 0;
  for (int u = begin; u < end; ++u) {
    const ModelCost::Unit& unit = cost_.units[u];
    params += unit.params;
    replicated += degrees_.tensor > 1 ? unit.tensor_replicated_params : 0;
    routed += degrees_.expert > 1 ? unit.routed_expert_params : 0;  // (without expert parallelism they are the blocks' like any weight)
    all_routed += unit.routed_expert_params;
    st.flops_per_sample += unit.flops_per_sample;
    st.attention_flops_per_sample += unit.attention_flops_per_sample;
    st.fp8_flops_per_sample += unit.fp8_flops_per_sample;
    st.fp8_params += unit.fp8_params;
    if (unit.routed_expert_params == 0) st.fp8_params_dense_units += unit.fp8_params;
    st.fp8_widths += unit.fp8_widths;
    st.fp8_activation_saving_per_token += unit.fp8_activation_saving_per_token;
    st.routed_flops_per_sample += unit.routed_flops_per_sample;
    st.activation_bytes_per_sample += unit.activation_bytes_per_sample;
    st.routed_activation_bytes_per_sample += unit.routed_activation_bytes_per_sample;
    st.checkpointed_activation_bytes_per_sample += unit.checkpointed_activation_bytes_per_sample;
    st.moe_layers += unit.routed_expert_params > 0 ? 1 : 0;
    st.layers += u > 0 && u + 1 < static_cast<int>(cost_.units.size()) ? 1 : 0;
    st.largest_param = std::max(st.largest_param, unit.largest_param);
    st.has_blocks |= u > 0 && u + 1 < static_cast<int>(cost_.units.size());
  }
  st.rank_params += (params - routed - replicated) / degrees_.tensor + replicated;
  st.rank_expert_params += routed / (degrees_.tensor * degrees_.expert);
  st.local_routed_params += all_routed / (degrees_.tensor * degrees_.expert);
}

Planner::ContextKvWidth Planner::context_kv_width() const {
  const ModelSpec& m = r_.model;
  // Latent attention expands each head's key (its rope part shared) and value before attention;
  // grouped-query attention repeats its KV heads for the query heads after the gather.
  if (m.latent_attention()) {
    const double width = static_cast<double>(m.heads) * static_cast<double>(m.qk_head_dim() + m.v_head_dim());
    return {width, width};
  }
  return {2.0 * m.kv_heads * m.head_dim(), 2.0 * m.heads * m.head_dim()};
}

void Planner::split_into_stages() {
  if (cost_.units.empty()) {  // images: one stage, the whole model
    stages_.push_back({cost_.params, 0, cost_.model_flops_per_sample, 0, cost_.activation_bytes_per_sample, 0, cost_.checkpointed_activation_bytes_per_sample, 0, true, true, false});
  } else {
    std::vector<double> flops;
    for (const auto& u : cost_.units) flops.push_back(u.flops_per_sample);
    pieces_ = degrees_.pipeline > 1 ? balanced_split(flops, degrees_.pipeline * degrees_.virtual_stages) : std::vector<std::pair<int, int>>{};
    stages_.assign(degrees_.pipeline, StageCost{});
    if (degrees_.pipeline == 1) {  // the whole model: its totals (the units' sums, but for the norms' few FLOPs)
      StageCost& st = stages_[0];
      add_units(st, 0, static_cast<int>(cost_.units.size()));
      st.flops_per_sample = cost_.model_flops_per_sample;
      st.activation_bytes_per_sample = cost_.activation_bytes_per_sample;
      st.checkpointed_activation_bytes_per_sample = cost_.checkpointed_activation_bytes_per_sample;
      st.has_head = st.has_blocks = true;
    }
    for (size_t g = 0; g < pieces_.size(); ++g) {
      StageCost& st = stages_[g % degrees_.pipeline];
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

double Planner::live_micro_batches(int64_t accumulation, int stage) const {
  if (degrees_.pipeline == 1) return 1;
  const double m = static_cast<double>(accumulation);
  switch (r_.parallel.pipeline_schedule) {
    case PipelineScheduleKind::GPipe: return m;
    case PipelineScheduleKind::OneFOneB: return std::min<double>(degrees_.pipeline - stage, m);
    case PipelineScheduleKind::Interleaved: return std::min<double>((degrees_.pipeline - stage - 1) * 2.0 + (degrees_.virtual_stages - 1) * degrees_.pipeline + 1, m * degrees_.virtual_stages) / degrees_.virtual_stages;
  }
  return 1;
}

double Planner::bubble_fraction(int64_t accumulation) const {
  if (degrees_.pipeline == 1) return 0;
  const double m = static_cast<double>(accumulation) * (r_.parallel.pipeline_schedule == PipelineScheduleKind::Interleaved ? degrees_.virtual_stages : 1);
  return (degrees_.pipeline - 1.0) / (m + degrees_.pipeline - 1.0);
}

Evaluation Planner::evaluate(const Choice& l) const {
  Evaluation worst;
  for (size_t s = 0; s < stages_.size(); ++s) {
    Evaluation ev = evaluate_stage(l, static_cast<int>(s));
    if (s == 0 || rank_total(ev) > rank_total(worst)) worst = ev;
  }
  return worst;
}

Evaluation Planner::evaluate_stage(const Choice& l, int stage) const {
  const HardwareSpec& hw = r_.hardware;
  const StageCost& st = stages_[stage];
  const double live = live_micro_batches(r_.batch.global / (l.micro * degrees_.data), stage);  // (data: the batch's replicas)
  Evaluation ev;
  ev.stage = stage;
  ModelStateOptions o;
  o.params = st.rank_params;
  o.data_parallel = degrees_.data_ranks();
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
  o.grad_dtype = modes.gradient_dtype;
  m.states = plan_model_states_per_rank(o);
  if (st.rank_expert_params > 0) {  // routed experts: ZeRO over the dp/ep ranks keeping the same ones
    o.params = st.rank_expert_params;
    o.data_parallel = degrees_.data_ranks() / degrees_.expert;
    const ModelStateBytes experts = plan_model_states_per_rank(o);
    m.states += experts;
    m.routed_expert_states = experts.device_total() + experts.host;
  }
  // Expert parallelism: the busiest rank's experts get `imbalance` times the mean tokens.
  const double routed_extra = (imbalance_ - 1) * st.routed_activation_bytes_per_sample;
  // Context parallelism: a rank holds 1/c of each sequence's tokens (1/c of a whole sample's
  // activations), plus the keys and values gathered from the group (below). Of the math kernel's
  // scores it keeps its chunks' against the chunks up to theirs: (2c+1)/(4c) of its queries'
  // against every key (context_score_share), not all of them.
  const double c = degrees_.context;
  const double scores_per_layer = kernel_ == AttentionKernel::Math && st.has_blocks ? bytes_per_element(r_.precision.dtype) * r_.model.heads * std::pow(static_cast<double>(r_.batch.seq_len), 2) : 0;
  const double scores_not_kept = c > 1 ? (1 - context_score_share()) * scores_per_layer : 0;
  m.activations = live * l.micro * (l.checkpointing ? st.checkpointed_activation_bytes_per_sample : st.activation_bytes_per_sample + routed_extra - st.layers * scores_not_kept) / c;
  // Tensor parallelism without sequence parallelism (Korthikanti et al. 2022, eq. 2): of a
  // layer's 34·sbh activation bytes, 24·sbh are split over t ranks and 10·sbh (norms, dropout-free
  // residuals, the region inputs) stay whole. Applied to the total until the terms are split one by one.
  // With sequence parallelism the 10·sbh are split too (eq. 4): everything is 1/t.
  // precision.fp8 (without checkpointing; with it only the recomputed layer's): the FP8 layers keep
  // their inputs in one byte, and each its weight's transposed FP8 copy (one byte a parameter)
  // until its backward (measured on an H200: the ~1B's peak 1.85 GiB under bf16's; this counts 1.84).
  if (r_.precision.fp8 != Fp8Scaling::None && !l.checkpointing)
    m.activations += live * (st.fp8_params - l.micro * rank_sequence() * st.fp8_activation_saving_per_token);
  if (degrees_.tensor > 1 && !l.checkpointing) m.activations *= r_.parallel.sequence_parallel ? 1.0 / degrees_.tensor : (10.0 + 24.0 / degrees_.tensor) / 34.0;
  // Each layer's attention keeps the whole sequence's keys and values (its heads'), of which the
  // share above counted this rank's own; with recomputation only the recomputed layer's (below).
  double gathered_layer = 0;
  if (c > 1 && st.has_blocks) {
    gathered_layer = (1 - 1 / c) * l.micro * static_cast<double>(r_.batch.seq_len) * context_kv_width().kept / degrees_.tensor * bytes_per_element(r_.precision.dtype);
    if (!l.checkpointing) m.activations += live * st.layers * gathered_layer;
  }
  // execution.fp8_routed_experts: each MoE layer keeps its experts' transposed FP8 weights (a byte a
  // parameter, and an fp32 scale for each of an expert's h + i columns) until its backward
  // (grouped_experts.cpp); with checkpointing only the recomputed layer's, of one micro-batch.
  // Already per tensor rank (local_routed_params): added after the split above.
  if (modes.fp8_routed_experts && st.moe_layers > 0) {
    const double h = r_.model.hidden, i = r_.model.moe.intermediate;
    const double kept = st.local_routed_params * (1 + 4 * (h + i) / (3 * h * i));
    m.activations += l.checkpointing ? kept / st.moe_layers : live * kept;
  }
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
                                              ? bytes_per_element(r_.precision.dtype) * static_cast<double>(r_.model.vocab / degrees_.tensor) * static_cast<double>(r_.model.hidden)
                                              : 0;
  if (st.has_head && cost_.loss_chunk_tokens > 0) {
    head_backward = cost_.loss_chunk_bytes(l.micro * rank_sequence()) + (live - 1) * head_gradient_in_forward;
  } else if (st.has_head) {
    head_backward = l.micro * cost_.head_backward_bytes_per_sample / c;
  }
  // Context parallelism runs a rank's two chunks one after the other, the later one (against at
  // most the whole sequence) the larger: its mask in the compute dtype and, on the math kernel,
  // its scores' backward, half of what all its queries against every key would take.
  const double context_mask = c > 1 && st.has_blocks ? rank_sequence() / 2 * static_cast<double>(r_.batch.seq_len) * bytes_per_element(r_.precision.dtype) : 0;
  const double attention_backward =
      st.has_blocks ? l.micro * cost_.attention_backward_bytes_per_sample / degrees_.tensor / c / (c > 1 ? 2 : 1) + context_mask : 0;
  const double recomputed_layer = l.micro * (cost_.recomputed_layer_bytes_per_sample - scores_not_kept) / c;
  m.backward_peak = l.checkpointing && st.has_blocks ? std::max(head_backward, recomputed_layer + gathered_layer + attention_backward)
                                                     : std::max(head_backward, attention_backward);
  // Gradients left to autograd come as backward frees activations, except that one: held at the peak.
  if (modes.gradients_left_to_autograd)
    m.gradients_after_peak = std::min(std::max(0.0, m.states.grads - head_gradient_in_forward), m.activations + m.backward_peak);
  // A CUDA graph's private pool is never handed back between replays: what an evaluation's forward
  // allocates cannot reuse the step's activations, as an eager step's would. Its largest piece is
  // the head's logits: with the fused loss a chunk's, in fp32 (measured on the ~1B at micro 8 on an
  // H200, 1.88 GiB more reserved than eager, against 1.95 counted: docs/benchmarks.md); unchunked,
  // the micro-batch's in the compute dtype, their fp32 copy and its log-softmax (4 + 4 + e bytes).
  if (modes.cuda_graphs && r_.eval.every > 0 && st.has_head) {
    const double micro_tokens = l.micro * rank_sequence();
    const double local_vocab = static_cast<double>(r_.model.vocab / degrees_.tensor);
    m.evaluation_beside_graph = cost_.loss_chunk_tokens > 0 ? std::min(static_cast<double>(cost_.loss_chunk_tokens), micro_tokens) * 4.0 * local_vocab
                                                            : micro_tokens * (8.0 + bytes_per_element(r_.precision.dtype)) * local_vocab;
  }
  // e: the working parameters' bytes; g: the gradients' as they are accumulated and reduced
  // (precision.grad_dtype: a unit's flat gradient and its reduction are in g).
  const double e = bytes_per_element(r_.precision.dtype), g = bytes_per_element(modes.gradient_dtype);
  const double largest_unit = cost_.largest_unit_params / degrees_.tensor;
  const double rank_params = st.rank_params + st.rank_expert_params;
  // Of comm_buffers, what backward makes for the gradients' reduction (buckets, flat copies,
  // reduced shards): live only once backward has begun to free activations (comm_after_peak).
  double reductions = 0;
  const int data_ranks = degrees_.data_ranks();  // ZeRO's group: the replicas and their context ranks
  if (l.stage == 3 && data_ranks > 1) {
    // The layer being computed, the prefetched next one, and one layer's full gradient before reduce-scatter.
    m.comm_buffers = (2 * e + g) * largest_unit;
    reductions = g * largest_unit;
    // Without recomputation autograd keeps every layer's gathered weights (matmuls save them for
    // backward) until that layer's backward has run: the whole model, gathered, at the end of forward.
    // FP8 layers save their weight's FP8 transpose instead (counted with the activations), so a
    // dense block's gathered weights are freed after forward (DeepSeek-LLM-7B's shape on 4 H200:
    // FP8's peak 12.55 GiB under bf16's, of which 11.3 are these weights). A MoE block's bf16
    // router and grouped experts keep views of its gathered buffer, so all of it stays.
    const double fp8_weights = r_.precision.fp8 != Fp8Scaling::None ? st.fp8_params_dense_units / degrees_.tensor : 0;
    if (!l.checkpointing) m.comm_buffers += e * (rank_params - fp8_weights);
    // Gloo has no reduce-scatter: each unit's flat gradient is all-reduced from a copy, and up to
    // two buckets of them are in flight (zero.cpp), as at stage 2.
    // (NCCL reduce-scatters the flat buffer itself; not yet measured on GPUs, so not counted there.)
    if (hw.device != Device::Cuda) {
      const double copies = 2 * std::min(std::max(2 * r_.parallel.bucket_bytes, g * largest_unit), rank_params * g);
      m.comm_buffers += copies;
      reductions += copies;
    }
  } else if (data_ranks > 1 && (l.stage == 2 || (l.stage == 1 && hw.device != Device::Cuda))) {
    // Reductions in flight: at most two buckets, or one unit larger than that (zero.cpp). Stage
    // 2 reduces a flat copy of each unit's gradient, beside autograd's gradients of the unit
    // whose backward runs; Gloo has no reduce-scatter and all-reduces a copy (stage 1: of the
    // accumulated gradient; stage 2: of the flat copy). NCCL's stage 1 reduces in place.
    const double unit = g * largest_unit;
    const double in_flight = std::min(std::max(2 * r_.parallel.bucket_bytes, unit), rank_params * g);
    const bool gloo = hw.device != Device::Cuda;
    m.comm_buffers = l.stage == 1 ? in_flight : in_flight * (gloo ? 2 : 1) + e * largest_unit;
    reductions = m.comm_buffers;
  } else if (data_ranks > 1) {
    m.comm_buffers = 2 * std::min(r_.parallel.bucket_bytes, rank_params * g);  // bucket being reduced + the next
    reductions = m.comm_buffers;
  }
  // Stage 1: each unit's reduced shard, made in the last micro-batch's backward and read by the
  // step (MasterShard::grad), on top of the whole accumulator.
  if (l.stage == 1 && data_ranks > 1) {
    const double shards = g * std::ceil(rank_params / data_ranks);
    m.comm_buffers += shards;
    reductions += shards;
  }
  // Gradients accumulated in a wider dtype at stages 0-1: autograd's gradients of the unit whose
  // backward runs, in the working dtype, until they are added into the buffer (gradient_sync.cpp).
  // (Stages 2-3 count them above, beside the flat copy.)
  if (g != e && l.stage <= 1) {
    m.comm_buffers += e * largest_unit;
    reductions += e * largest_unit;
  }
  // Expert parallelism: a MoE layer's tokens in flight, sent and received ([micro · s · k, h] each way).
  if (degrees_.expert > 1 && st.moe_layers > 0) m.comm_buffers += 2 * imbalance_ * l.micro * rank_sequence() * r_.model.moe.top_k * r_.model.hidden * e;
  // Tied embeddings over a pipeline: the last stage's copy of this tensor rank's embedding slice, and its gradient (summed in g).
  if (st.tied_head_copy) m.comm_buffers += (e + g) * cost_.embedding_params / degrees_.tensor;
  // CPU ranks map every block of 1 MiB and more and unmap it when freed (trainer.cpp,
  // map_large_host_blocks), so a reduction's buffers can take the pages backward has just freed:
  // the peak is the larger of the activations' and the reductions', not their sum. Measured on 2
  // and 4 CPU ranks at 27 and 85 M parameters (docs/benchmarks.md). The CUDA caching allocator
  // keeps the sum: NCCL's stream cannot take blocks freed on the compute stream until synchronised.
  if (hw.device != Device::Cuda) m.comm_after_peak = std::min(reductions, m.activations + m.backward_peak);
  m.runtime = hw.runtime_memory_bytes;
  m.fragmentation = hw.fragmentation * (m.states.device_total() + m.step_transients());
  double on_device = m.total();
  if (hw.ranks_share_memory()) on_device += m.states.host;  // "host" and "device" are the same memory on CPU ranks
  ev.host = host_memory(m, st);
  ev.host_needed = ev.host.total() * ranks_per_node_;
  ev.device_fits = on_device <= capacity_;
  ev.host_fits = ev.host_needed <= hw.host_memory_bytes;
  ev.fits = ev.device_fits && ev.host_fits;
  return ev;
}

HostMemory Planner::host_memory(const MemoryBreakdown& m, const StageCost& st) const {
  const HardwareSpec& hw = r_.hardware;
  HostMemory h;
  h.offloaded = m.states.host;
  h.data = data_bytes_;
  // A decoder is built deferred, one unit at a time; a ResNet or weights from a file, whole.
  const bool deferred = r_.model.arch == ModelArch::DeepSeek && r_.model.init_from.empty();
  if (r_.checkpoint.async && checkpoint_saves() > 0) h.checkpoint_staging = checkpoint_bytes() / degrees_.world();
  if (hw.ranks_share_memory()) {
    // The build and the data's load run before training's transients, which reuse their memory.
    // data_bytes_ is the load's peak: the tokens read, and their copy the dataset keeps. The read
    // ones are unmapped once loaded, so while training a CPU rank holds one copy; the load's peak
    // is the higher only where the step's transients are smaller than a copy.
    const double build = 4 * (deferred ? cost_.largest_unit_params : cost_.params), kept = data_bytes_ / 2;
    h.device = m.total();
    h.model_build = std::max(0.0, build - m.step_transients());
    h.data = kept + std::max(0.0, kept - m.step_transients());
  } else {
    // A GPU rank builds each unit on its device, one parameter's fp32 initial values at a time in
    // host memory (under tensor parallelism the whole weight, then this rank's slice of it),
    // before NCCL and the CUDA libraries grow the process: the build's peak is the process then
    // plus that, and counts where it passes the process as it trains (measured on 4 H200).
    const bool several = degrees_.world() > 1;
    h.process = hw.host_runtime_memory_bytes + (several ? hw.host_nccl_memory_bytes : 0) + extra_communicators() * hw.host_nccl_memory_bytes / 4;
    const double build = deferred ? 4 * st.largest_param * (degrees_.tensor > 1 ? 1.0 + 1.0 / degrees_.tensor : 1.0) : 4 * cost_.params;
    h.model_build = std::max(0.0, hw.host_build_memory_bytes + build - (h.process + h.data + h.checkpoint_staging));
  }
  return h;
}

// NCCL's host side grows with each communicator a rank sets up (its proxy state and host
// buffers). host_nccl_memory covers two: the world's and the data group's, as a data-parallel job
// uses (measured). Each further group that carries traffic adds a quarter of it: tensor, pipeline,
// the expert shards' all-to-all, the expert replicas' reduction (a MoE model only). Fitted to the
// MoE layouts on 4 H200, 0.12 and 0.19 GiB over the two-communicator figure with one and two more.
int Planner::extra_communicators() const {
  if (r_.hardware.device != Device::Cuda) return 0;
  int groups = degrees_.world() > 1 ? 1 : 0;
  for (int degree : {degrees_.data_ranks(), degrees_.tensor, degrees_.pipeline, degrees_.context}) groups += degree > 1 ? 1 : 0;
  if (r_.model.moe.enabled()) {
    groups += degrees_.expert > 1 ? 1 : 0;                         // the shards' all-to-all
    groups += degrees_.data_ranks() / degrees_.expert > 1 ? 1 : 0;  // the replicas' gradient reduction
  }
  return std::max(0, groups - 2);
}

double Planner::checkpoint_bytes() const {
  const double states = r_.optimizer.kind == OptimizerKind::Sgd ? (r_.optimizer.momentum > 0 ? 4 : 0) : 8;
  return cost_.params * (4 + states);
}

int64_t Planner::checkpoint_saves() const {
  const CheckpointOptions& ck = r_.checkpoint;
  const int64_t steps = r_.run.steps;
  return (ck.every > 0 ? steps / ck.every : 0) + (ck.at_end && (ck.every <= 0 || steps % ck.every != 0) ? 1 : 0);
}

void Planner::plan_checkpoint_disk(Plan& p) {
  CheckpointDisk& d = p.checkpoint_disk;
  const CheckpointOptions& ck = r_.checkpoint;
  const HardwareSpec& hw = r_.hardware;
  d.bytes = checkpoint_bytes();
  const int64_t steps = r_.run.steps;
  d.saves = checkpoint_saves();
  // The pause: every rank copies its share to host staging memory (over PCIe from a GPU, at
  // host_link_bandwidth: each GPU's rate while the node's all copy at once, as they do here; a
  // memory copy, read and write, on CPU ranks and of offloaded states), then the files are written
  // at the disk's bandwidth, the node's ranks sharing it. Asynchronous saves pause for the copy alone.
  d.async = ck.async;
  d.staging_per_rank = d.bytes / p.world_size;
  d.staging_pinned = hw.device == Device::Cuda && p.layout.offload == Offload::None;
  d.copy_seconds = d.staging_per_rank / (d.staging_pinned ? hw.host_link_bandwidth : hw.host_memory_bandwidth / 2);
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

}  // namespace dsrun::planning
