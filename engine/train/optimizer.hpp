// AdamW, Adam and SGD with momentum on flat fp32 master shards, written out as plainly as the
// papers state them. States are sized to the shard, so ZeRO >= 1 shards them for free.
#pragma once

#include "engine/parallel/zero.hpp"
#include "engine/recipe/recipe.hpp"

#include <torch/torch.h>

#include <vector>

namespace dsrun {

class ShardOptimizer {
 public:
  ShardOptimizer(const OptimizerOptions& options, std::vector<MasterShard>& shards);
  void step(double lr);  // uses each shard's grad; updates master in place
  double state_bytes() const;
  int64_t steps_taken() const { return t_; }

  // Per-element states, for checkpoints: names ("exp_avg", "exp_avg_sq"; SGD: "momentum_buffer"
  // or none) and shard k's tensor of each, shaped like shards()[k].master.
  std::vector<std::string> state_names() const;
  torch::Tensor& state(const std::string& name, size_t k);
  void set_steps_taken(int64_t t) { t_ = t; }

 private:
  OptimizerOptions o_;
  std::vector<MasterShard>& shards_;
  void fused_adam_step(double lr);  // libtorch's fused kernel (2.x); step() falls back to the plain expressions
  std::vector<torch::Tensor> m_, v_;  // Adam: first and second moments; SGD: m_ is the momentum
  int64_t t_ = 0;
};

}  // namespace dsrun
