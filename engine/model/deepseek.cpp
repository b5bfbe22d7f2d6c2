// DeepSeek/Llama-style decoder: RMSNorm, rotary embeddings (YaRN-scaled where asked), SwiGLU,
// multi-head, grouped-query or DeepSeek-V2/V3's latent attention, optional tied embeddings,
// DeepSeek-MoE layers (fine-grained routed experts plus shared experts; softmax or V3's sigmoid
// router with group-limited choice; balance losses) and V3's multi-token prediction modules.
#include "engine/common/text.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/model/document_attention.hpp"
#include "engine/model/fp8_linear.hpp"
#include "engine/model/fused_ops.hpp"
#include "engine/model/grouped_experts.hpp"
#include "engine/model/model.hpp"

#include <cmath>
#include <limits>
#include <memory>

namespace dsrun {

torch::Tensor UnitRunner::split_sequence_attention(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  fail_at(__FILE__, __LINE__, "a batch split over context ranks (Batch::places) reached a runner that does not split sequences");
}

namespace {

using torch::Tensor;
namespace nn = torch::nn;

// Parameters are created uninitialised: torch::empty reserves address space and writes nothing, so
// a deferred model's pages are never touched (no resident memory) until ZeRO replaces each
// parameter's storage with its flat buffers; the values come from initialize_parameter. (libtorch
// 1.13 cannot set_data a meta tensor to a real one, or the meta device would do.)
struct LinearImpl : nn::Module {
  LinearImpl(int64_t in, int64_t out, const torch::TensorOptions& o) { weight = register_parameter("weight", torch::empty({out, in}, o)); }
  Tensor forward(const Tensor& x) { return fp8 == Fp8Scaling::None ? torch::linear(x, weight) : fp8_linear(x, weight, fp8); }
  // residual [rows, out] += x · weightᵀ in place: the matrix product's epilogue adds it (a
  // residual add with no kernel of its own; an FP8 product's output is added after it).
  Tensor add_into(Tensor& residual, const Tensor& x) {
    const Tensor rows = x.reshape({-1, weight.size(1)});
    return fp8 == Fp8Scaling::None ? residual.addmm_(rows, weight.t()) : residual.add_(fp8_linear(rows, weight, fp8));
  }
  Tensor weight;
  Fp8Scaling fp8 = Fp8Scaling::None;  // set by use_fp8 for the blocks' linear layers
};
TORCH_MODULE(Linear);

struct EmbeddingImpl : nn::Module {
  EmbeddingImpl(int64_t vocab, int64_t dim, const torch::TensorOptions& o) { weight = register_parameter("weight", torch::empty({vocab, dim}, o)); }
  Tensor forward(const Tensor& ids) { return torch::embedding(weight, ids); }
  Tensor weight;
};
TORCH_MODULE(Embedding);

struct RMSNormImpl : nn::Module {
  RMSNormImpl(int64_t dim, double eps, const torch::TensorOptions& o) : eps(eps) { weight = register_parameter("weight", torch::empty({dim}, o)); }
  Tensor forward(const Tensor& x) { return fused::rms_norm(x, weight, eps); }  // mean of squares in fp32
  Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// YaRN's mscale: the attention temperature of a context extended `factor` times (DeepSeek-V2 app. B).
double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

// Rotary position embedding tables: cos and sin of every position's angles, [max_seq, dim] fp32
// with equal halves (Llama layout); fused::rotary applies them. With YaRN each frequency blends its
// trained value and its interpolation (factor times slower) by how many turns it makes over the
// original length, and the tables carry the attention factor mscale(factor, mscale) /
// mscale(factor, mscale_all_dim) (Hugging Face's _compute_yarn_parameters; DeepSeek-V3's
// precompute_freqs_cis).
struct Rotary {
  Tensor cos, sin;  // on the CPU
  mutable Tensor cos_on_device, sin_on_device;
  Rotary(int64_t dim, int64_t max_seq, double theta, const RopeScaling& scaling) {
    Tensor inv = 1.0 / torch::pow(theta, torch::arange(0, dim, 2, torch::kFloat64) / static_cast<double>(dim));
    double attention_factor = 1;
    if (scaling.kind == RopeScalingKind::Yarn) {
      const double original = static_cast<double>(scaling.original_max_position_embeddings);
      // The dimension whose wavelength makes `turns` full turns over the original length.
      auto correction_dim = [&](double turns) { return dim * std::log(original / (turns * 2 * M_PI)) / (2 * std::log(theta)); };
      const double low = std::max(std::floor(correction_dim(scaling.beta_fast)), 0.0);
      double high = std::min(std::ceil(correction_dim(scaling.beta_slow)), static_cast<double>(dim - 1));
      if (low == high) high += 0.001;
      Tensor ramp = ((torch::arange(dim / 2, torch::kFloat64) - low) / (high - low)).clamp(0, 1);
      Tensor keep = 1 - ramp;  // 1: the trained frequency (fast dimensions), 0: interpolated
      inv = inv / scaling.factor * (1 - keep) + inv * keep;
      attention_factor = scaling.mscale_all_dim > 0 ? yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
                                                    : yarn_mscale(scaling.factor, 1.0);
    }
    Tensor angles = torch::outer(torch::arange(max_seq, torch::kFloat64), inv);
    Tensor full = torch::cat({angles, angles}, -1);
    cos = (full.cos() * attention_factor).to(torch::kFloat32);
    sin = (full.sin() * attention_factor).to(torch::kFloat32);
  }
  // The tables on `device`, copied once per device, not per call.
  void move_to(const torch::Device& device) const {
    if (!cos_on_device.defined() || cos_on_device.device() != device) {
      cos_on_device = cos.to(device);
      sin_on_device = sin.to(device);
    }
  }
};

// Where the tokens of a batch sit. With separate documents (data.separate_documents) each token
// takes the rotary rows of its position within its document and attention stays inside the
// document (document_attention.hpp); with a sequence split over context ranks (Batch::places),
// the rows of its place in the whole sequence, and the runner attends over the whole sequence;
// else rows 0..s-1 and plain causal attention.
struct TokenPositions {
  const Rotary* rope = nullptr;
  std::shared_ptr<const PackedDocuments> documents;  // null: one sequence per row
  Tensor places;                                     // [s] on the device; undefined: not split
  Tensor place_rows;                                 // places as the rotary tables' rows, [b, s]
  UnitRunner* runner = nullptr;                      // attends over split sequences

