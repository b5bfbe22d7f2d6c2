// ZeRO-Offload's pipeline: reduced gradient shards come down on a copy stream during backward, the
// host step runs unit by unit on a worker thread, and each unit's parameters go up as soon as
// they are written (or, with the delayed update, after the next backward); stage 3's parameter
// shards in host memory come up one unit ahead of the compute.
#pragma once

#include "engine/parallel/copy_stream.hpp"
#include "engine/parallel/flat_units.hpp"
#include "engine/parallel/master_shards.hpp"
#include "engine/parallel/unit_worker.hpp"
#include "engine/parallel/zero_options.hpp"

#include <functional>
#include <memory>
#include <vector>

namespace dsrun {

class OffloadPipeline {
 public:
  OffloadPipeline(FlatUnits& units, MasterShards& masters, Communicator& data_group, const ZeroOptions& options);
  ~OffloadPipeline();  // waits for a host update under way

  // Master weights and optimizer states in host memory: the optimizer's step runs through
  // start_host_update.
  bool enabled() const { return options_.offload; }

  // Offload on a GPU, last micro-batch: the reduced shard comes down on the down stream as soon
  // as its reduction is done, its squared norm taken on the device on the way.
  bool sends_gradients_down() const { return gradients_down_in_backward_; }
  // `mine` is the reduced shard (at stage 2-3 added to the unit's accumulator first); `flat` the
  // buffer it was reduced from, kept alive until the copy is done.
  void send_gradient_down(FlatUnit& u, PendingCollective reduce, const torch::Tensor& flat, const torch::Tensor& mine);
  // Whether unit k's gradient came down in this step's backward (and forgets it).
  bool take_gradient_down(size_t k);
  // What follows backward on the compute stream (zeroing the gradients, the norm) waits for the copies.
  void compute_waits_for_gradients();
  // The host copies of the gradients are complete.
  void synchronize_gradients();

  // The optimizer step on the worker, one task per unit in forward order (update_unit(k) updates
  // shard k's master and writes its param_out); each unit's parameters go up as soon as they are
  // written, and the next forward waits for each unit alone. With the delayed update they go up
  // after the next step's backward instead (upload_delayed_update).
  void start_host_update(std::function<void(size_t)> update_unit);
  void wait_host_update();
  // The delayed update, after backward: the previous step's parameters go up, the next forward awaits them.
  void upload_delayed_update();
  // Before a unit's parameters are read: its host update is done and they are up (at stages 0-2
  // with the other ranks' slices gathered: collective over the unit's group).
  void await_update(FlatUnit& u);
  // The same for unit k outside its forward (a pipeline's tied embedding read by the last stage).
  void await_parameters(size_t k) { await_update(units_[k]); }
  // Backward reads every unit's parameters: those the forward did not run are awaited (not with
  // the delayed update, whose parameters change only between steps).
  void await_updates_for_backward();
  // The master weights were copied over the working parameters: no update is pending.
  void forget_updates();

  // Stage 3 with parameter shards in host memory: the shard of the unit next to `u` (forward:
  // the next; backward: the previous) comes up while u computes; take_prefetched hands it over.
  void prefetch_next(const FlatUnit& u, int direction);
  torch::Tensor take_prefetched(FlatUnit& u);

  // Seconds the last host update ran, and seconds compute waited for host updates since the last call.
  struct Times {
    double host_update_s = 0, waited_s = 0;
  };
  Times take_times();

 private:
  void upload_parameters(FlatUnit& u);  // param_out -> the unit's working slice, on up_stream_
  // Per unit: the events of its gradient coming down and parameters going up; whether its
  // gradient came down this step, and whether an update of it has not been awaited yet.
  struct UnitState {
    CopyEvent down, up;
    bool gradient_down = false;
    bool awaiting_update = false;
    torch::Tensor prefetched;  // stage 3, shards on the host: this unit's shard on its way to the device
    CopyEvent prefetch_done;
  };
  UnitState& state(size_t k);

  FlatUnits& units_;
  MasterShards& masters_;
  Communicator& data_group_;
  ZeroOptions options_;
  bool gradients_down_in_backward_ = false;
  bool update_launched_ = false;  // delayed update: a host update whose parameters have not gone up
  std::vector<UnitState> states_;
  std::unique_ptr<CopyStream> down_stream_, up_stream_;
  UnitWorker worker_;  // last member: destroyed first, so its tasks never outlive what they use
};

}  // namespace dsrun
