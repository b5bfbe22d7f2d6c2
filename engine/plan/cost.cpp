#include "engine/plan/cost.hpp"

#include <algorithm>
#include <array>

namespace dsrun {

namespace {

// One block's attention as the cost model sees it.
struct AttentionShape {
  double params = 0;             // its matrices
  double norm_params = 0;        // MLA's latent norms
  double replicated_params = 0;  // matrices tensor parallelism keeps whole (MLA's down-projections)
  double score_width = 0;        // heads × (qk + v head widths) / 2: the scores' and weighted sum's FLOPs scale with it
  double kept_per_token = 0;     // elements autograd keeps for q, k, v (and MLA's latents and output) per token
  double largest_param = 0;
  double fp8_widths = 0;         // input + output widths summed over its FP8 linear layers
};

// Multi-head or grouped-query attention (q, o: h x h; k, v: h x kv), or MLA (DeepSeek-V2): wq_a
// [ql, h] and wq_b [H·dqk, ql] (or wq [H·dqk, h]), wkv_a [kvl + rope, h], wkv_b [H·(nope + dv), kvl],
// wo [h, H·dv]. What MLA keeps per token, from its forward (engine/model/deepseek.cpp): the query
// latent and its norm's output (2 ql), wkv_a's output (kvl + rope) and the latent's norm output
// (kvl), wkv_b's output (its values are a view of it), the concatenated q and k (2 H·dqk), and the
// output that wo reads (H·dv); the flash kernel also keeps the values padded to the key width and
// its output at that width (2 H·dqk) where dv < dqk, its output alone (H·dqk) otherwise; the math
// kernel the scaled q and its output (H·dqk + H·dv). Unfused norms keep x·rsqrt too.
AttentionShape attention_shape(const ModelSpec& m, AttentionKernel kernel, bool fused) {
  AttentionShape a;
  const double h = static_cast<double>(m.hidden);
  if (!m.latent_attention()) {
    const double kv = static_cast<double>(m.kv_heads) * static_cast<double>(m.head_dim());
    a.params = 2 * h * h + 2 * h * kv;
    a.score_width = h;
    a.kept_per_token = (kernel == AttentionKernel::Flash ? h + 2 * kv : kv == h ? 6 * h : 3 * h) + h;  // (+ the output o reads)
    a.largest_param = h * (h + 2 * kv);
    a.fp8_widths = (h + h + 2 * kv) + (h + h);  // q|k|v, o
    return a;
  }
  const MlaSpec& l = m.mla;
  const double H = m.heads, ql = static_cast<double>(l.q_lora_rank), kvl = static_cast<double>(l.kv_lora_rank), rope = static_cast<double>(l.qk_rope_head_dim);
  const double dqk = static_cast<double>(l.qk_head_dim()), nope = static_cast<double>(l.qk_nope_head_dim), dv = static_cast<double>(l.v_head_dim);
  const double q = ql > 0 ? h * ql + ql * H * dqk : h * H * dqk, kv_down = h * (kvl + rope), kv_up = kvl * H * (nope + dv), o = H * dv * h;
  a.params = q + kv_down + kv_up + o;
  a.norm_params = ql + kvl;
  a.replicated_params = (ql > 0 ? h * ql : 0) + kv_down;
  a.score_width = H * (dqk + dv) / 2;
  const double latents = (ql > 0 ? 2 * ql : 0) + (kvl + rope) + kvl + (fused ? 0 : ql + kvl);
  const double common = latents + H * (nope + dv) + 2 * H * dqk + H * dv;
  a.kept_per_token = common + (kernel == AttentionKernel::Flash ? (dv < dqk ? 2 : 1) * H * dqk : H * dqk + H * dv);
  a.largest_param = std::max({ql > 0 ? ql * H * dqk : h * H * dqk, kv_up, o});
  a.fp8_widths = (ql > 0 ? (h + ql) + (ql + H * dqk) : h + H * dqk) + (h + kvl + rope) + (kvl + H * (nope + dv)) + (H * dv + h);
  return a;
}

// DeepSeek/Llama decoder. e = bytes per element of the compute dtype, s = sequence length.
ModelCost decoder_cost(const ModelSpec& m, double s, double e, AttentionKernel kernel, const ModelCostOptions& options) {
  const bool fused = options.fused_elementwise;
  const bool fused_loss = options.loss_chunk_tokens > 0;
  ModelCost c;
  const double h = static_cast<double>(m.hidden);
  const double V = static_cast<double>(m.vocab);
  const double f = static_cast<double>(m.intermediate);
  const double fe = static_cast<double>(m.moe.intermediate);
  const double E = m.moe.routed_experts, S = m.moe.shared_experts, k = m.moe.top_k;
  const int moe_layers = m.moe.enabled() ? m.layers - m.moe.first_dense_layers : 0;
  const int dense_layers = m.layers - moe_layers;

  // Attention (attention_shape): its matrices' parameters, its own norms (MLA's latents), the
  // width the score FLOPs scale with, the q/k/v activations kept per token and the FP8 widths.
  const AttentionShape at = attention_shape(m, kernel, fused);
  const double attention = at.params;
  const double norms = 2 * h + at.norm_params;
  const double dense_mlp = 3 * h * f;
  const double expert = 3 * h * fe;
  const double moe_mlp = h * E + (E + S) * expert;            // router + every expert
  const double moe_active = h * E + (k + S) * expert;         // router + experts a token visits
  c.embedding_params = V * h;
  c.routed_experts = m.moe.routed_experts;
  const double head = m.tie_embeddings ? 0 : V * h;
  // Multi-token prediction: per depth one block (a MoE block in a MoE model), eh_proj (2h x h) and
  // three norms; it shares the embedding and the head.
  const int D = m.mtp.depth;
  const double mtp_block = attention + norms + (m.moe.enabled() ? moe_mlp : dense_mlp), mtp_block_active = attention + norms + (m.moe.enabled() ? moe_active : dense_mlp);
  const double mtp_params = D * (mtp_block + 2 * h * h + 3 * h), mtp_active = D * (mtp_block_active + 2 * h * h + 3 * h);
  c.params = c.embedding_params + head + h + m.layers * (attention + norms) + dense_layers * dense_mlp + moe_layers * moe_mlp + mtp_params;
  c.active_params = c.embedding_params + head + h + m.layers * (attention + norms) + dense_layers * dense_mlp + moe_layers * moe_active + mtp_active;
  c.largest_unit_params = std::max({c.embedding_params, attention + norms + (dense_layers > 0 ? dense_mlp : 0),
                                    attention + norms + (moe_layers > 0 ? moe_mlp : 0)});
  c.tokens_per_sample = s;

  // FLOPs (PaLM, appendix B): 6 per matmul parameter per token, plus 12·L·w·s for attention
  // scores and their weighted sum (w = heads × (qk + v head widths) / 2: h for multi-head
  // attention). The embedding lookup is not a matmul; a tied head still is one, and each MTP
  // depth runs the head again (on s - k tokens: counted as s).
  const double w = at.score_width;
  const double matmul_params = c.active_params - c.embedding_params + (m.tie_embeddings ? V * h : 0) + D * V * h;
  c.model_flops_per_sample = s * (6 * matmul_params + 12.0 * (m.layers + D) * w * s);
  c.attention_flops_per_sample = s * 12.0 * (m.layers + D) * w * s;
  // Full checkpointing recomputes every block's forward (not the head, nor the MTP modules run with
  // it): 2 FLOPs per block parameter.
  const double block_params = c.active_params - c.embedding_params - head - h - mtp_active;
  c.recompute_flops_per_sample = s * (2 * block_params + 4.0 * m.layers * w * s);

  // Activations autograd keeps, elements per token (see docs/plan.md for the derivation):
  //   RMSNorm inputs 2h, q/k/v projection input h, MLP input h (4h); attention's own
  //   (attention_shape: q k v after rotary h + 2kv, the math kernel's k, v repeated to h each, the
  //   output h; MLA's latents and heads); SwiGLU: gate|up and the product 3f fused; libtorch's silu
  //   and mul also keep silu(gate): 4f.
  //   Unfused (CPU, and wherever the fused kernels do not run) the reference RMSNorm also keeps
  //   x·rsqrt (h per norm). The math kernel with as many KV heads as query heads keeps, besides
  //   the scaled q and the k and v it multiplies, the fused projection's output (v is a view of it)
  //   and the rotated q|k (k is a view of it): 6h where q, k, v alone are 3h; grouped-query
  //   attention repeats k and v into new tensors, so only those stay. Measured on CPU ranks:
  //   docs/benchmarks.md (CPU peak memory against the plan).
  const double norm_extra = fused ? 0 : 2 * h;
  const double qkv = at.kept_per_token;
  const double attention_probs = kernel == AttentionKernel::Math ? m.heads * s : 0;  // per token
  const double swiglu = fused ? 3 : 4;  // per inner element
  const double per_token_dense = 4 * h + norm_extra + qkv + attention_probs + swiglu * f;
  // MoE layer: router probabilities (fp32), the token copy sent to each chosen expert and its
  // output (kept for the weighting by the router's scores), the routed experts' gate|up products
  // (2fe per choice: the grouped experts recompute their SwiGLU in backward), and the shared
  // experts' SwiGLU activations.
  const double routed_per_token = 2 * k * h + 2 * k * fe;
  const double per_token_moe = 4 * h + norm_extra + qkv + attention_probs + (4.0 / e) * E + routed_per_token + S * swiglu * fe;
  const double per_token_layers = dense_layers * per_token_dense + moe_layers * per_token_moe;
  // Outside the blocks: final norm input and output, and the fp32 log-softmax the cross-entropy
  // keeps. The logits themselves (compute dtype, then fp32) are freed once converted: forward's
  // transient e·V + 4·V stays below backward's 8·V. Fused with the loss, the head keeps the
  // hidden states' gradient (computed in forward, h per token) instead of any logits.
  const double head_bytes_per_token = e * (fused ? 2 : 3) * h + (fused_loss ? e * h : 4 * V);
  // Each MTP depth: its block's activations, the two norms' inputs and the concatenation (4h),
  // and a head's (its loss is always projected chunk by chunk: the hidden states' gradient).
  const double mtp_block_per_token = m.moe.enabled() ? per_token_moe : per_token_dense;
  const double mtp_bytes_per_token = D * (e * (mtp_block_per_token + 4 * h) + e * (fused ? 2 : 3) * h + e * h);

  c.terms.push_back({"blocks (" + std::to_string(m.layers) + " layers)", e * s * per_token_layers});
  if (D > 0) c.terms.push_back({"multi-token prediction (" + std::to_string(D) + " modules)", s * mtp_bytes_per_token});
  if (kernel == AttentionKernel::Math) c.terms.push_back({"  of which attention probabilities (math kernel)", e * s * m.layers * attention_probs});
  c.terms.push_back({fused_loss ? "final norm, the loss's gradient to the hidden states" : "final norm, logits, fp32 log-softmax", s * head_bytes_per_token});
  c.activation_bytes_per_sample = e * s * per_token_layers + s * (head_bytes_per_token + mtp_bytes_per_token);
  if (fused_loss) {
    // One chunk's fp32 logits and their gradient in the compute dtype, and the projection's weight
    // gradient: summed in fp32, then kept in the compute dtype until backward.
    const double local_vocab = static_cast<double>(options.local_vocab > 0 ? options.local_vocab : m.vocab);
    c.loss_chunk_tokens = options.loss_chunk_tokens;
    c.loss_chunk_bytes_per_token = (4 + e) * local_vocab;
    c.loss_weight_gradient_bytes = (4 + e) * local_vocab * h;
  } else {
    c.head_backward_bytes_per_sample = s * (4 + 4) * V;
  }
  if (kernel == AttentionKernel::Math) c.attention_backward_bytes_per_sample = (4.0 + 4.0) * m.heads * s * s;

  // Full checkpointing keeps each block's input (h per token) and, during backward, one block's
  // recomputed activations at a time — after the head's backward has freed its own.
  const double largest_layer = std::max(dense_layers > 0 ? per_token_dense : 0.0, moe_layers > 0 ? per_token_moe : 0.0);
  c.checkpointed_activation_bytes_per_sample = e * s * m.layers * h + s * (head_bytes_per_token + mtp_bytes_per_token);
  c.recomputed_layer_bytes_per_sample = e * s * largest_layer;

  ModelCost::Unit embedding;  // a lookup
  embedding.params = embedding.largest_param = V * h;
  c.units.push_back(embedding);
  // A block's largest weight: the fused q|k|v projection, the fused gate|up of its MLP (dense, or
  // the shared experts' together) or one expert's, or the router.
  const double largest_dense = std::max(at.largest_param, 2 * h * f);
  const double largest_moe = std::max({at.largest_param, 2 * h * fe * std::max(1.0, S), h * E});
  for (int i = 0; i < m.layers; ++i) {
    const bool moe = i >= dense_layers;  // MoE layers follow the first dense ones
    ModelCost::Unit u;
    u.params = attention + norms + (moe ? moe_mlp : dense_mlp);
    u.tensor_replicated_params = norms + at.replicated_params + (moe ? h * E : 0);
    u.largest_param = moe ? largest_moe : largest_dense;
    u.flops_per_sample = s * (6 * (attention + (moe ? moe_active : dense_mlp)) + 12.0 * w * s);
    u.attention_flops_per_sample = s * 12.0 * w * s;
    const double fp8_inner = moe ? S * fe : f;  // the dense MLP's or the shared experts' width
    u.fp8_params = attention + (moe ? S * expert : dense_mlp);
    u.fp8_flops_per_sample = s * 6 * u.fp8_params;
    u.fp8_widths = at.fp8_widths + (fp8_inner > 0 ? (h + 2 * fp8_inner) + (fp8_inner + h) : 0);  // attention's, gate|up, down
    u.fp8_activation_saving_per_token = (e - 1) * (h + (fp8_inner > 0 ? h + fp8_inner : 0)) - h;
    u.activation_bytes_per_sample = e * s * (moe ? per_token_moe : per_token_dense);
    u.checkpointed_activation_bytes_per_sample = e * s * h;
    if (moe) {
      u.routed_expert_params = E * expert;
      u.routed_flops_per_sample = s * 6 * k * expert;
      u.routed_activation_bytes_per_sample = e * s * routed_per_token;
    }
    c.units.push_back(u);
  }
  ModelCost::Unit head_unit;  // the final norm, the head and the MTP modules that run with it
  head_unit.params = h + head + mtp_params;
  head_unit.largest_param = std::max({h, head, D > 0 ? (m.moe.enabled() ? largest_moe : largest_dense) : 0.0, D > 0 ? 2 * h * h : 0.0});
  head_unit.tensor_replicated_params = h + D * (norms + at.replicated_params + (m.moe.enabled() ? h * E : 0) + 2 * h * h + 3 * h);
  head_unit.flops_per_sample = s * 6 * V * h + D * s * (6 * (mtp_block_active - norms + 2 * h * h + V * h) + 12.0 * w * s);
  head_unit.attention_flops_per_sample = D * s * 12.0 * w * s;
  head_unit.activation_bytes_per_sample = head_unit.checkpointed_activation_bytes_per_sample = s * (head_bytes_per_token + mtp_bytes_per_token);
  if (D > 0 && m.moe.enabled()) {
    head_unit.routed_expert_params = D * E * expert;
    head_unit.routed_flops_per_sample = D * s * 6 * k * expert;
    head_unit.routed_activation_bytes_per_sample = D * e * s * routed_per_token;
  }
  c.units.push_back(head_unit);
  return c;
}

// ResNet walked layer by layer, the CIFAR variant (3x3 stem, no max-pool) for images up to 64 px.
ModelCost resnet_cost(const ResNetSpec& r, double e) {
  ModelCost c;
  const bool bottleneck = r.depth >= 50;
  std::array<int, 4> blocks{2, 2, 2, 2};
  if (r.depth == 34 || r.depth == 50) blocks = {3, 4, 6, 3};
  if (r.depth == 101) blocks = {3, 4, 23, 3};
  if (r.depth == 152) blocks = {3, 8, 36, 3};
  const int expansion = bottleneck ? 4 : 1;

  double params = 0, flops = 0, activations = 0;  // activations in elements per image
  double block_inputs = 0, largest_block = 0, largest_unit = 0;
  int size = r.image_size;
  // conv + BN (+ in-place ReLU): keeps the BN input and the BN output, both of the conv's output size.
  auto conv = [&](int cin, int cout, int kernel, int stride) {
    size = (size + stride - 1) / stride;
    double out_elems = static_cast<double>(cout) * size * size;
    double p = static_cast<double>(cin) * cout * kernel * kernel + 2.0 * cout;
    params += p;
    flops += 2.0 * cin * cout * kernel * kernel * size * size;
    activations += 2 * out_elems;
    return p;
  };
  const bool small = r.image_size <= 64;
  activations += static_cast<double>(r.channels) * size * size;  // the input image, kept by the stem conv
  conv(r.channels, r.width, small ? 3 : 7, small ? 1 : 2);
  if (!small) size = (size + 1) / 2;  // max-pool
  const double stem = activations;     // outside any block: kept even with checkpointing
  int cin = r.width;
  for (int stage = 0; stage < 4; ++stage) {
    int width = r.width << stage;
    for (int b = 0; b < blocks[stage]; ++b) {
      int stride = (stage > 0 && b == 0) ? 2 : 1;
      double before = activations, p = 0;
      int in_size = size;
      block_inputs += static_cast<double>(cin) * in_size * in_size;
      if (bottleneck) {
        p += conv(cin, width, 1, 1);
        p += conv(width, width, 3, stride);
        p += conv(width, width * expansion, 1, 1);
      } else {
        p += conv(cin, width, 3, stride);
        p += conv(width, width, 3, 1);
      }
      if (stride != 1 || cin != width * expansion) {  // projection shortcut
        int keep = size;
        size = in_size;
        p += conv(cin, width * expansion, 1, stride);
        size = keep;
      }
      cin = width * expansion;
      largest_block = std::max(largest_block, activations - before);
      largest_unit = std::max(largest_unit, p);
    }
  }
  params += static_cast<double>(cin) * r.classes + r.classes;  // fully connected head
  flops += 2.0 * cin * r.classes;
  activations += cin;  // pooled features kept by the head

  c.params = c.active_params = params;
  c.largest_unit_params = largest_unit;
  c.tokens_per_sample = 1;
  c.model_flops_per_sample = 3 * flops;  // backward ≈ 2 × forward
  c.recompute_flops_per_sample = flops;
  c.activation_bytes_per_sample = e * activations;
  c.checkpointed_activation_bytes_per_sample = e * (stem + block_inputs + cin);
  c.recomputed_layer_bytes_per_sample = e * largest_block;
  c.terms.push_back({"conv/BN/ReLU outputs of every layer", e * activations});
  return c;
}

}  // namespace

ModelCost model_cost(const ModelSpec& model, int64_t seq_len, DType dtype, AttentionKernel kernel, const ModelCostOptions& options) {
  const double e = bytes_per_element(dtype);
  if (model.arch == ModelArch::ResNet) return resnet_cost(model.resnet, e);
  return decoder_cost(model, static_cast<double>(seq_len), e, kernel, options);
}

}  // namespace dsrun
