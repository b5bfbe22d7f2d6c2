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
  bool enabled() const { return routed_experts > 0; }
  bool learns_bias() const { return enabled() && balance == Balance::Bias; }
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
  std::string init_from;  // safetensors weights to start from (file or directory); empty: random
  MoeSpec moe;
  ResNetSpec resnet;
  int64_t head_dim() const { return hidden / heads; }
};

}  // namespace dsrun
