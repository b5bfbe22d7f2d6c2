// AdamW, Adam and SGD with momentum on flat fp32 master shards, written out as plainly as the
// papers state them. States are sized to the shard, so ZeRO >= 1 shards them for free. Shards in
// host memory (CPU ranks, offload) take the fused host step of host_optimizer.hpp.
#pragma once

#include "engine/parallel/master_shards.hpp"
#include "engine/recipe/recipe.hpp"
#include "engine/train/host_optimizer.hpp"

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace dsrun {

// Whether this build has dsrun's own Adam kernel for masters on a GPU (adam_kernel.h): CUDA builds.
#ifdef DSRUN_WITH_FUSED_KERNELS
constexpr bool kHasDeviceAdamKernel = true;
#else
constexpr bool kHasDeviceAdamKernel = false;
#endif

class ShardOptimizer {
 public:
  // host_threads: threads of the fused host step (1 on CPU ranks, whose cores compute); host_cpus:
  // the cores its workers run on (empty: anywhere).
  ShardOptimizer(const OptimizerOptions& options, std::vector<MasterShard>& shards, int host_threads = 1, const std::vector<int>& host_cpus = {});
  void step(double lr);  // uses each shard's grad; updates master in place
  // Host masters: the same step as step(lr), returned as one task per shard to run later (on
  // the offload pipeline's worker, shard by shard, while the next forward starts). It reads each
  // shard's grad, factors and param_out as they are now; the step counter advances now.
  std::function<void(size_t)> host_update(double lr);
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
  // Masters on a GPU, Adam or AdamW: dsrun's kernel (adam_kernel.h) where the build has it, which
  // reads the gradient in its dtype and writes param_out, else libtorch's fused kernel (2.x) on fp32
  // gradients; step() falls back to the plain expressions.
  void device_adam_step(double lr);
  void fused_adam_step(double lr);
  // Shards in host memory: host_optimizer_step over chunks of at most 64K elements, split where
  // weight decay starts or ends; chunks[k] are shard k's.
  std::vector<std::vector<HostChunk>> host_chunks() const;
  void host_step(double lr);
  HostStep host_step_scalars(double lr) const;
  HostThreadPool pool_;
  std::vector<torch::Tensor> m_, v_;  // Adam: first and second moments; SGD: m_ is the momentum
  int64_t t_ = 0;
};

}  // namespace dsrun
