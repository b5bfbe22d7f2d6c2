// What a step costs: each collective priced by where its group sits, compute at the measured
// efficiencies, offload and elementwise work, what overlaps (docs/plan.md, time).
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/parallel/pipeline_schedule.hpp"
#include "engine/plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dsrun::planning {

double Planner::link_share() const {
  const HardwareSpec& hw = r_.hardware;
  return hw.link_bandwidth / (hw.device == Device::Cuda && !hw.p2p ? 2 : 1) * hw.comm_efficiency;
}

double Planner::intra_node_bandwidth(Collective op, int members) const {
  const double probed = r_.hardware.collectives.of(op, members);
  return probed > 0 ? probed : link_share();
}

double Planner::point_to_point_bandwidth() const {
  const double probed = r_.hardware.collectives.point_to_point;
  return probed > 0 ? probed : link_share();
}

Planner::GroupLink Planner::group_link(Collective op, int64_t stride, int64_t count) const {
  GroupLink g;
  g.nodes = placement_.nodes_spanned(0, stride, count);
  const int local = static_cast<int>((count + g.nodes - 1) / g.nodes);  // members on one node
  const double intra = intra_node_bandwidth(op, local);
  g.bandwidth = g.nodes > 1 ? std::min(intra, inter_node_share()) : intra;
  return g;
}

// Every collective a step runs, each priced by where its group sits, then what overlap hides and
// costs, and the offload's traffic over the host link.
void Planner::predict_communication(Plan& p) {
  // Data rank d sits tp ranks after d-1 (the data ranks are the replicas × their context ranks);
  // the replicas of an expert shard sit tp·ep apart.
  add_data_parallel_terms(p, rank_params_, degrees_.data_ranks(), degrees_.tensor, "");
  add_data_parallel_terms(p, rank_expert_params_, degrees_.data_ranks() / degrees_.expert, static_cast<int64_t>(degrees_.tensor) * degrees_.expert, " of the routed experts");
  if (degrees_.context > 1) add_context_terms(p);
  if (degrees_.expert > 1) add_expert_terms(p);
  if (degrees_.tensor > 1) add_tensor_terms(p);
  if (degrees_.pipeline > 1) add_pipeline_terms(p);
  for (const auto& c : p.comm) p.comm_seconds += c.seconds;
  price_overlap(p);
  price_offload_traffic(p);
}

// ZeRO's collectives over a group of data ranks for `params` parameters (the routed experts'
// over the dp/ep ranks keeping the same ones, with `of` naming them), priced by the group's link.
void Planner::add_data_parallel_terms(Plan& p, double params, int ranks, int64_t stride, const std::string& of) const {
  if (ranks <= 1) return;
  // Parameters travel in the working dtype, gradients in precision.grad_dtype's.
  const double e = bytes_per_element(r_.precision.dtype), g = bytes_per_element(p.modes.gradient_dtype);
  const double a = static_cast<double>(p.accumulation);
  const GroupLink reduce = group_link(p.layout.zero_stage == 0 ? Collective::AllReduce : Collective::ReduceScatter, stride, ranks);
  const GroupLink gather = group_link(Collective::AllGather, stride, ranks);
  const std::string at = ", " + where(reduce);
  // The updated parameters' gather follows the step; everything else runs beside compute.
  auto add = [&](const GroupLink& link, const std::string& what, double bytes, bool beside_compute) {
    if (bytes > 0) p.comm.push_back({what, bytes, bytes / link.bandwidth, beside_compute});
  };
  const double ring = (ranks - 1.0) / ranks;  // ring collectives: each rank sends (N-1)/N of the buffer per pass
  switch (p.layout.zero_stage) {
    case 0: add(reduce, "all-reduce gradients" + of + " (once per step" + at + ")", 2 * ring * params * g, true); break;
    case 1:
      add(reduce, "reduce-scatter gradients" + of + " (once per step" + at + ")", ring * params * g, true);
      add(gather, "all-gather updated parameters" + of + " (" + where(gather) + ")", ring * params * e, false);
      break;
    case 2:
      add(reduce, "reduce-scatter gradients" + of + " (every micro-batch" + at + ")", a * ring * params * g, true);
      add(gather, "all-gather updated parameters" + of + " (" + where(gather) + ")", ring * params * e, false);
      break;
    case 3:
      add(gather, "all-gather parameters" + of + " for forward (every micro-batch" + at + ")", a * ring * params * e, true);
      add(gather, "all-gather parameters" + of + " for backward (every micro-batch" + at + ")", a * ring * params * e, true);
      add(reduce, "reduce-scatter gradients" + of + " (every micro-batch" + at + ")", a * ring * params * g, true);
      break;
  }
}

