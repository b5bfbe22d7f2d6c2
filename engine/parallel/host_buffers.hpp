// Offload's host memory: one block per purpose (master weights, gradient staging, upload buffers,
// parameter shards), handed out shard by shard, pinned when there is a GPU.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

namespace dsrun {

// One block per purpose rather than one per shard: CUDA's pinned-memory allocator rounds every
// block up to a power of two, which per-shard blocks would pay many times.
class HostBuffers {
 public:
  // block_numel: every unit's shard together, the most one purpose holds.
  HostBuffers(torch::Device device, int64_t block_numel) : device_(device), block_numel_(block_numel) {}

  // The next slot of the purpose's block, holding a copy of t. Out of (pinnable) host memory: an
  // error naming the setting that holds it.
  torch::Tensor copy(const std::string& purpose, const torch::Tensor& t);

  // Bytes of the staging and upload buffers (the master weights and parameter shards are counted
  // as model states).
  double buffer_bytes() const;

 private:
  struct Block {
    torch::Tensor block;
    int64_t used = 0;
  };
  torch::Device device_;
  int64_t block_numel_;
  std::map<std::string, Block> blocks_;
};

}  // namespace dsrun
