// What a model is: the decoder's and the ResNet's shapes and options, as the recipe's [model]
// table gives them. Torch-free; the model layer reads this and nothing else of the recipe.
#pragma once

#include "engine/recipe/kinds.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

struct MoeSpec {
  int routed_experts = 0;  // 0: dense
  int shared_experts = 0;
  int top_k = 0;
  int64_t intermediate = 0;
  int first_dense_layers = 1;
  double aux_loss_weight = 0.001;
  // Tokens per expert above capacity_factor × the mean (over this rank's micro-batch) are dropped
  // and counted; 0: none dropped.
  double capacity_factor = 0;
  // Added to the router's scores for choosing the experts only (not for weighting them), one per
  // routed expert: DeepSeek-V3's selection bias, fixed. Empty: none.
  std::vector<double> route_bias;
  // How routing is kept even: the auxiliary loss (aux_loss_weight), or DeepSeek-V3's learned
  // selection bias, moved by bias_update_rate × sign(mean load − load) after every step.
  using Balance = MoeBalance;
  Balance balance = Balance::AuxLoss;
  double bias_update_rate = 1e-3;
  // The router (DeepSeek-V3's where it differs from DeepSeek-MoE's): affinities by softmax or
  // sigmoid; experts chosen within the `topk_group` best of `n_group` groups (a group's score: its
  // best expert under softmax, V2's; its best two summed under sigmoid, V3's); the chosen experts'
  // weights normalised to sum 1 (norm_topk_prob) and scaled by routed_scaling_factor.
  RouterScore scoring = RouterScore::Softmax;
  int n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  // DeepSeek-V3's sequence-wise balance loss (its eq. 17-20), weight alpha; 0: none.
  double seq_aux_loss_weight = 0;
  bool enabled() const { return routed_experts > 0; }
  bool learns_bias() const { return enabled() && balance == Balance::Bias; }
};

// Multi-head latent attention (DeepSeek-V2/V3), Hugging Face's DeepseekV3Config names: queries
// through an optional low-rank latent (q_lora_rank, 0: a full projection), keys and values from one
// kv_lora_rank latent, each head's key = [its qk_nope_head_dim part ; one shared rotary key].
struct MlaSpec {
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// Multi-token prediction (DeepSeek-V3 section 2.2): `depth` modules after the last block, module k
// predicting the token k + 1 places further than the main head, sharing its embedding and head;
// their mean cross-entropy times loss_weight is added to the loss.
struct MtpSpec {
  int depth = 0;
  double loss_weight = 0.3;
  bool enabled() const { return depth > 0; }
};

// YaRN (Peng et al. 2023; DeepSeek-V2 appendix) as Hugging Face's rope_scaling table gives it.
struct RopeScaling {
  RopeScalingKind kind = RopeScalingKind::None;
  double factor = 1;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 1, mscale_all_dim = 0;
};

struct ResNetSpec {
  int depth = 50;
  int classes = 10;
  int image_size = 32;
  int channels = 3;
  int width = 64;
};

struct ModelSpec {
  std::string name;
  ModelArch arch = ModelArch::DeepSeek;
  int64_t hidden = 128;
  int layers = 4;
  int heads = 4;
  int kv_heads = 4;
  int64_t intermediate = 344;
  int64_t vocab = 256;
  int64_t max_seq_len = 4096;
  bool tie_embeddings = false;
  double rope_theta = 10000;
  double norm_eps = 1e-6;
  double init_std = 0.02;
  AttentionKind attention = AttentionKind::Mha;
  MlaSpec mla;
  MtpSpec mtp;
  RopeScaling rope_scaling;
  std::string init_from;  // safetensors weights to start from (file or directory); empty: random
  MoeSpec moe;
  ResNetSpec resnet;
  int64_t head_dim() const { return hidden / heads; }
  // MoE layers in model order: the blocks after the first dense ones, then the MTP modules' blocks
  // (whose layer numbers follow the last block's).
  int moe_layers() const { return moe.enabled() ? layers - moe.first_dense_layers + mtp.depth : 0; }
  bool latent_attention() const { return attention == AttentionKind::Mla; }
  // Widths of one head's query/key and value (MLA: nope + rope and v_head_dim; else head_dim).
  int64_t qk_head_dim() const { return latent_attention() ? mla.qk_head_dim() : head_dim(); }
  int64_t v_head_dim() const { return latent_attention() ? mla.v_head_dim : head_dim(); }
  // The dimensions rotary embeddings turn: MLA's shared rotary key, else the whole head.
  int64_t rope_dim() const { return latent_attention() ? mla.qk_rope_head_dim : head_dim(); }
};

}  // namespace dsrun