void Planner::add_expert_terms(Plan& p) const {
  const double e = bytes_per_element(r_.precision.dtype);
  const double a = static_cast<double>(p.accumulation);
  // Each MoE layer sends every (token, choice) pair's row to its expert's rank and back, in
  // forward and again in backward (and once more when recomputed): [micro · s · k, h] each
  // way, of which (ep-1)/ep leaves the rank; the busiest rank's share is `imbalance` times
  // the mean. Tokens once per rank (execution.tokens_once_per_rank): the dispatch and its
  // gradient carry each token once per rank its choices are on, D of the ep ranks for k distinct
  // experts chosen uniformly, and 8 bytes per pair say which token each reads (forward only). The
  // ep ranks are consecutive data ranks: what goes to members on other nodes crosses the network,
  // the rest the node's link, both at once.
  const int moe_layers = busiest_stage_moe_layers();
  const int k = r_.model.moe.top_k, experts = r_.model.moe.routed_experts, ep = degrees_.expert;
  const double tokens = static_cast<double>(p.layout.micro) * rank_sequence(), pairs = tokens * k;
  const double passes = p.layout.recomputation ? 6 : 4, forward_dispatches = p.layout.recomputation ? 2 : 1;
  double rows = passes * pairs * r_.model.hidden * e;
  if (p.modes.tokens_once_per_rank) {
    // Group-limited routing (model.moe.n_group, DeepSeek-V3's node-limited routing): a token's
    // choices lie in topk_group of the n_group groups of consecutive experts; where each group is
    // whole ranks, they are uniform over those groups' experts and ranks alone.
    const MoeSpec& moe = r_.model.moe;
    const bool grouped = moe.n_group > 1 && ep % moe.n_group == 0;
    const int pool = grouped ? experts / moe.n_group * moe.topk_group : experts, pool_ranks = grouped ? ep / moe.n_group * moe.topk_group : ep;
    double none_here = 1;  // the chance that none of a token's k choices is on a given rank of the pool
    for (int i = 0; i < k; ++i) none_here *= static_cast<double>(pool - pool / pool_ranks - i) / (pool - i);
    const double distinct = pool_ranks * (1 - none_here);
    rows = passes / 2 * (pairs + tokens * distinct) * r_.model.hidden * e + forward_dispatches * pairs * 8;
  }
  rows *= a * moe_layers * imbalance_;
  const GroupLink link = group_link(Collective::AllToAll, degrees_.tensor, degrees_.expert);
  const double local = static_cast<double>(degrees_.expert) / link.nodes;  // members on this rank's node
  const double intra = rows * (local - 1) / degrees_.expert, inter = rows * (degrees_.expert - local) / degrees_.expert;
  const double seconds = std::max(intra / intra_node_bandwidth(Collective::AllToAll, static_cast<int>(local)), inter > 0 ? inter / inter_node_share() : 0.0);
  p.comm.push_back({"all-to-all tokens to their experts and back (expert, " + std::to_string(static_cast<int>(passes)) + " per MoE layer, every micro-batch" +
                        (p.modes.tokens_once_per_rank ? ", each token once to each rank its choices are on" : "") + ", " +
                        (link.nodes > 1 ? format_double(100 * inter / (intra + inter), 3) + "% across nodes" : "within a node") + ")",
                    intra + inter, seconds});
}

