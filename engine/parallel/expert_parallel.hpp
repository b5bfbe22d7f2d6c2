// Expert parallelism over the mesh's expert groups (carved out of the data dimension): each rank
// keeps one shard of a MoE layer's routed experts, and tokens travel to them and back by all-to-all.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"

#include <torch/torch.h>

#include <vector>

namespace dsrun {

// Shard r of S holds routed experts [r·E/S, (r+1)·E/S). One layer's exchange, for a micro-batch:
//   1. counts: every rank sends each shard how many rows it has for each of that shard's experts;
//   2. dispatch: the rows themselves (rows for shard r are contiguous, since they come grouped by
//      expert), received source by source;
//   3. the local experts run on the received rows regrouped expert by expert;
//   4. combine: the outputs go back the way they came (the same all-to-all, row counts swapped).
// Backward runs the two token exchanges in reverse (autograd). No row is dropped here: a capacity,
// if any, was applied by the layer before dispatch. Deterministic: every order above is fixed.
class ExpertParallel {
 public:
  explicit ExpertParallel(Communicator& shards) : group_(shards) {}
  int size() const { return group_.world_size(); }
  int rank() const { return group_.rank(); }
  // UnitRunner::routed_experts over the group.
  // The counts come to the host once (the exchange's sizes): the layer computes its shared experts
  // before, so the device has work while the host waits.
  torch::Tensor run(const torch::Tensor& rows, const torch::Tensor& counts_on_device, const ExpertsFn& local);

 private:
  Communicator& group_;
};

}  // namespace dsrun