  TokenPositions(const Rotary& r, const Batch& batch, bool variable_length, UnitRunner& unit_runner) : rope(&r), runner(&unit_runner) {
    if (batch.positions.defined()) documents = std::make_shared<const PackedDocuments>(batch.documents, batch.positions, batch.inputs.device(), variable_length);
    if (batch.places.defined()) {
      places = batch.places.to(batch.inputs.device());
      place_rows = places.unsqueeze(0).expand({batch.inputs.size(0), places.size(0)}).contiguous();
    }
  }
  bool plain() const { return !documents && !places.defined(); }
  // The rotary tables' row of each token, [b, s]; undefined: rows 0..s-1.
  Tensor rows() const { return documents ? documents->positions() : place_rows; }
  // {q, k rotated, v} from the q/k/v projection of x by `projection` (fused::project_qkv; an FP8
  // projection's product first, then the rotation).
  std::vector<Tensor> project_qkv(const Tensor& x, Linear& projection, int64_t q_width, int64_t k_width, int64_t head_dim) const {
    rope->move_to(x.device());
    const Tensor positions = rows();
    if (projection->fp8 != Fp8Scaling::None)
      return fused::rotate_qkv(projection(x), q_width, k_width, head_dim, rope->cos_on_device, rope->sin_on_device, positions);
    return fused::project_qkv(x, projection->weight, q_width, k_width, head_dim, rope->cos_on_device, rope->sin_on_device, positions);
  }
  // x [b, s, n, d] with its rotary pairs interleaved (DeepSeek-V2/V3's released weights: pairs
  // (2i, 2i+1)), rotated and returned in the halves layout (i, i + d/2), as Hugging Face's
  // rope_interleave does: queries and keys take the same reordering, so their products are DeepSeek's.
  // The reordered heads go through fused::rotary, as multi-head attention's do.
  Tensor rotate_interleaved(const Tensor& x) const {
    rope->move_to(x.device());
    const int64_t b = x.size(0), s = x.size(1), n = x.size(2), d = x.size(3);
    const Tensor halves = x.reshape({b, s, n, d / 2, 2}).transpose(3, 4).reshape({b, s, n * d});
    return fused::rotary(halves, d, rope->cos_on_device, rope->sin_on_device, rows()).view({b, s, n, d});
  }
  // Causal attention (within documents where there are some; over the whole sequence where it is
  // split) of q [b, s, heads, dq], k [b, s, kv_heads, dq] and v [b, s, kv_heads, dv], heads a
  // multiple of kv_heads; returns [b, s, heads · dv]. On a GPU values narrower than the keys are
  // padded to their width, since the flash kernels take one head width (Hugging Face does the same).
  Tensor attend(const Tensor& q, const Tensor& k, Tensor v) const {
    const int64_t b = q.size(0), s = q.size(1), heads = q.size(2), dv = v.size(3);
    if (q.is_cuda() && dv != q.size(3)) v = torch::constant_pad_nd(v, {0, q.size(3) - dv});
    Tensor out;
    if (documents) out = documents->attend(q, k, v);
    else if (places.defined()) out = runner->split_sequence_attention(q, k, v, places);
    else {
      DSRUN_ASSERT(k.size(2) == heads, "plain causal attention takes as many key heads as query heads");
      out = compat::causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2);
    }
    if (out.size(-1) != dv) out = out.narrow(-1, 0, dv);
    return out.reshape({b, s, heads * dv});
  }
};

// q, k and v come from one fused projection (one matmul instead of three; the same parameters
// as separate wq, wk, wv stacked by rows). Head counts are read from the weight, so the layer runs
// as it is on a tensor-parallel rank's slice of the heads (engine/parallel/tensor_parallel.hpp).
struct AttentionImpl : nn::Module {
  AttentionImpl(const ModelSpec& m, const torch::TensorOptions& o) : group(m.heads / m.kv_heads), head_dim(m.head_dim()) {
    wqkv = register_module("wqkv", Linear(m.hidden, (m.heads + 2 * m.kv_heads) * head_dim, o));
    wo = register_module("wo", Linear(m.hidden, m.hidden, o));
  }
  Tensor forward(const Tensor& x, const TokenPositions& where) { return wo(context(x, where)); }
  // Attention's output before the output projection, [b, s, heads · head_dim].
  Tensor context(const Tensor& x, const TokenPositions& where) {
    const int64_t b = x.size(0), s = x.size(1);
    const int64_t kv_heads = wqkv->weight.size(0) / (head_dim * (group + 2)), heads = group * kv_heads;
    // q and k rotated, v passed through, from the one projection (fused::project_qkv: backward
    // never joins their gradients). [b, s, heads, d] viewed as [b, heads, s, d].
    const std::vector<Tensor> qkv = where.project_qkv(x, wqkv, heads * head_dim, kv_heads * head_dim, head_dim);
    if (!where.plain())  // [b, s, heads, d] as they lie; grouped-query heads shared by the kernel, the mask path or the gathered keys
      return where.attend(qkv[0].view({b, s, heads, head_dim}), qkv[1].view({b, s, kv_heads, head_dim}), qkv[2].view({b, s, kv_heads, head_dim}));
    Tensor q = qkv[0].view({b, s, heads, head_dim}).transpose(1, 2);
    Tensor k = qkv[1].view({b, s, kv_heads, head_dim}).transpose(1, 2);
    Tensor v = qkv[2].view({b, s, kv_heads, head_dim}).transpose(1, 2);
    if (group > 1) {  // grouped-query attention: each KV head serves `group` query heads
      k = k.repeat_interleave(group, 1);
      v = v.repeat_interleave(group, 1);
    }
    Tensor out = compat::causal_attention(q, k, v);
    return out.transpose(1, 2).reshape({b, s, heads * head_dim});
  }
  int64_t group, head_dim;  // query heads per KV head; the same on every tensor-parallel rank
  Linear wqkv{nullptr}, wo{nullptr};
};
TORCH_MODULE(Attention);

// Multi-head latent attention (DeepSeek-V2 section 2.1; V3 section 2.1.1). The queries come
// through a low-rank latent with its own norm (or one projection), the keys and values of every
// head from one kv_lora_rank latent (kv_norm, then wkv_b to each head's qk_nope key part and its
// value), and each head's key ends in one rotary key that all heads share (from wkv_a beside the
// latent). Softmax scale 1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)².
// Head counts are read from wkv_b, so the layer runs as it is on a tensor-parallel rank's heads;
// the down-projections are replicated, and their outputs enter the split region (Megatron-Core's
// MLA), so that their weights' gradients are summed over the tensor ranks.
struct LatentAttentionImpl : nn::Module {
  LatentAttentionImpl(const ModelSpec& m, const torch::TensorOptions& o) : a(m.mla) {
    const int64_t heads = m.heads;
    if (a.q_lora_rank > 0) {
      wq_a = register_module("wq_a", Linear(m.hidden, a.q_lora_rank, o));
      q_norm = register_module("q_norm", RMSNorm(a.q_lora_rank, m.norm_eps, o));
      wq_b = register_module("wq_b", Linear(a.q_lora_rank, heads * a.qk_head_dim(), o));
    } else {
      wq = register_module("wq", Linear(m.hidden, heads * a.qk_head_dim(), o));
    }
    wkv_a = register_module("wkv_a", Linear(m.hidden, a.kv_lora_rank + a.qk_rope_head_dim, o));
    kv_norm = register_module("kv_norm", RMSNorm(a.kv_lora_rank, m.norm_eps, o));
    wkv_b = register_module("wkv_b", Linear(a.kv_lora_rank, heads * (a.qk_nope_head_dim + a.v_head_dim), o));
    wo = register_module("wo", Linear(heads * a.v_head_dim, m.hidden, o));
    if (m.rope_scaling.kind == RopeScalingKind::Yarn && m.rope_scaling.mscale_all_dim > 0) {
      const double mscale = yarn_mscale(m.rope_scaling.factor, m.rope_scaling.mscale_all_dim);
      query_scale = mscale * mscale;
    }
  }
  // x [b, s, hidden] as it leaves the norm (not yet in the split region): attention's output before
  // wo, [b, s, local heads · v_head_dim].
  Tensor context(const Tensor& x, const TokenPositions& where, UnitRunner& runner) {
    const int64_t nope = a.qk_nope_head_dim, rope = a.qk_rope_head_dim, dv = a.v_head_dim;
    Tensor q = a.q_lora_rank > 0 ? wq_b(runner.enter_split(q_norm(wq_a(x)))) : wq(runner.enter_split(x));
    const Tensor kv_a = wkv_a(x);
    const Tensor latent = runner.enter_split(kv_norm(kv_a.narrow(-1, 0, a.kv_lora_rank)));
    const Tensor k_rope = runner.enter_split(kv_a.narrow(-1, a.kv_lora_rank, rope));
    const int64_t b = q.size(0), s = q.size(1), heads = wkv_b->weight.size(0) / (nope + dv);
    q = q.view({b, s, heads, nope + rope});
    const Tensor kv = wkv_b(latent).view({b, s, heads, nope + dv});
    Tensor q_full = torch::cat({q.narrow(-1, 0, nope), where.rotate_interleaved(q.narrow(-1, nope, rope))}, -1);
    if (query_scale != 1) q_full = q_full * query_scale;
    const Tensor k_shared = where.rotate_interleaved(k_rope.unsqueeze(2));  // [b, s, 1, rope]
    const Tensor k = torch::cat({kv.narrow(-1, 0, nope), k_shared.expand({b, s, heads, rope})}, -1);
    return where.attend(q_full, k, kv.narrow(-1, nope, dv));
  }
  Tensor forward(const Tensor& x, const TokenPositions& where, UnitRunner& runner) { return wo(context(x, where, runner)); }
  MlaSpec a;
  double query_scale = 1;  // YaRN's mscale², folded into q (the kernels' own scale is 1/sqrt(qk_head_dim))
  Linear wq_a{nullptr}, wq_b{nullptr}, wq{nullptr}, wkv_a{nullptr}, wkv_b{nullptr}, wo{nullptr};
  RMSNorm q_norm{nullptr}, kv_norm{nullptr};
};
TORCH_MODULE(LatentAttention);

// down(silu(gate(x)) * up(x)), with gate and up fused into one projection of 2 x inner rows.
struct SwiGLUImpl : nn::Module {
  SwiGLUImpl(int64_t hidden, int64_t inner, const torch::TensorOptions& o) {
    gate_up = register_module("gate_up", Linear(hidden, 2 * inner, o));
    down = register_module("down", Linear(inner, hidden, o));
  }
  Tensor forward(const Tensor& x) { return down(inner(x)); }
  Tensor inner(const Tensor& x) { return fused::swiglu(gate_up(x)); }  // down's input
  Linear gate_up{nullptr}, down{nullptr};
};
TORCH_MODULE(SwiGLU);

// The token rows of the (token, choice) pairs whose tokens `token` lists (pair p = t·k + i is
// token t's i-th choice), in that order; `place` is the pairs' inverse ([T·k]: each pair's row, -1
// where a capacity dropped it). Backward sums each token's row gradients by gathering them
// (fused::combine_rows with weights of 1): no atomic adds, so the sum is deterministic.
struct DispatchTokens : torch::autograd::Function<DispatchTokens> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& tokens, const Tensor& token, const Tensor& place, int64_t top_k) {
    ctx->save_for_backward({place});
    ctx->saved_data["top_k"] = top_k;
    return tokens.index_select(0, token);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const Tensor place = ctx->get_saved_variables()[0];
    return {fused::combine_rows(grads[0], place, Tensor(), ctx->saved_data["top_k"].toInt()), Tensor(), Tensor(), Tensor()};
  }
};