void Planner::add_tensor_terms(Plan& p) const {
  const double e = bytes_per_element(r_.precision.dtype);
  const double a = static_cast<double>(p.accumulation);
  // Megatron's tensor parallelism: per layer two all-reduces of the activations [b, s, h] in
  // forward and two in backward, every micro-batch, over the tensor group (consecutive ranks:
  // inside a node unless parallel.tensor_across_nodes says otherwise). Sequence parallelism
  // replaces each by a reduce-scatter and an all-gather: the same bytes.
  const double activation = static_cast<double>(p.layout.micro) * rank_sequence() * r_.model.hidden * e;
  const double t = degrees_.tensor, bytes = a * 4.0 * r_.model.layers * 2 * (t - 1) / t * activation;
  const GroupLink link = group_link(Collective::AllReduce, 1, degrees_.tensor);
  p.comm.push_back({std::string(r_.parallel.sequence_parallel ? "reduce-scatter + all-gather activations (tensor, sequence-parallel, 4 per layer, every micro-batch, "
                                                              : "all-reduce activations (tensor, 4 per layer, every micro-batch, ") +
                        where(link) + ")",
                    bytes, bytes / link.bandwidth});
}

void Planner::add_context_terms(Plan& p) const {
  const double e = bytes_per_element(r_.precision.dtype);
  const double a = static_cast<double>(p.accumulation);
  // Each layer's attention all-gathers the group's keys and values in forward (again when
  // recomputed) and reduce-scatters their gradients in backward: (c - 1)/c of the whole sequence's
  // [micro, seq, width] each time, in line with the compute (it waits for them). The context ranks
  // are consecutive data ranks, tp apart.
  const double c = degrees_.context, layers = r_.model.layers;
  const double whole = static_cast<double>(p.layout.micro) * r_.batch.seq_len * context_kv_width().gathered / degrees_.tensor * e;
  const double passes = p.layout.recomputation ? 3 : 2;
  const double bytes = a * passes * layers * (c - 1) / c * whole;
  const GroupLink link = group_link(Collective::AllGather, degrees_.tensor, degrees_.context);
  p.comm.push_back({"all-gather keys and values, reduce-scatter their gradients (context, " + std::to_string(static_cast<int>(passes)) +
                        " per layer, every micro-batch, " + where(link) + ")",
                    bytes, bytes / link.bandwidth});
}

