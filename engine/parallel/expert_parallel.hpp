// Expert parallelism over the mesh's expert groups (carved out of the data dimension): each rank
// keeps one shard of a MoE layer's routed experts, and tokens travel to them and back by all-to-all.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"

#include <torch/torch.h>

#include <vector>

namespace dsrun {

// Shard r of S holds routed experts [r·E/S, (r+1)·E/S). One layer's exchange, for a micro-batch:
//   1. counts: every rank sends each shard how many rows it has for each of that shard's experts
//      (an all-to-all where the counts are; the host reads sent and received counts in one copy);
//   2. dispatch: the rows themselves (rows for shard r are contiguous, since they come grouped by
//      expert), received source by source; the layer's `meanwhile` work runs while they travel
//      (or before step 1: then the device has it to do while the host waits for the counts);
//   3. the local experts run on the received rows regrouped expert by expert;
//   4. combine: the outputs go back the way they came (the same all-to-all, row counts swapped).
// Backward runs the two token exchanges in reverse (autograd). No row is dropped here: a capacity,
// if any, was applied by the layer before dispatch. Deterministic: every order above is fixed.
class ExpertParallel {
 public:
  // beside_dispatch: the layer's meanwhile work runs while the rows travel
  // (ExecutionModes::shared_experts_beside_dispatch); otherwise first, while the host waits for the counts.
  ExpertParallel(Communicator& shards, bool beside_dispatch) : group_(shards), beside_dispatch_(beside_dispatch) {}
  int size() const { return group_.world_size(); }
  int rank() const { return group_.rank(); }
  // UnitRunner::routed_experts over the group. The host waits once, for the counts (the
  // exchange's sizes); everything after is queued without waiting for the device.
  torch::Tensor run(const torch::Tensor& rows, const torch::Tensor& counts_on_device, const ExpertsFn& local, const std::function<void()>& meanwhile);

 private:
  Communicator& group_;
  bool beside_dispatch_;
};

}  // namespace dsrun