// DeepSeek-MoE: every token goes through the shared experts and through its top-k routed experts,
// weighted by the router's scores (route(): softmax, not renormalised, as in DeepSeek-MoE 16B and
// V2-Lite; or V3's sigmoid, chosen within the best groups, normalised and scaled). The routed
// experts run on the (token, choice) pairs grouped by expert, as two grouped matrix products
// (grouped_experts.hpp), through the runner: under expert parallelism the pairs travel to the
// ranks that keep their experts. Without a capacity nothing on this path waits for the device.
struct MoEImpl : nn::Module {
  MoEImpl(const ModelSpec& m, int layer, const torch::TensorOptions& o)
      : layer(layer), top_k(m.moe.top_k), experts_count(m.moe.routed_experts), local_count(m.moe.routed_experts),
        aux_weight(m.moe.learns_bias() ? 0.0 : m.moe.aux_loss_weight), capacity_factor(m.moe.capacity_factor), spec(m.moe) {
    router = register_module("router", Linear(m.hidden, experts_count, o));
    for (int e = 0; e < experts_count; ++e) experts.push_back(register_module("expert" + std::to_string(e), SwiGLU(m.hidden, m.moe.intermediate, o)));
    if (m.moe.shared_experts > 0)  // S shared experts of size fe act like one SwiGLU of size S·fe
      shared = register_module("shared", SwiGLU(m.hidden, m.moe.shared_experts * m.moe.intermediate, o));
    if (!m.moe.route_bias.empty()) route_bias = torch::tensor(m.moe.route_bias, torch::kFloat64).to(torch::kFloat32);
    // Balance by bias (DeepSeek-V3): learned between steps (Model::balance_experts), fp32, model state.
    if (m.moe.learns_bias()) expert_bias = register_buffer("expert_bias", torch::zeros({experts_count}, torch::kFloat32));
  }
  Tensor forward(const Tensor& x, Tensor& aux_loss, UnitRunner& runner) {
    const auto shape = x.sizes().vec();
    Tensor tokens = x.reshape({-1, x.size(-1)});
    const int64_t T = tokens.size(0);
    // The router is replicated; the experts may be split. Its weights enter the split region, so
    // that their gradient (taken from the experts' partial outputs) is summed over the ranks.
    Tensor scores, chosen, weights;  // [T, E] fp32, [T, k] int64, [T, k] fp32
    route(tokens, scores, chosen, weights);
    weights = runner.enter_split(weights);
    Tensor expert_in = runner.enter_split(tokens);

    // Pair p = t·k + i is token t's i-th choice. A capacity keeps each expert's first pairs in token order.
    Tensor pair_expert = chosen.reshape({-1});
    Tensor routed = per_expert_counts(pair_expert);  // [E] int64
    Tensor pairs, counts;  // the kept pairs grouped by expert (in pair order within each: a stable sort), and how many each
    int64_t dropped = 0;
    if (capacity_factor > 0) {
      const int64_t capacity = static_cast<int64_t>(std::ceil(capacity_factor * T * top_k / experts_count));
      Tensor within = torch::one_hot(pair_expert, experts_count).cumsum(0).gather(1, pair_expert.unsqueeze(1)).squeeze(1);  // 1-based within its expert
      Tensor kept = (within <= capacity).nonzero().squeeze(-1);  // (reads the count back: capacity runs synchronise)
      dropped = T * top_k - kept.numel();
      Tensor kept_expert = pair_expert.index_select(0, kept);
      pairs = kept.index_select(0, std::get<1>(kept_expert.sort(/*stable=*/true, 0, false)));
      counts = per_expert_counts(kept_expert);
    } else {
      pairs = std::get<1>(pair_expert.sort(/*stable=*/true, 0, false));
      counts = routed;
    }
    runner.record_routing(layer, routed, dropped);
    // Each pair's row among the kept ones (-1: dropped), the inverse of `pairs`.
    Tensor place = torch::full({T * top_k}, -1, pairs.options()).scatter_(0, pairs, torch::arange(pairs.numel(), pairs.options()));
    RoutedPairs routed_pairs{expert_in, pairs.div(top_k, "floor"), top_k, {}};
    routed_pairs.rows = [&] { return DispatchTokens::apply(expert_in, routed_pairs.token, place, top_k); };
    // The shared experts run while the routed rows travel (expert parallelism; DeepSeek-V3's overlap).
    Tensor shared_out;
    Tensor outputs = runner.routed_experts(routed_pairs, counts, [this](const Tensor& r, const Tensor& c) { return local_experts(r, c); },
                                           [&] { if (shared) shared_out = shared(expert_in); });
    // Back to the tokens, weighted and summed over each token's choices (dropped pairs: nothing),
    // in one kernel on a GPU. (Before: the outputs copied into pair order, multiplied by the
    // weights and summed, three passes over [T·k, h]; a batched product [T, 1, k] x [T, k, h] ran
    // a 32x32-tile kernel 4x slower still on an H100.)
    Tensor out = fused::combine_rows(outputs, place, weights, top_k);
    if (shared) out = out + shared_out;
    out = runner.leave_split(out);
    // Expert-level balance loss (DeepSeek-MoE eq. 12): α Σ_i f_i P_i, f_i = E/(kT) · tokens routed to i,
    // P_i = mean router score of i. Equals α when routing is perfectly uniform.
    // Under a sigmoid router P_i takes the scores normalised to sum 1 per token (V3's eq. 19);
    // normalised only where a balance loss reads them.
    Tensor affinity = scores;
    if (spec.scoring == RouterScore::Sigmoid && (aux_weight > 0 || spec.seq_aux_loss_weight > 0)) affinity = scores / scores.sum(-1, true);
    if (aux_weight > 0)
      aux_loss = aux_loss + aux_weight * balance_product(routed.to(torch::kFloat32), affinity.sum(0), torch::full({1}, static_cast<double>(T), affinity.options()), runner);
    // V3's sequence-wise balance loss (eq. 17-20): the same product within each sequence of the
    // micro-batch, averaged over the sequences.
    if (spec.seq_aux_loss_weight > 0) {
      const int64_t sequences = shape.size() == 3 ? shape[0] : 1, per = T / sequences;
      Tensor chosen_counts = torch::zeros({sequences, experts_count}, scores.options()).scatter_add_(
          1, chosen.view({sequences, per * top_k}), torch::ones({sequences, per * top_k}, scores.options()));
      const Tensor product = balance_product(chosen_counts, affinity.view({sequences, per, experts_count}).sum(1),
                                             torch::full({sequences, 1}, static_cast<double>(per), affinity.options()), runner);
      aux_loss = aux_loss + spec.seq_aux_loss_weight * product.mean();
    }
    return out.reshape(shape);
  }
  // The router: affinities (fp32), each token's chosen experts and their weights. The choice adds
  // the selection biases and, with groups, keeps only the topk_group best groups' experts (a
  // group's score: its best expert's under softmax, V2's group-limited greedy; its best two summed
  // under sigmoid, V3's); the weights are the unbiased affinities, normalised to sum 1 with
  // norm_topk_prob, times routed_scaling_factor.
  void route(const Tensor& tokens, Tensor& scores, Tensor& chosen, Tensor& weights) {
    const Tensor logits = router(tokens).to(torch::kFloat32);
    scores = spec.scoring == RouterScore::Sigmoid ? logits.sigmoid() : torch::softmax(logits, -1);
    Tensor choice = choice_scores(scores);
    if (spec.n_group > 1) {
      const int64_t T = scores.size(0), per_group = experts_count / spec.n_group;
      const Tensor grouped = choice.view({T, spec.n_group, per_group});
      const Tensor group_scores = spec.scoring == RouterScore::Sigmoid ? std::get<0>(grouped.topk(2, -1)).sum(-1) : std::get<0>(grouped.max(-1));
      const Tensor kept = std::get<1>(group_scores.topk(spec.topk_group, -1));  // [T, topk_group]
      const Tensor allowed = torch::zeros({T, spec.n_group}, torch::TensorOptions().dtype(torch::kBool).device(scores.device())).scatter_(1, kept, true);
      // -inf, as DeepSeek-V3's own inference code masks (Hugging Face fills 0, which differs only
      // where a kept expert's biased score is below 0).
      choice = grouped.masked_fill(allowed.logical_not().unsqueeze(-1), -std::numeric_limits<float>::infinity()).view({T, experts_count});
    }
    chosen = std::get<1>(choice.topk(top_k, -1));
    weights = scores.gather(1, chosen);
    if (spec.norm_topk_prob) weights = weights / (weights.sum(-1, true) + 1e-20);
    if (spec.routed_scaling_factor != 1) weights = weights * spec.routed_scaling_factor;
  }
  // The scores experts are chosen by: the router's, plus the fixed bias of the recipe and the
  // learned one. Neither bias weights an expert's output.
  Tensor choice_scores(const Tensor& scores) {
    Tensor s = scores;
    if (route_bias.defined()) {
      if (route_bias.device() != scores.device()) route_bias = route_bias.to(scores.device());  // once, not per call
      s = s + route_bias;
    }
    if (expert_bias.defined()) s = s + expert_bias.to(scores.device());
    return s;
  }
  // This rank's routed experts on their rows, grouped: their weights lie one after another in the
  // unit's flat buffer (DeepSeekModel::units), so stacking them copies nothing.
  // Σ_i f_i P_i over the last dimension: f_i = E/(k·tokens) · `routed` pairs to expert i (no
  // gradient), P_i = `score_sums` of i / tokens. All three count whole sequences: where context
  // parallelism splits them, the runner sums each rank's over the group, in one collective.
  Tensor balance_product(const Tensor& routed, const Tensor& score_sums, const Tensor& tokens, UnitRunner& runner) const {
    const Tensor stats = runner.sum_over_sequences(torch::cat({routed, score_sums, tokens}, -1));
    const Tensor whole = stats.narrow(-1, 2 * experts_count, 1);
    const Tensor f = stats.narrow(-1, 0, experts_count).detach() * (static_cast<double>(experts_count) / top_k) / whole;
    const Tensor p = stats.narrow(-1, experts_count, experts_count) / whole;
    return (f * p).sum(-1);
  }