void Planner::add_pipeline_terms(Plan& p) const {
  const double e = bytes_per_element(r_.precision.dtype);
  const double a = static_cast<double>(p.accumulation);
  // Every chunk sends its output forward and its input's gradient back, every micro-batch:
  // [micro, seq, hidden] (1/t of it with sequence parallelism). Stages are the outermost
  // dimension, dp × tp ranks apart: a boundary crosses nodes when its two stages' ranks do
  // (interleaving also wraps from the last stage to the first). The busiest rank sits on a
  // crossing boundary when there is one.
  const int64_t stage_ranks = static_cast<int64_t>(degrees_.data_ranks()) * degrees_.tensor;
  auto crosses = [&](int64_t from, int64_t to) {  // stage `from`'s ranks and stage `to`'s
    const int64_t lo = std::min(from, to), hi = std::max(from, to);
    return placement_.node_of(static_cast<int>(lo * stage_ranks)) != placement_.node_of(static_cast<int>((hi + 1) * stage_ranks - 1));
  };
  int boundaries = degrees_.pipeline - 1, crossing = 0;
  for (int s = 0; s + 1 < degrees_.pipeline; ++s) crossing += crosses(s, s + 1) ? 1 : 0;
  if (degrees_.virtual_stages > 1) {
    ++boundaries;
    crossing += crosses(degrees_.pipeline - 1, 0) ? 1 : 0;
  }
  const double intra = point_to_point_bandwidth(), inter = std::min(intra, inter_node_share());
  const double p2p_bw = crossing > 0 ? inter : intra;
  const double activation = static_cast<double>(p.layout.micro) * rank_sequence() * r_.model.hidden * e / (r_.parallel.sequence_parallel ? degrees_.tensor : 1);
  const double bytes = 2 * a * degrees_.virtual_stages * activation;
  p.comm.push_back({"send/receive activations and their gradients (pipeline, every micro-batch, " +
                        (crossing > 0 ? std::to_string(crossing) + " of " + std::to_string(boundaries) + " stage boundaries across nodes" : "within a node") + ")",
                    bytes, bytes / p2p_bw});
  if (r_.model.tie_embeddings) {
    const double tied = 2 * cost_.embedding_params / degrees_.tensor * e;
    const bool tied_crosses = placement_.node_of(0) != placement_.node_of(static_cast<int>((degrees_.pipeline - 1) * stage_ranks));
    p.comm.push_back({std::string("tied embedding to the last stage and its gradient back (pipeline, once per step, ") + (tied_crosses ? "across nodes" : "within a node") + ")",
                      tied, tied / (tied_crosses ? inter : intra)});
  }
}

// Overlap: on GPUs gradient collectives run on their own stream during backward (stages 0-1:
// the last micro-batch's), ZeRO-3's gathers beside forward and backward; what outlasts that
// window is exposed, and what it hides still slows the compute beside it by
// hardware.overlap_cost of its time (`dsrun probe` measured 0.624 on 4 H200: NCCL's kernels
// take SMs and memory bandwidth from the products). On CPU ranks Gloo competes for the same
// cores: nothing overlaps.
void Planner::price_overlap(Plan& p) const {
  const double a = static_cast<double>(p.accumulation);
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
}

// Offload traffic over PCIe: gradient shard down, updated parameter shard up; ZeRO-3 parameter
// offload also fetches the parameter shard for every forward and backward.
void Planner::price_offload_traffic(Plan& p) const {
  const double e = bytes_per_element(r_.precision.dtype);
  const double a = static_cast<double>(p.accumulation);
  if (p.layout.offload != Offload::None && r_.hardware.device == Device::Cuda) {
    const double shard = shard_params();
    double bytes = shard * (bytes_per_element(p.modes.gradient_dtype) + e);  // the gradient shard down, the parameters up
    if (p.layout.offload == Offload::OptimizerAndParams) bytes += 2 * a * shard * e;
    p.offload_seconds = bytes / r_.hardware.host_link_bandwidth;
  }
}

double Planner::peak_flops() const {
  const HardwareSpec& hw = r_.hardware;
  switch (r_.precision.dtype) {
    case DType::Bf16: return hw.peak_flops_bf16;
    case DType::Fp16: return hw.peak_flops_fp16;
    case DType::Fp32: return hw.peak_flops_fp32;
  }
  return hw.peak_flops_fp32;
}

// Each FP8 scaling's products at a rate beside tensorwise's (the probe's figure), on one H200 with
// PyTorch 2.11: rowwise products alone ran at 0.95 of tensorwise's (bench/fp8_probe_gpu.py, 1184-1338
// against 1230-1424 TFLOP/s); blockwise at 0.85 alone and 0.78 in training, where most weights take
// the 1 x 128 path (square_weight_blocks): the rate that puts the ~1B at seq 2048 and 8192 and the 7B's
// layers within 10% of their measured steps (docs/benchmarks.md, 2026-11-27; set from those rows).
static double fp8_product_rate(Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::Rowwise: return 0.95;
    case Fp8Scaling::Blockwise: return 0.78;
    default: return 1.0;
  }
}

