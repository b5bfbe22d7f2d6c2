// What a model costs, independent of how it is parallelised: parameter counts, training FLOPs
// and the activation bytes autograd keeps per sample. Formulas and sources: docs/plan.md.
#pragma once

#include "engine/recipe/recipe.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace dsrun {

// How attention keeps its activations: flash/SDPA kernels keep O(s) statistics; the math path
// (libtorch 1.13 on CPU) keeps the s x s probabilities of every head.
enum class AttentionKernel { Flash, Math };

struct ActivationTerm {
  std::string what;            // "per layer: q, k, v after rotary"
  double bytes_per_sample;     // for one sequence (or image)
};

struct ModelCost {
  double params = 0;               // Ψ: every parameter
  double active_params = 0;        // used per token (MoE: shared + top-k routed experts)
  double embedding_params = 0;     // input embedding (a lookup, not a matmul)
  int routed_experts = 0;          // per MoE layer (0: dense)
  double largest_unit_params = 0;  // biggest block ZeRO-3 gathers at once (a layer or the embedding)
  double tokens_per_sample = 1;    // seq_len for decoders, 1 for images
  double model_flops_per_sample = 0;        // forward + backward, the MFU numerator
  double attention_flops_per_sample = 0;    // of which attention's scores and weighted sums (12·L·h·s² for decoders)
  double recompute_flops_per_sample = 0;    // extra forward when activations are checkpointed
  double activation_bytes_per_sample = 0;               // without checkpointing: what forward leaves for backward
  double checkpointed_activation_bytes_per_sample = 0;  // full checkpointing: block inputs and the head
  // Live only at the start of backward, on top of the activations: the fp32 gradients of the
  // log-softmax's output and input while its backward runs. Measured on H200: docs/benchmarks.md.
  // 0 with the fused projection and loss (ModelCostOptions::loss_chunk_tokens): its transient is
  // one chunk's logits (loss_chunk_bytes_per_token × the chunk's tokens, at most a micro-batch's)
  // and the head's weight gradient (loss_weight_gradient_bytes).
  double head_backward_bytes_per_sample = 0;
  int64_t loss_chunk_tokens = 0;
  double loss_chunk_bytes_per_token = 0, loss_weight_gradient_bytes = 0;
  double loss_chunk_bytes(double micro_batch_tokens) const {
    return loss_chunk_tokens > 0 ? loss_chunk_bytes_per_token * std::min<double>(static_cast<double>(loss_chunk_tokens), micro_batch_tokens) + loss_weight_gradient_bytes : 0;
  }
  // Full checkpointing: one block's activations, recomputed during its backward (after the head's).
  double recomputed_layer_bytes_per_sample = 0;
  // Math attention kernel: one layer's gradients of its probabilities and of its scores (fp32,
  // s x s per head), live together while that layer's softmax backward runs.
  double attention_backward_bytes_per_sample = 0;
  std::vector<ActivationTerm> terms;  // how activation_bytes_per_sample adds up

  // Decoders, per unit in pipeline numbering (the embedding, each block, the head: Model's), for
  // splitting the model into pipeline stages. Their sums are the totals above. Empty for images.
  struct Unit {
    double params = 0;
    double tensor_replicated_params = 0;  // kept whole by tensor parallelism (norms, the MoE router)
    double largest_param = 0;             // elements of its largest parameter (a model build's transient)
    double flops_per_sample = 0, attention_flops_per_sample = 0;
    double activation_bytes_per_sample = 0, checkpointed_activation_bytes_per_sample = 0;
    // MoE blocks: what of the above the routed experts hold, compute and keep (expert parallelism
    // shards the parameters and sends the tokens; imbalance weighs on the activations and FLOPs).
    double routed_expert_params = 0, routed_flops_per_sample = 0, routed_activation_bytes_per_sample = 0;
    // Of the above, the linear layers precision.fp8 runs as FP8 products (attention's projections,
    // dense MLPs, shared experts): their FLOPs, parameters, and the input and output widths summed
    // over those layers (each token's operands are quantised once per side and product).
    double fp8_flops_per_sample = 0, fp8_params = 0, fp8_widths = 0;
    // Bytes per token that precision.fp8 keeps fewer for backward: the q/k/v, gate/up and down
    // projections keep their inputs as one FP8 byte instead of two (h + h + inner), the output
    // projection its own FP8 copy beside the attention output its kernel keeps anyway (h more).
    double fp8_activation_saving_per_token = 0;
  };
  std::vector<Unit> units;
};

struct ModelCostOptions {
  // RMSNorm and SwiGLU run as single kernels that keep only their inputs (CUDA builds,
  // engine/model/fused_ops); otherwise libtorch's separate ops keep their intermediates too.
  bool fused_elementwise = false;
  // The output projection and the loss fused, this many tokens' logits at a time (0: whole
  // logits), over `local_vocab` of the vocabulary per rank (tensor parallelism).
  int64_t loss_chunk_tokens = 0;
  int64_t local_vocab = 0;
};
ModelCost model_cost(const ModelSpec& model, int64_t seq_len, DType dtype, AttentionKernel kernel, const ModelCostOptions& options = {});

}  // namespace dsrun