  Tensor local_experts(const Tensor& rows, const Tensor& counts) {
    std::vector<Tensor> gate_up, down;
    for (int e = first_local; e < first_local + local_count; ++e) {
      gate_up.push_back(experts[e]->gate_up->weight);
      down.push_back(experts[e]->down->weight);
    }
    return grouped_swiglu_experts(rows, counts, gate_up, down, routed_fp8);
  }
  // Pairs per expert, [E] int64, without a device sync (torch::bincount reads the maximum back).
  Tensor per_expert_counts(const Tensor& pair_expert) const {
    return torch::zeros({experts_count}, pair_expert.options()).scatter_add_(0, pair_expert, torch::ones_like(pair_expert));
  }
  // DeepSeek-V3's update: bias += rate · sign(mean load − load), loads summed over every rank.
  void balance(const Tensor& loads, double rate) {
    torch::NoGradGuard no_grad;
    Tensor l = loads.to(torch::kFloat64);
    Tensor step = ((l.mean() - l).sign() * rate).to(torch::kFloat32);
    expert_bias.add_(step.to(expert_bias.device()));
  }
  // Keeps routed experts [shard·E/S, (shard+1)·E/S); the others' parameters are dropped.
  void keep_experts(int shard, int shards) {
    torch::NoGradGuard no_grad;
    local_count = experts_count / shards;
    first_local = shard * local_count;
    for (int e = 0; e < experts_count; ++e)
      if (e < first_local || e >= first_local + local_count)
        for (auto& p : experts[e]->parameters()) p.set_data(torch::empty({0}, p.options()));
  }
  int layer, top_k, experts_count;
  int first_local = 0, local_count;  // the routed experts this rank keeps
  bool routed_fp8 = false;           // execution.fp8_routed_experts: their grouped products in FP8 (set by use_fp8)
  double aux_weight, capacity_factor;
  MoeSpec spec;  // the router's rule (scoring, groups, normalisation, scaling, sequence-wise loss)
  Tensor route_bias;   // [E] fp32, or undefined
  Tensor expert_bias;  // [E] fp32 buffer with balance = "bias", or undefined
  Linear router{nullptr};
  std::vector<SwiGLU> experts;
  SwiGLU shared{nullptr};
};
TORCH_MODULE(MoE);