double Planner::compute_seconds(Plan& p) const {
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
  // (A sample's work is split over its context ranks as well: the zigzag gives each the same share.)
  const double per_flop = p.hardware_flops_per_step / cost_.model_flops_per_sample / (degrees_.data_ranks() * degrees_.tensor);
  const double grouped_efficiency = r_.hardware.device == Device::Cuda ? r_.hardware.grouped_matmul_efficiency : r_.hardware.matmul_efficiency;
  // On GPUs with hardware.attention_efficiency given, attention is priced apart: the causal
  // flash kernels compute half of the 12·L·h·s FLOPs counted per token, at that efficiency;
  // otherwise the counted FLOPs at matmul_efficiency, like the rest. Within documents the
  // variable-length kernel computes attention_fraction_ of a whole row's.
  const bool gpu = r_.hardware.device == Device::Cuda;
  const bool apart = gpu && r_.hardware.attention_efficiency > 0;
  const double attention_efficiency = apart ? r_.hardware.attention_efficiency : r_.hardware.matmul_efficiency;
  // Context parallelism's attention runs each chunk against the chunks up to its own, with a mask
  // on its own: (2c+1)/(4c) of the scores (the causal kernel's 1/2 and the diagonal blocks).
  const double attention_share = (p.modes.variable_length_attention ? attention_fraction_ : 1.0) *
                                 (degrees_.context > 1 ? context_score_share() : apart ? 0.5 : 1.0);
  // precision.fp8: the blocks' linear layers at the FP8 peak and their own measured efficiency
  // (the probe's, of tensorwise products), at the recipe's scaling's rate beside tensorwise's.
  const bool fp8 = r_.precision.fp8 != Fp8Scaling::None;
  const double fp8_efficiency = r_.hardware.fp8_matmul_efficiency * fp8_product_rate(r_.precision.fp8);
  // execution.fp8_routed_experts: of the routed experts' six products, forward's two and the input
  // gradients' two (two thirds of their FLOPs) at the FP8 peak and the grouped FP8 kernel's own
  // measured efficiency (with recomputation its forward's too); the weight gradients' two stay bf16.
  // Recomputation adds a forward (in FP8 too): 12 + 6 of 18 + 6 FLOPs a parameter and row.
  const double recomputed = p.layout.recomputation ? 6 : 0;
  const double routed_in_fp8 = p.modes.fp8_routed_experts ? (12 + recomputed) / (18 + recomputed) : 0;
  const double routed_rate = (1 - routed_in_fp8) / (p.peak_flops * grouped_efficiency) +
                             (routed_in_fp8 > 0 ? routed_in_fp8 / (r_.hardware.peak_flops_fp8 * r_.hardware.fp8_grouped_matmul_efficiency) : 0);
  double busiest = 0;
  for (const StageCost& st : stages_) {
    const double attention = per_flop * st.attention_flops_per_sample;
    const double in_fp8 = fp8 ? per_flop * st.fp8_flops_per_sample : 0;
    const double dense = per_flop * (st.flops_per_sample - st.routed_flops_per_sample) - attention - in_fp8, routed = per_flop * imbalance_ * st.routed_flops_per_sample;
    busiest = std::max(busiest, dense / (p.peak_flops * r_.hardware.matmul_efficiency) + routed * routed_rate +
                                    attention * attention_share / (p.peak_flops * attention_efficiency) +
                                    (fp8 ? in_fp8 / (r_.hardware.peak_flops_fp8 * fp8_efficiency) : 0));
  }
  return busiest / (1 - bubble_fraction(p.accumulation));
}

