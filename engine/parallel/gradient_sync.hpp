// ZeRO's gradient synchronisation: hooks on each parameter's gradient accumulator start a unit's
// reduction as soon as backward has finished it (all-reduce at stages 0-1 once per step,
// reduce-scatter at 2-3 every micro-batch), with at most two buckets of gradient in flight.
#pragma once

#include "engine/model/model.hpp"
#include "engine/parallel/flat_units.hpp"
#include "engine/parallel/offload_pipeline.hpp"
#include "engine/parallel/zero_options.hpp"

#include <torch/torch.h>

#include <deque>
#include <memory>
#include <vector>

namespace dsrun {

class GradientSync {
 public:
  GradientSync(FlatUnits& units, OffloadPipeline& offload, const ZeroOptions& options) : units_(units), offload_(offload), options_(options) {}
  ~GradientSync();  // the model may outlive this object, and with it the hooks: they find it gone

  // Each of unit u's parameters reports to this object when its gradient for a backward is complete.
  void attach_hooks(const FlatUnit& u);

  // Before each micro-batch's forward: whether its backward is the last before the step's
  // reduction (stages 0-1 reduce once per step, after the last micro-batch; 2-3 after every one).
  void begin_micro_batch(bool last) { last_micro_batch_ = last; }
  // After a backward over `units` (local numbering): starts the reductions the hooks did not (units
  // some of whose parameters got no gradient, such as MoE blocks) and, at stages 2-3, waits for them.
  void after_backward(UnitRange units);
  // After the last micro-batch: every reduction is complete; take_reduced(k) hands over unit k's
  // reduced gradient (summed over its group, not yet averaged).
  void finish();
  torch::Tensor take_reduced(size_t k);
  // Reductions started from the hooks, during backward (since construction).
  int64_t overlapped_reductions() const { return overlapped_reductions_; }

 private:
  void on_gradient_ready(size_t unit);  // an AccumulateGrad of one of the unit's parameters finished
  void start_reduction(FlatUnit& u, bool during_backward);
  void add_into_accumulator(FlatUnit& u);
  void track_reduction(PendingCollective reduction, double bytes);
  void flush_bucket(bool during_backward);
  void wait_pending();

  FlatUnits& units_;
  OffloadPipeline& offload_;
  ZeroOptions options_;
  struct UnitState {
    size_t grads_ready = 0;          // parameters whose gradient is complete in this backward
    bool reduction_started = false;  // in this micro-batch
    torch::Tensor reduced;           // stage 1: this rank's reduced shard, once the last micro-batch's reduction is done
  };
  std::vector<UnitState> states_;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;  // own the gradient-ready hooks
  std::shared_ptr<GradientSync*> alive_ = std::make_shared<GradientSync*>(this);  // null once destroyed
  std::vector<PendingCollective> pending_;  // stage 0 all-reduces started and not yet waited for
  // Stage 0: units ready and not yet reduced, to go as one all-reduce once they fill
  // parallel.bucket_bytes (DDP's buckets). A ResNet's 18 units each paid a collective's latency
  // (NCCL's low-latency protocol through host memory: about 1 ms each on 3 GPUs without peer
  // access); joined, they pay it once a bucket.
  std::vector<FlatUnit*> bucket_;
  double bucket_fill_ = 0;
  // Each reduction in flight with the bytes of gradient it copies, oldest first (stage 0's joined
  // buckets, stage 1-3's reductions); at most two buckets' worth (parallel.bucket_bytes), as the
  // plan counts (track_reduction).
  struct Reduction {
    PendingCollective done;
    double bytes = 0;
  };
  std::deque<Reduction> reductions_;
  double reduction_bytes_ = 0;
  bool last_micro_batch_ = true;
  int64_t overlapped_reductions_ = 0;
};

}  // namespace dsrun