struct BlockImpl : nn::Module {
  BlockImpl(const ModelSpec& m, int layer, bool moe, const torch::TensorOptions& o) {
    attn_norm = register_module("attn_norm", RMSNorm(m.hidden, m.norm_eps, o));
    if (m.latent_attention()) mla = register_module("attn", LatentAttention(m, o));
    else attn = register_module("attn", Attention(m, o));
    mlp_norm = register_module("mlp_norm", RMSNorm(m.hidden, m.norm_eps, o));
    if (moe) this->moe = register_module("moe", MoE(m, layer, o));
    else mlp = register_module("mlp", SwiGLU(m.hidden, m.intermediate, o));
  }
  // Without tensor parallelism the attention output and down projections add their outputs into
  // the residual stream in place: the norm before each writes the stream's next value as a copy of
  // its input (fused::rms_norm_with_copy) and the projection's epilogue adds into it, so neither the
  // residual adds nor autograd's sums of the stream's gradient run kernels of their own (4 of 63 us
  // each per layer on the 1B's H100 profile). Split layers reduce their partial sums first.
  Tensor forward(const Tensor& x, const TokenPositions& where, Tensor& aux_loss, UnitRunner& runner) {
    const bool in_place = runner.splits_nothing();
    Tensor h;
    if (mla)  // (its latents enter the split region inside the layer)
      h = in_place ? add_in_place(x, attn_norm, mla->wo, [&](const Tensor& normed) { return mla->context(normed, where, runner); })
                   : x + runner.leave_split(mla(attn_norm(x), where, runner));
    else
      h = in_place ? add_in_place(x, attn_norm, attn->wo, [&](const Tensor& normed) { return attn->context(normed, where); })
                   : x + runner.leave_split(attn(runner.enter_split(attn_norm(x)), where));
    if (moe) return h + moe(mlp_norm(h), aux_loss, runner);
    if (in_place) return add_in_place(h, mlp_norm, mlp->down, [&](const Tensor& normed) { return mlp->inner(normed); });
    return h + runner.leave_split(mlp(runner.enter_split(mlp_norm(h))));
  }
  // x + projection(inner(norm(x))), the sum in the projection's epilogue on the norm's copy of x.
  template <class Inner>
  static Tensor add_in_place(const Tensor& x, RMSNorm& norm, Linear& projection, Inner&& inner) {
    std::vector<Tensor> stream = fused::rms_norm_with_copy(x, norm->weight, norm->eps);  // {copy, normed}
    return projection->add_into(stream[0], inner(stream[1])).view(x.sizes());
  }
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  Attention attn{nullptr};        // multi-head or grouped-query attention, or
  LatentAttention mla{nullptr};   // latent attention (model.attention = "mla"); either is named "attn"
  SwiGLU mlp{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(Block);

// One multi-token prediction module (DeepSeek-V3 section 2.2, eq. 21-23): the previous depth's
// hidden states and the embeddings of the tokens one place further, each RMS-normed, concatenated
// (embedding first, as the released weights' eh_proj reads them), projected back to the hidden
// size and passed through one transformer block (a MoE block in a MoE model, as V3's); `norm` is
// its own final norm before the shared output head (Hugging Face shared_head.norm).
struct MtpImpl : nn::Module {
  MtpImpl(const ModelSpec& m, int layer, const torch::TensorOptions& o) {
    enorm = register_module("enorm", RMSNorm(m.hidden, m.norm_eps, o));
    hnorm = register_module("hnorm", RMSNorm(m.hidden, m.norm_eps, o));
    eh_proj = register_module("eh_proj", Linear(2 * m.hidden, m.hidden, o));
    block = register_module("block", Block(m, layer, m.moe.enabled(), o));
    norm = register_module("norm", RMSNorm(m.hidden, m.norm_eps, o));
  }
  // h, next [b, n, hidden]: the previous depth's states at positions 0..n-1 and the embeddings of
  // the tokens at positions k..k+n-1 (depth k). Returns this depth's states, [b, n, hidden].
  Tensor forward(const Tensor& h, const Tensor& next, const TokenPositions& where, Tensor& aux_loss, UnitRunner& runner) {
    return block->forward(eh_proj(torch::cat({enorm(next), hnorm(h)}, -1)), where, aux_loss, runner);
  }
  RMSNorm enorm{nullptr}, hnorm{nullptr}, norm{nullptr};
  Linear eh_proj{nullptr};
  Block block{nullptr};
};
TORCH_MODULE(Mtp);

struct DecoderModule : nn::Module {
  DecoderModule(const ModelSpec& m, const torch::TensorOptions& o) {
    embedding = register_module("embedding", Embedding(m.vocab, m.hidden, o));
    for (int i = 0; i < m.layers; ++i) {
      bool moe = m.moe.enabled() && i >= m.moe.first_dense_layers;
      blocks.push_back(register_module("block" + std::to_string(i), Block(m, i, moe, o)));
    }
    norm = register_module("norm", RMSNorm(m.hidden, m.norm_eps, o));
    if (!m.tie_embeddings) head = register_module("head", Linear(m.hidden, m.vocab, o));
    for (int k = 0; k < m.mtp.depth; ++k) mtp.push_back(register_module("mtp" + std::to_string(k), Mtp(m, m.layers + k, o)));
  }
  Embedding embedding{nullptr};
  std::vector<Block> blocks;
  std::vector<Mtp> mtp;  // multi-token prediction, depth 1 first; they share the embedding and head
  RMSNorm norm{nullptr};
  Linear head{nullptr};
};

// How tensor parallelism splits each weight (Megatron-LM's layout): q/k/v and gate/up are
// column-parallel, the attention output and down projections row-parallel, the embedding and the
// output head split by vocabulary; norms, the MoE router, MLA's down-projections (wq_a, wkv_a) and
// MTP's eh_proj are replicated.
TensorSplit split_of(const std::string& name, const Tensor& p, const ModelSpec& m) {
  TensorSplit s;
  if (ends_with(name, "attn.wq.weight") || ends_with(name, "attn.wq_b.weight") || ends_with(name, "attn.wkv_b.weight")) {
    s.kind = TensorSplit::Rows;  // MLA: rows head after head, so a rank's equal share is whole heads
  } else if (ends_with(name, "attn.wqkv.weight")) {
    s.kind = TensorSplit::Rows;
    s.segments = {static_cast<int64_t>(m.heads) * m.head_dim(), static_cast<int64_t>(m.kv_heads) * m.head_dim(), static_cast<int64_t>(m.kv_heads) * m.head_dim()};
  } else if (ends_with(name, "gate_up.weight")) {
    s.kind = TensorSplit::Rows;
    s.equal_parts = 2;  // gate rows, then up rows: equal halves whatever slice of them this tensor holds
  } else if (ends_with(name, "attn.wo.weight") || ends_with(name, "down.weight")) {
    s.kind = TensorSplit::Columns;
  } else if (name == "embedding.weight" || name == "head.weight") {
    s.kind = TensorSplit::Rows;
  }
  return s;
}

// A module's parameters, their names in the whole model ("block3.attn.wqkv.weight") and splits.
struct Named {
  std::vector<Tensor> params;
  std::vector<std::string> names;
  std::vector<TensorSplit> splits;
};
Named params_of(nn::Module& m, const std::string& prefix, const ModelSpec& spec, const std::function<bool(const std::string&)>& skip = nullptr) {
  Named out;
  for (auto& p : m.named_parameters()) {
    if (skip && skip(p.key())) continue;
    out.params.push_back(p.value());
    out.names.push_back(prefix + "." + p.key());
    out.splits.push_back(split_of(out.names.back(), p.value(), spec));
  }
  return out;
}

// The parts one after another.
Named joined(const std::vector<Named>& parts) {
  Named all;
  for (const Named& part : parts) {
    all.params.insert(all.params.end(), part.params.begin(), part.params.end());
    all.names.insert(all.names.end(), part.names.begin(), part.names.end());
    all.splits.insert(all.splits.end(), part.splits.begin(), part.splits.end());
  }
  return all;
}

// The routed experts' weights kind after kind: every gate/up weight in expert order, then every
// down weight, after the layer's other parameters. ZeRO lays a unit's parameters out in its flat
// buffer in this order, so each kind is one [experts, ...] block that the grouped products read
// as a view (stack_weights) rather than a copy per step.
Named with_experts_stacked(const Named& n) {
  std::vector<size_t> order, gate_up, down;
  for (size_t i = 0; i < n.names.size(); ++i) {
    const bool routed = n.names[i].find(".moe.expert") != std::string::npos;
    if (routed && ends_with(n.names[i], ".gate_up.weight")) gate_up.push_back(i);
    else if (routed && ends_with(n.names[i], ".down.weight")) down.push_back(i);
    else order.push_back(i);
  }
  order.insert(order.end(), gate_up.begin(), gate_up.end());
  order.insert(order.end(), down.begin(), down.end());
  Named out;
  for (size_t i : order) {
    out.params.push_back(n.params[i]);
    out.names.push_back(n.names[i]);
    out.splits.push_back(n.splits[i]);
  }
  return out;
}

// precision.fp8 applied from outside the layers, as torchtitan's float8 converter does: the blocks'
// linear layers (attention's projections, the dense MLPs, the shared experts) run FP8 products, and
// the routed experts' grouped products where the plan says (execution.fp8_routed_experts); the
// embedding, the head, the norms and the router do not.
void use_fp8(DecoderModule& net, Fp8Scaling fp8, bool routed_experts) {
  auto mlp = [&](SwiGLU& s) {
    if (s) s->gate_up->fp8 = s->down->fp8 = fp8;
  };
  std::vector<Block> blocks = net.blocks;
  for (Mtp& m : net.mtp) blocks.push_back(m->block);
  for (Block& b : blocks) {
    if (b->attn) b->attn->wqkv->fp8 = b->attn->wo->fp8 = fp8;
    if (b->mla) {
      // Every MLA projection whose sizes are whole blocks (kv_lora_rank + qk_rope_head_dim = 576 is not).
      const int64_t multiple = fp8_size_multiple(fp8);
      for (Linear* l : {&b->mla->wq_a, &b->mla->wq_b, &b->mla->wq, &b->mla->wkv_a, &b->mla->wkv_b, &b->mla->wo})
        if (*l && (*l)->weight.size(0) % multiple == 0 && (*l)->weight.size(1) % multiple == 0) (*l)->fp8 = fp8;
    }
    mlp(b->mlp);
    if (b->moe) {
      mlp(b->moe->shared);
      b->moe->routed_fp8 = routed_experts && fp8 != Fp8Scaling::None;
    }
  }
}

class DeepSeekModel final : public Model {
 public:
  DeepSeekModel(const ModelSpec& spec, int64_t seq_len, const ModelBuild& build)
      : spec_(spec), seed_(build.seed), build_(build),
        net_(std::make_shared<DecoderModule>(spec, torch::TensorOptions().dtype(torch::kFloat32))), rope_(spec.rope_dim(), std::max(seq_len, spec.max_seq_len), spec.rope_theta, spec.rope_scaling),
        deferred_(build.deferred) {
    use_fp8(*net_, build.fp8, build.fp8_routed_experts);
    if (deferred_) return;
    torch::NoGradGuard no_grad;
    for (auto& p : net_->named_parameters()) initialize_parameter(p.key(), p.value());
  }

  // Norm weights are 1; every other weight is N(0, init_std²) from a generator of its own, seeded
  // by the run's seed and the parameter's name: the same values whatever the layout, the rank, or
  // the order in which units are built.
  void initialize_parameter(const std::string& name, Tensor& values) const override {
    torch::NoGradGuard no_grad;
    if (name.find("norm") != std::string::npos) {
      values.fill_(1.0);
      return;
    }
    uint64_t h = 1469598103934665603ULL;  // FNV-1a of the name, mixed with the seed
    for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
    torch::Generator gen = at::detail::createCPUGenerator(h ^ (seed_ * 0x9E3779B97F4A7C15ULL));
    values.normal_(0.0, spec_.init_std, gen);
  }

  std::vector<ParameterUnit> parameter_units() override {
    std::vector<int> block_of;
    std::vector<ParameterUnit> all = units(/*pipeline_numbering=*/!chunks_.empty(), &block_of), kept;
    std::vector<int> kept_blocks;
    if (chunks_.empty()) {
      kept = all;
      kept_blocks = block_of;
    }
    for (const UnitRange& c : chunks_)
      for (int u = c.begin; u < c.end; ++u) {
        kept.push_back(all[u]);
        kept_blocks.push_back(block_of[u]);
      }
    if (expert_shards_ == 1) return kept;
    // Each MoE block's kept routed experts, as units of their own after all the others.
    // (The unit that holds the head also runs the MTP modules: their MoE blocks' experts too.)
    const size_t ordinary = kept.size();
    auto experts_apart = [&](size_t k, MoE& moe, const std::string& prefix, const std::string& name) {
      std::vector<Named> parts;
      for (int e = moe->first_local; e < moe->first_local + moe->local_count; ++e) parts.push_back(params_of(*moe->experts[e], prefix + std::to_string(e), spec_));
      kept.push_back(make_unit(name, {with_experts_stacked(joined(parts))}, /*checkpointable=*/false, /*always=*/true));  // (grouped: an expert no token chose gets a zero gradient)
      kept.back().experts_of = static_cast<int>(k);
    };
    for (size_t k = 0; k < ordinary; ++k) {
      if (kept_blocks[k] == kHeadUnit) {
        for (size_t d = 0; d < net_->mtp.size(); ++d)
          if (net_->mtp[d]->block->moe) experts_apart(k, net_->mtp[d]->block->moe, "mtp" + std::to_string(d) + ".block.moe.expert", kept[k].name + " mtp" + std::to_string(d) + " experts");
        continue;
      }
      if (kept_blocks[k] < 0 || !net_->blocks[kept_blocks[k]]->moe) continue;
      experts_apart(k, net_->blocks[kept_blocks[k]]->moe, "block" + std::to_string(kept_blocks[k]) + ".moe.expert", kept[k].name + " experts");
    }
    return kept;
  }

  void keep_experts(int shard, int shards) override {
    expert_shards_ = shards;
    for (auto& block : net_->blocks)
      if (block->moe) block->moe->keep_experts(shard, shards);
    for (auto& module : net_->mtp)
      if (module->block->moe) module->block->moe->keep_experts(shard, shards);
  }

  ModelOutput forward(const Batch& batch, UnitRunner& runner) override {
    DSRUN_ASSERT(chunks_.empty(), "a pipelined model runs by chunks (forward_chunk)");
    Tensors state;
    if (spec_.tie_embeddings) {
      // One outer unit holds the embedding and the final norm, around the blocks: ZeRO-3 gathers
      // the shared weight once for the lookup and the output projection.
      state = runner.run(0, [&](const Tensors& in) {
        const Tensor embedded = runner.embedding(net_->embedding->weight, in[0]);
        Tensors s = run_units({1, blocks() + 1}, 1, batch, {embedded, zero_aux(batch)}, runner);
        Tensor aux = s[1];
        const Tensor normed = net_->norm(s[0]);
        if (!net_->mtp.empty()) {
          const Tensor mtp = mtp_loss(normed, embedded, net_->embedding->weight, batch, aux, runner);
          aux = aux + mtp;
        }
        return Tensors{head(runner.enter_split(normed), net_->embedding->weight, batch, runner), aux};
      }, {batch.inputs});
    } else {
      state = run_units({0, pipeline_unit_count()}, 0, batch, {}, runner);
    }
    ModelOutput out;
    (computes_loss() ? out.loss : out.logits) = state[0];
    if (spec_.moe.enabled() || spec_.mtp.enabled()) out.aux_loss = state[1];  // (with MTP: its weighted loss too)
    out.mtp_loss = last_mtp_loss_;
    return out;
  }

  int pipeline_unit_count() const override { return blocks() + 2; }

  void keep_only(const std::vector<UnitRange>& chunks) override {
    chunks_ = chunks;
    std::vector<bool> kept(pipeline_unit_count(), false);
    for (const UnitRange& c : chunks)
      for (int u = c.begin; u < c.end; ++u) kept.at(u) = true;
    torch::NoGradGuard no_grad;
    std::vector<int> block_of;
    std::vector<ParameterUnit> all = units(true, &block_of);
    for (size_t u = 0; u < all.size(); ++u)
      if (!kept[u])
        for (Tensor& p : all[u].params) p.set_data(torch::empty({0}, p.options()));
    if (embedding_read_by_head() && kept.back() && !kept.front()) head_copy_ = torch::empty({0}).requires_grad_(true);
  }

  Tensors forward_chunk(int chunk, const Batch& batch, const Tensors& state, UnitRunner& runner) override {
    int first_local = 0;  // units of the chunks kept before this one
    for (int c = 0; c < chunk; ++c) first_local += chunks_.at(c).size();
    return run_units(chunks_.at(chunk), first_local, batch, state, runner);
  }

  TiedEmbedding tied_embedding() override {
    if (!embedding_read_by_head() || chunks_.empty()) return {};
    TiedEmbedding t;
    if (chunks_.front().begin == 0) t.weight = net_->embedding->weight;
    t.head_copy = head_copy_;
    return t;
  }

  void balance_experts(int layer, const Tensor& loads, double rate) override {
    MoE& moe = layer < blocks() ? net_->blocks.at(layer)->moe : net_->mtp.at(layer - blocks())->block->moe;
    DSRUN_ASSERT(moe && moe->expert_bias.defined(), "layer " + std::to_string(layer) + " learns no selection bias");
    moe->balance(loads, rate);
  }

  bool computes_loss() const override { return build_.loss_chunk_tokens > 0; }
  Tensor last_mtp_loss() const override { return last_mtp_loss_; }

  nn::Module& module() override { return *net_; }
  bool deferred() const override { return deferred_; }

 private:
  int blocks() const { return static_cast<int>(net_->blocks.size()); }
  // The head's unit reads the embedding's weight: as its own (tied) or for the MTP modules' lookups.
  // A pipeline then copies it to the last stage every step and sends its gradient back (TiedEmbedding).
  bool embedding_read_by_head() const { return spec_.tie_embeddings || spec_.mtp.enabled(); }

  // The output projection of the normed hidden states x [b, s, h]: the logits, or with a loss chunk
  // the mean cross-entropy against the batch's targets, projected chunk by chunk.
  Tensor head(const Tensor& x, const Tensor& w, const Batch& batch, UnitRunner& runner) const {
    if (!computes_loss()) return torch::linear(x, w);
    return runner.projected_loss(x.reshape({-1, x.size(-1)}), w, batch.targets.reshape({-1}), build_.loss_chunk_tokens, build_.loss_gradients_in_forward);
  }
  // The MTP modules' loss, loss_weight × their mean cross-entropy (DeepSeek-V3 eq. 24-25), from the
  // main model's final states after its norm `normed` (what vLLM and transformers feed the released
  // MTP layer) and the embedding's output `embedded` [b, s, h]. Depth k sees positions 0..s-k-1:
  // the states of depth k-1 there (a module's after its own norm), the embeddings of the tokens k
  // further (inputs k..s-1), and predicts targets k..s-1 (the tokens k+1 further). Their MoE balance
  // losses go into aux_loss. The head's weight `w` is shared; the loss is projected chunk by chunk.
  Tensor mtp_loss(const Tensor& normed, const Tensor& embedded, const Tensor& w, const Batch& batch, Tensor& aux_loss, UnitRunner& runner) {
    const TokenPositions where(rope_, batch, build_.variable_length_attention, runner);
    const int64_t s = normed.size(1), depth = static_cast<int64_t>(net_->mtp.size());
    DSRUN_ASSERT(s > depth, "a sequence of " + std::to_string(s) + " tokens is too short for " + std::to_string(depth) + " MTP modules");
    const int64_t chunk = build_.loss_chunk_tokens > 0 ? build_.loss_chunk_tokens : 4096;
    Tensor h = normed, total;
    for (int64_t k = 1; k <= depth; ++k) {
      const int64_t n = s - k;
      Mtp& module = net_->mtp[k - 1];
      h = module->norm(module->forward(h.narrow(1, 0, n), embedded.narrow(1, k, n), where, aux_loss, runner));
      const Tensor into_head = runner.enter_split(h);
      const Tensor targets = batch.targets.narrow(1, k, n).reshape({-1});
      Tensor loss = runner.projected_loss(into_head.reshape({-1, h.size(-1)}), w, targets, chunk, computes_loss() && build_.loss_gradients_in_forward);
      total = total.defined() ? total + loss : loss;
    }
    last_mtp_loss_ = total.detach() / static_cast<double>(depth);
    return total * (spec_.mtp.loss_weight / static_cast<double>(depth));
  }

  Tensor zero_aux(const Batch& batch) const { return torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(batch.inputs.device())); }

  // The model's units. Whole (pipeline_numbering false): tied embeddings share one outer unit with
  // the final norm. Pipeline numbering: the embedding, each block, the head (norm and projection;
  // tied, the norm alone: the head reads the embedding's weight or its copy).
  static ParameterUnit make_unit(const std::string& name, const std::vector<Named>& parts, bool checkpointable, bool always) {
    Named all = joined(parts);
    return ParameterUnit{name, std::move(all.params), checkpointable, always, std::move(all.names), std::move(all.splits), -1};
  }

  // (block_of: each unit's block number, kHeadUnit for the one with the head and the MTP modules,
  // -1 for the others.) With routed experts kept apart (keep_experts), a MoE block's unit holds
  // everything but them, and so does the head's for the MTP modules' MoE blocks.
  static constexpr int kHeadUnit = -2;
  std::vector<ParameterUnit> units(bool pipeline_numbering, std::vector<int>* block_of) {
    std::vector<ParameterUnit> units;
    auto unit = [&](const std::string& name, std::vector<Named> parts, bool checkpointable, bool always = true, int block = -1) {
      units.push_back(make_unit(name, parts, checkpointable, always));
      block_of->push_back(block);
    };
    // The MTP modules run with the head, whose weight they share: they are part of its unit.
    const std::function<bool(const std::string&)> routed_expert = [](const std::string& name) { return starts_with(name, "moe.expert"); };
    const std::function<bool(const std::string&)> mtp_routed_expert = [](const std::string& name) { return starts_with(name, "block.moe.expert"); };
    std::vector<Named> mtp;
    for (size_t k = 0; k < net_->mtp.size(); ++k)
      mtp.push_back(with_experts_stacked(params_of(*net_->mtp[k], "mtp" + std::to_string(k), spec_,
                                                   net_->mtp[k]->block->moe && expert_shards_ > 1 ? mtp_routed_expert : std::function<bool(const std::string&)>())));
    auto head_parts = [&](std::vector<Named> parts) {
      parts.insert(parts.end(), mtp.begin(), mtp.end());
      return parts;
    };
    const bool shared_outer_unit = spec_.tie_embeddings && !pipeline_numbering;
    if (shared_outer_unit) unit("embedding+head", head_parts({params_of(*net_->embedding, "embedding", spec_), params_of(*net_->norm, "norm", spec_)}), false, true, kHeadUnit);
    else unit("embedding", {params_of(*net_->embedding, "embedding", spec_)}, false);
    for (int i = 0; i < blocks(); ++i) {
      const bool apart = net_->blocks[i]->moe && expert_shards_ > 1;  // (every routed expert gets a gradient, zero where no token chose it)
      unit("block " + std::to_string(i), {with_experts_stacked(params_of(*net_->blocks[i], "block" + std::to_string(i), spec_, apart ? routed_expert : std::function<bool(const std::string&)>()))}, true, true, i);
    }
    if (spec_.tie_embeddings && pipeline_numbering) unit("head", head_parts({params_of(*net_->norm, "norm", spec_)}), false, true, kHeadUnit);
    else if (!spec_.tie_embeddings) unit("head", head_parts({params_of(*net_->norm, "norm", spec_), params_of(*net_->head, "head", spec_)}), false, true, kHeadUnit);
    return units;
  }

  // Units `range` (pipeline numbering), the first of them the runner's unit `first_local`, on the
  // state before them ({} before the embedding). Blocks carry the running MoE balance loss along
  // with the activations, so that a recomputed (checkpointed) block contributes it as well; each
  // block's computation captures what it reads by value, since recomputation runs it again in backward.
  Tensors run_units(UnitRange range, int first_local, const Batch& batch, Tensors state, UnitRunner& runner) {
    const TokenPositions where(rope_, batch, build_.variable_length_attention, runner);
    Tensor embedded;  // the embedding's output, which the MTP modules read again
    for (int u = range.begin; u < range.end; ++u) {
      const int local = first_local + (u - range.begin);
      if (u == 0) {
        Tensors x = runner.run(local, [&](const Tensors& in) { return Tensors{runner.embedding(net_->embedding->weight, in[0])}; }, {batch.inputs});
        state = {x[0], zero_aux(batch)};
        embedded = x[0];
      } else if (u <= blocks()) {
        Block block = net_->blocks[u - 1];
        UnitRunner* regions = &runner;
        state = runner.run(local, [where, block, regions](const Tensors& in) mutable {
          Tensor aux = in[1];
          Tensor x = block->forward(in[0], where, aux, *regions);
          return Tensors{x, aux};
        }, state);
      } else {
        const Tensor& w = !spec_.tie_embeddings ? net_->head->weight : head_copy_.defined() ? head_copy_ : net_->embedding->weight;
        if (net_->mtp.empty()) {
          Tensors out = runner.run(local, [&](const Tensors& in) { return Tensors{head(runner.enter_split(net_->norm(in[0])), w, batch, runner)}; }, {state[0]});
          state = {out[0], state[1]};
        } else {
          // On a pipeline's last stage the embedding is the first stage's weight, copied here.
          if (!embedded.defined()) embedded = runner.embedding(head_copy_.defined() ? head_copy_ : net_->embedding->weight, batch.inputs);
          Tensors out = runner.run(local, [&](const Tensors& in) {
            Tensor aux = zero_aux(batch);
            const Tensor normed = net_->norm(in[0]);
            const Tensor mtp = mtp_loss(normed, in[1], w, batch, aux, runner);
            return Tensors{head(runner.enter_split(normed), w, batch, runner), aux + mtp};
          }, {state[0], embedded});
          state = {out[0], state[1] + out[1]};
        }
      }
    }
    return state;
  }

  ModelSpec spec_;
  uint64_t seed_;
  ModelBuild build_;  // loss chunk (> 0: the head computes the loss), the execution modes the model reads
  std::shared_ptr<DecoderModule> net_;
  Rotary rope_;
  bool deferred_;
  std::vector<UnitRange> chunks_;  // pipeline parallelism: the units kept (empty: all, whole numbering)
  int expert_shards_ = 1;          // expert parallelism: routed experts kept apart, 1/shards of them
  Tensor head_copy_;               // tied embeddings, head without the embedding: filled by the pipeline
  Tensor last_mtp_loss_;           // the MTP modules' mean cross-entropy in the latest forward, for metrics
};

}  // namespace

std::unique_ptr<Model> build_resnet(const ResNetSpec& spec);  // resnet.cpp

std::unique_ptr<Model> build_model(const ModelSpec& spec, int64_t seq_len, const ModelBuild& build) {
  if (spec.arch == ModelArch::ResNet) {
    torch::manual_seed(build.seed);
    return build_resnet(spec.resnet);
  }
  return std::make_unique<DeepSeekModel>(spec, seq_len, build);
}

}  // namespace dsrun
