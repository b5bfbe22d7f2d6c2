// Expert parallelism over the mesh's expert groups (carved out of the data dimension): each rank
// keeps one shard of a MoE layer's routed experts, and tokens travel to them and back by all-to-all.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"

#include <torch/torch.h>

#include <vector>

namespace dsrun {

// How the rows travel (the plan's execution modes, pinned for the ranks).
struct ExpertExchange {
  // The layer's meanwhile work runs while the rows travel (ExecutionModes::shared_experts_beside_dispatch);
  // otherwise first, while the host waits for the counts.
  bool beside_dispatch = true;
  // Each token goes once to each shard its choices are on, and the shard makes the choices' rows
  // (ExecutionModes::tokens_once_per_rank); otherwise every pair's row travels.
  bool tokens_once_per_rank = true;
};

// Shard r of S holds routed experts [r·E/S, (r+1)·E/S). One layer's exchange, for a micro-batch:
//   1. counts: every rank sends each shard how many pairs it has for each of that shard's experts,
//      and (tokens once per rank) how many distinct tokens they read (an all-to-all where the
//      counts are; the host reads what it sends and receives in one copy);
//   2. dispatch: the pairs' rows (rows for shard r are contiguous, since pairs come grouped by
//      expert), or each shard's distinct tokens and, per pair, which of them it reads, received
//      source by source; the layer's `meanwhile` work runs while they travel (or before step 1:
//      then the device has it to do while the host waits for the counts);
//   3. the local experts run on the received pairs' rows regrouped expert by expert;
//   4. combine: each pair's output goes back the way it came (row counts swapped).
// Backward runs the exchanges in reverse (autograd): a token's rows' gradients are summed on the
// shard before they travel. No pair is dropped here: a capacity, if any, was applied by the layer
// before dispatch. Deterministic: every order above is fixed, and every sum gathers (no atomics).
class ExpertParallel {
 public:
  ExpertParallel(Communicator& shards, ExpertExchange exchange) : group_(shards), exchange_(exchange) {}
  int size() const { return group_.world_size(); }
  int rank() const { return group_.rank(); }
  // UnitRunner::routed_experts over the group. The host waits once, for the counts (the
  // exchange's sizes); everything after is queued without waiting for the device.
  torch::Tensor run(const RoutedPairs& pairs, const torch::Tensor& counts_on_device, const ExpertsFn& local, const std::function<void()>& meanwhile);
  // Rows this rank's dispatches have sent to the other shards (pairs' rows, or tokens), forward only.
  int64_t rows_sent() const { return rows_sent_; }

 private:
  Communicator& group_;
  ExpertExchange exchange_;
  int64_t rows_sent_ = 0;
};

}  // namespace dsrun
