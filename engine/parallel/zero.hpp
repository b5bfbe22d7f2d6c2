// Data parallelism with ZeRO stages 0-3, applied to a Model from outside, as four owners:
// FlatUnits (the flat buffers), MasterShards (masters and the step's gradients), GradientSync
// (reductions overlapping backward) and OffloadPipeline (host step and copies). This class runs
// units through them and keeps the order between them.
// Stage 0 all-reduces gradients; 1 shards fp32 master weights and optimizer states; 2 also shards
// gradients (reduce-scatter every micro-batch); 3 also shards parameters, gathered per unit.
// A deferred model (parameters without values) is materialised here unit by unit: a rank holds
// one unit in fp32 at a time, then only what its stage keeps.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/flat_units.hpp"
#include "engine/parallel/gradient_sync.hpp"
#include "engine/parallel/master_shards.hpp"
#include "engine/parallel/offload_pipeline.hpp"
#include "engine/parallel/zero_options.hpp"

#include <torch/torch.h>

#include <vector>

namespace dsrun {

class ZeroDataParallel final : public UnitRunner {
 public:
  ZeroDataParallel(Model& model, Communicator& comm, const ZeroOptions& options);

  // UnitRunner: awaits the unit's offloaded update, gathers it (stage 3) and arranges the
  // re-gather for backward.
  Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) override;

  // The step, in order: begin_micro_batch(last) before each micro-batch's forward, after_backward()
  // after its backward (a pipeline's covers one chunk: only its units, local numbering), then
  // reduce_gradients() once, and after_step() once the optimizer has updated the masters.
  void begin_micro_batch(bool last) { sync_.begin_micro_batch(last); }
  void after_backward(UnitRange units = {0, -1}) { sync_.after_backward(units); }
  // Completes the reduction: masters() hold this step's averaged gradients.
  void reduce_gradients();
  // True if any gradient element on any data rank is inf or NaN (fp16 overflow).
  bool gradients_overflowed();
  // Master weights -> working parameters on every rank (offloaded: the host update did it); gradients zeroed.
  void after_step();
  // Master weights -> working parameters on every rank (after_step's first half; also after a restore).
  void publish_master();

  // The owners. shards() waits for a host update under way first: its callers read or write
  // master weights and optimizer states.
  std::vector<MasterShard>& shards();
  MasterShards& masters() { return masters_; }
  const FlatUnits& units() const { return units_; }
  OffloadPipeline& offload() { return offload_; }
  int64_t overlapped_reductions() const { return sync_.overlapped_reductions(); }

  // Bytes this rank holds for model states now, to compare with the plan (the optimizer adds its
  // states): working parameters and gradients, fp32 masters, offload's staging and upload buffers.
  struct StateBytes {
    double parameters_and_gradients = 0, masters = 0, offload_buffers = 0;
  };
  StateBytes state_bytes() const;

 private:
  void gather(FlatUnit& u, int direction);  // direction: +1 in forward, -1 in backward (which unit to prefetch)
  void gather_with_experts(FlatUnit& u, int direction);
  void release_with_experts(FlatUnit& u);

  Communicator& comm_;
  ZeroOptions options_;
  double offload_buffer_bytes_ = 0;
  // In dependency order: each owner reads those before it, and is destroyed before them.
  FlatUnits units_;
  MasterShards masters_;
  OffloadPipeline offload_;
  GradientSync sync_;
};

}  // namespace dsrun