double Planner::hidden_offload_seconds(const Plan& p, double shard, double e) const {
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

int Planner::busiest_stage_moe_layers() const {
  int moe_layers = 0;
  for (const StageCost& st : stages_) moe_layers = std::max(moe_layers, st.moe_layers);
  return moe_layers;
}

double Planner::elementwise_seconds(const Plan& p) const {
  if (r_.hardware.device != Device::Cuda || r_.model.arch != ModelArch::DeepSeek) return 0;
  const double e = bytes_per_element(r_.precision.dtype);
  const double tokens = static_cast<double>(r_.batch.global) * static_cast<double>(r_.batch.seq_len) / degrees_.data_ranks();
  const int moe_layers = busiest_stage_moe_layers();
  // Fused with the projection (cost_.loss_chunk_tokens > 0): the products write fp32 logits, the
  // log-sum-exp reads them, one kernel reads them again and writes the gradient: 12 + e bytes.
  // Where backward recomputes the logits (not loss_gradients_in_forward): that again, and a third product.
  const bool fused_loss = cost_.loss_chunk_tokens > 0, recomputed = fused_loss && !p.modes.loss_gradients_in_forward;
  const double loss_bytes = !fused_loss ? 24 + 2 * e : recomputed ? 2 * (12 + e) : 12 + e;
  const double loss = loss_bytes * static_cast<double>(r_.model.vocab) / degrees_.tensor;
  const double recomputed_logits = recomputed ? tokens * 2.0 * r_.model.hidden * r_.model.vocab / degrees_.tensor / (peak_flops() * r_.hardware.matmul_efficiency) : 0;
  const double permutation = 14.0 * r_.model.moe.top_k * r_.model.hidden * e * moe_layers;
  return tokens * (loss + permutation) / r_.hardware.memory_bandwidth + recomputed_logits + p.fp8_quantization_seconds;
}

// precision.fp8's operands, memory-bound: each linear layer's input, output gradient and weight
// (once a micro-batch) read twice (the maximum, then the scaling; blockwise once, its kernel keeping
// a 128 x 128 tile) and written as two FP8 copies (its layout and its transpose): 2·e + 2 bytes an
// element (blockwise e + 2).
double Planner::fp8_quantization_seconds(const Plan& p) const {
  if (r_.precision.fp8 == Fp8Scaling::None) return 0;
  const double e = bytes_per_element(r_.precision.dtype);
  const double per_element = r_.precision.fp8 == Fp8Scaling::Blockwise ? e + 2 : 2 * e + 2;
  const double tokens = static_cast<double>(r_.batch.global) * static_cast<double>(r_.batch.seq_len) / degrees_.data_ranks();
  double widths = 0, params = 0;
  for (const StageCost& st : stages_) {
    widths = std::max(widths, st.fp8_widths);
    params = std::max(params, st.fp8_params);
  }
  const double recompute = p.layout.recomputation ? 1.5 : 1.0;  // the forward's inputs again when recomputed
  const double activations = tokens * recompute * per_element * widths / degrees_.tensor;
  const double weights = static_cast<double>(p.accumulation) * per_element * params / degrees_.tensor;
  return (activations + weights + fp8_routed_quantization_bytes(p, tokens)) / r_.hardware.memory_bandwidth;
}

// execution.fp8_routed_experts: each micro-batch quantises the local experts' weights, each and its
// transpose in one pass after one for the maxima (kFp8ExpertWeightBytes a parameter: 2·e + 2 move,
// at what measured as half the bandwidth), and the four operands of each routed row per MoE layer
// (fp8_routed_row_bytes: rowwise without a transpose, in one pass).
double Planner::fp8_routed_quantization_bytes(const Plan& p, double tokens) const {
  if (!p.modes.fp8_routed_experts) return 0;
  double params = 0, layers = 0;
  for (const StageCost& st : stages_) {
    params = std::max(params, st.local_routed_params);
    layers = std::max(layers, static_cast<double>(st.moe_layers));
  }
  const double weights = static_cast<double>(p.accumulation) * kFp8ExpertWeightBytes * params * (p.layout.recomputation ? 2 : 1);
  const double rows = tokens * r_.model.moe.top_k * imbalance_;
  const double activations = rows * layers * fp8_routed_row_bytes(r_, p.layout.recomputation) / degrees_.tensor;
  return weights + activations;
}

void Planner::predict_time(Plan& p) {
  p.compute_seconds = compute_seconds(p);
  // The optimizer step is memory-bound. Per parameter of the shard it reads and writes the fp32
  // weights (8 bytes) and each state (8 bytes each in fp32, 4 in bf16: Adam's m and v, SGD's
  // momentum), reads the gradient, and with mixed precision writes the working copy.
  const double e = bytes_per_element(r_.precision.dtype), g = bytes_per_element(p.modes.gradient_dtype);
  const bool mixed = r_.precision.dtype != DType::Fp32;
  int states = r_.optimizer.kind == OptimizerKind::Sgd ? (r_.optimizer.momentum > 0 ? 1 : 0) : 2;
  double touched = 8 + 2.0 * bytes_per_element(r_.optimizer.state_dtype) * states + g + (mixed ? e : 0);
  const double shard = p.layout.zero_stage >= 1 ? shard_params() : rank_params_ + rank_expert_params_;
  // Offloaded, the step runs on the host, whose memory bandwidth the node's ranks share.
  const bool host_step = p.layout.offload != Offload::None && r_.hardware.device == Device::Cuda;
  // On a GPU the gradient also passes through memory outside the step: autograd accumulates it
  // (3e) into the gradient buffer, or, left to autograd on one rank, into the first micro-batch's
  // gradient for each later one. dsrun's Adam kernel (engine/train/adam_kernel.h) reads it in the
  // working dtype and writes the working copy in the same pass: no fp32 copy, no separate publication.
  // Accumulated in a wider dtype, each micro-batch's gradient is read (e) and added into the
  // buffer (2g), every micro-batch. The norm (clipping, the metric) reads it once more before the step.
  if (r_.hardware.device == Device::Cuda && !host_step) {
    const double micro_batches = static_cast<double>(p.accumulation);
    if (g != e) touched += micro_batches * (e + 2 * g);
    else touched += 3 * e * (p.modes.gradients_left_to_autograd ? (micro_batches - 1) / micro_batches : 1);
    touched += g;
  }
  // Offloaded, the fused host step's own measured throughput (hardware.host_optimizer_gbs, `dsrun
  // probe`) where given: it runs below the memory's bandwidth where the cores, not the memory, bind.
  const double host_bandwidth = r_.hardware.host_optimizer_bandwidth > 0 ? r_.hardware.host_optimizer_bandwidth : r_.hardware.host_memory_bandwidth;
  const double bandwidth = host_step ? host_bandwidth / ranks_per_node_ : r_.hardware.memory_bandwidth;
  p.optimizer_seconds = shard * touched / bandwidth;
  p.offload_hidden_seconds = host_step ? hidden_offload_seconds(p, shard, e) : 0;
  p.fp8_quantization_seconds = fp8_quantization_seconds(p);
  p.elementwise_seconds = elementwise_seconds(p);
  p.step_seconds = p.compute_seconds + p.elementwise_seconds + p.exposed_comm_seconds + p.optimizer_seconds + p.offload_seconds - p.offload_hidden_seconds;
  p.tokens_per_second = p.tokens_per_step / p.step_seconds;
  p.mfu = p.model_flops_per_step / (p.step_seconds * p.peak_flops * p.world_size);
  p.total_seconds = p.step_seconds * static_cast<double>(r_.run.steps);
  // Start-up scales with what it must do: every rank builds (or reads) the fp32 weights of its
  // units and loads its data; 0.5 GB/s is slow on purpose, so a healthy start never times out.
  const double startup_bytes = 4 * (rank_params_ + rank_expert_params_) + data_bytes_;
  p.startup_timeout_seconds = r_.run.startup_timeout_s > 0 ? r_.run.startup_timeout_s : 120 + startup_bytes / 0.5e9;
}

}  // namespace dsrun::planning
