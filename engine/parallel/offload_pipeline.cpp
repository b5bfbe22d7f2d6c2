#include "engine/parallel/offload_pipeline.hpp"

#include "engine/common/error.hpp"

#include <iostream>

namespace dsrun {

using torch::Tensor;

OffloadPipeline::OffloadPipeline(FlatUnits& units, MasterShards& masters, Communicator& data_group, const ZeroOptions& options)
    : units_(units), masters_(masters), data_group_(data_group), options_(options) {
  DSRUN_ASSERT(!options.delayed_update || options.offload, "the delayed update is validated by the recipe");
  gradients_down_in_backward_ = options.offload && units.device().is_cuda();
  down_stream_ = std::make_unique<CopyStream>(units.device());
  up_stream_ = std::make_unique<CopyStream>(units.device());
}

OffloadPipeline::~OffloadPipeline() {
  try {
    worker_.wait_all();
  } catch (const std::exception& e) {  // reached only while another error unwinds (the trainer waits at its end)
    std::cerr << "host update failed while the run was ending: " << e.what() << std::endl;
  }
}

OffloadPipeline::UnitState& OffloadPipeline::state(size_t k) {
  if (states_.size() < units_.size()) states_.resize(units_.size());
  return states_.at(k);
}

void OffloadPipeline::send_gradient_down(FlatUnit& u, PendingCollective reduce, const Tensor& flat, const Tensor& mine) {
  MasterShard& m = masters_[u.index];
  const double inv_world = 1.0 / data_group_.world_size();
  // After what the compute stream queued (the flat gradient), and after the reduction itself.
  down_stream_->follow_current();
  down_stream_->run([&] {
    reduce.wait();
    Tensor reduced = mine;
    if (options_.stage >= 2) reduced = u.grad_acc.add_(mine);  // earlier micro-batches' sum
    m.grad_sq = squared_norm(reduced, inv_world);
    m.grad_staging.copy_(reduced, /*non_blocking=*/true);
  });
  down_stream_->keep_alive(flat);
  down_stream_->keep_alive(mine);
  UnitState& s = state(u.index);
  s.down = down_stream_->record();
  s.gradient_down = true;
}

bool OffloadPipeline::take_gradient_down(size_t k) { return std::exchange(state(k).gradient_down, false); }

void OffloadPipeline::compute_waits_for_gradients() {
  if (gradients_down_in_backward_) down_stream_->record().block_current();
}

void OffloadPipeline::synchronize_gradients() {
  for (size_t k = 0; k < units_.size(); ++k) state(k).down.synchronize();
}

void OffloadPipeline::upload_parameters(FlatUnit& u) {
  MasterShard& m = masters_[u.index];
  UnitState& s = state(u.index);
  Tensor slot = u.working_slice();
  if (!m.param_out.defined() || m.param_out.data_ptr() == slot.data_ptr()) {  // written in place
    s.up = CopyEvent();
    return;
  }
  if (options_.offload_params) {
    // The delayed update with the parameter shard in host memory: the buffer the host step wrote
    // becomes the shard, and the old shard the next update's buffer, once the device has stopped
    // reading it (the caller's up_stream_ follows the compute queued so far; the event marks it).
    std::swap(u.param_shard, m.param_out);
    s.up = up_stream_->record();
    return;
  }
  up_stream_->run([&] {
    torch::NoGradGuard no_grad;
    slot.copy_(m.param_out, /*non_blocking=*/true);
  });
  s.up = up_stream_->record();
}

void OffloadPipeline::await_update(FlatUnit& u) {
  UnitState& s = state(u.index);
  if (!s.awaiting_update) return;
  // The delayed update's parameters went up at the last step's end; the worker is on the next update.
  if (!options_.delayed_update) worker_.wait(u.index);
  s.up.block_current();
  s.awaiting_update = false;
  if (options_.stage <= 2 && u.group->world_size() > 1) {  // the other ranks' slices (they publish theirs in the same order)
    torch::NoGradGuard no_grad;
    u.group->all_gather(u.working_slice().clone(), u.full);
  }
}

void OffloadPipeline::await_updates_for_backward() {
  if (options_.delayed_update) return;
  for (size_t k = 0; k < units_.size(); ++k) await_update(units_[k]);
}

void OffloadPipeline::forget_updates() {
  for (size_t k = 0; k < units_.size(); ++k) state(k).awaiting_update = false;
  update_launched_ = false;
}

void OffloadPipeline::start_host_update(std::function<void(size_t)> update_unit) {
  DSRUN_ASSERT(options_.offload, "a host update needs offloaded master weights");
  worker_.wait_all();
  const bool delayed = options_.delayed_update;
  if (!delayed) {  // (the delayed update uploads, and flags units to await, in upload_delayed_update)
    // Uploads go after everything queued so far: the compute that last read the parameters.
    up_stream_->follow_current();
    for (size_t k = 0; k < units_.size(); ++k) state(k).awaiting_update = true;
  }
  update_launched_ = delayed;
  if (states_.size() < units_.size()) states_.resize(units_.size());  // (the worker reads states_ while this thread may call state())
  worker_.start(units_.size(), [this, update_unit = std::move(update_unit), delayed](size_t k) {
    torch::NoGradGuard no_grad;
    UnitState& s = states_[k];
    s.down.synchronize();            // the gradient shard is in host memory
    if (delayed) s.up.synchronize();  // the previous parameters have left the upload buffer
    update_unit(k);
    if (!delayed) upload_parameters(units_[k]);
  });
  // The delayed update's next backward fills the other staging buffer.
  if (delayed)
    for (auto& m : masters_.all()) std::swap(m.grad_staging, m.grad_staging_spare);
}

void OffloadPipeline::wait_host_update() { worker_.wait_all(); }

void OffloadPipeline::upload_delayed_update() {
  if (!update_launched_) return;
  worker_.wait_all();
  up_stream_->follow_current();
  for (size_t k = 0; k < units_.size(); ++k) {
    upload_parameters(units_[k]);
    state(k).awaiting_update = true;
  }
  update_launched_ = false;
}

void OffloadPipeline::prefetch_next(const FlatUnit& u, int direction) {
  const int64_t next_index = static_cast<int64_t>(u.index) + direction;
  if (!options_.offload_params || !units_.device().is_cuda() || next_index < 0 || next_index >= static_cast<int64_t>(units_.size())) return;
  FlatUnit& next = units_[static_cast<size_t>(next_index)];
  UnitState& s = state(next.index);
  if (next.gathered || s.prefetched.defined()) return;
  if (s.awaiting_update) {
    if (!options_.delayed_update && !worker_.finished(next.index)) return;  // not written yet: no waiting here
    await_update(next);
  }
  Tensor buffer = torch::empty({next.layout.shard}, next.param_shard.options().device(units_.device()).pinned_memory(false));
  up_stream_->follow_current();  // the buffer's memory was last used by the compute stream
  up_stream_->run([&] { buffer.copy_(next.param_shard, /*non_blocking=*/true); });
  up_stream_->keep_alive(buffer);
  s.prefetch_done = up_stream_->record();
  s.prefetched = buffer;
}

Tensor OffloadPipeline::take_prefetched(FlatUnit& u) {
  UnitState& s = state(u.index);
  if (!s.prefetched.defined()) return Tensor();
  s.prefetch_done.block_current();
  return std::move(s.prefetched);
}

OffloadPipeline::Times OffloadPipeline::take_times() {
  Times t;
  t.host_update_s = worker_.last_run_seconds();
  t.waited_s = worker_.take_wait_seconds();
  return t;
}

}  // namespace dsrun
