#include "engine/parallel/zero.hpp"

#include "engine/common/error.hpp"

namespace dsrun {

using torch::Tensor;

ZeroDataParallel::ZeroDataParallel(Model& model, Communicator& comm, const ZeroOptions& options)
    : comm_(comm),
      options_(options),
      units_(model, comm, options),
      masters_(units_, comm, options),
      offload_(units_, masters_, comm, options),
      sync_(units_, offload_, options) {
  DSRUN_ASSERT(options.stage >= 0 && options.stage <= 3, "ZeRO stage validated by the recipe");
  DSRUN_ASSERT(!options.gradients_left_to_autograd || (comm.world_size() == 1 && options.stage <= 2 && !options.offload && !options.expert_replicas),
               "gradients left to autograd: one rank, ZeRO 0-2, nothing offloaded");
  DSRUN_ASSERT(!options.gradients_left_to_autograd || !options.gradients_widened(), "gradients left to autograd stay in the working dtype");
  torch::NoGradGuard no_grad;
  // ZeRO-Offload: fp32 master weights and optimizer states in host memory (pinned, for fast copies,
  // when there is a GPU). On CPU ranks host and device are one memory: the same code path runs,
  // with separate host copies, and nothing crosses a bus.
  // Every layout first: the host blocks are sized by all the shards together. Then each unit is
  // built whole before the next, so that a deferred model's fp32 values exist for one unit only.
  const std::vector<ParameterUnit> model_units = model.parameter_units();
  std::vector<FlatUnitLayout> layouts;
  int64_t all_shards = 0;
  for (const auto& pu : model_units) {
    layouts.push_back(units_.lay_out(pu));
    all_shards += layouts.back().shard;
  }
  HostBuffers host(units_.device(), all_shards);
  for (size_t k = 0; k < model_units.size(); ++k) {
    const Tensor flat32 = units_.add(model_units[k], std::move(layouts[k]), host);
    masters_.add(units_[k], flat32, host);
    sync_.attach_hooks(units_[k]);
    if (options_.stage == 3) units_.release(units_[k]);
  }
  offload_buffer_bytes_ = host.buffer_bytes();
}

void ZeroDataParallel::gather(FlatUnit& u, int direction) {
  if (u.gathered) return;
  units_.gather(u, offload_.take_prefetched(u));
  offload_.prefetch_next(u, direction);
}

void ZeroDataParallel::gather_with_experts(FlatUnit& u, int direction) {
  gather(u, direction);
  for (size_t e : u.experts) gather(units_[e], direction);
}

void ZeroDataParallel::release_with_experts(FlatUnit& u) {
  units_.release(u);
  for (size_t e : u.experts) units_.release(units_[e]);
}

Tensors ZeroDataParallel::run(int index, const UnitFn& fn, const Tensors& inputs) {
  FlatUnit& u = units_[static_cast<size_t>(index)];
  const bool stage3 = options_.stage == 3;
  offload_.await_update(u);
  for (size_t e : u.experts) offload_.await_update(units_[e]);
  if (stage3) gather_with_experts(u, +1);
  Tensors out = fn(inputs);
  if (!stage3) return out;
  release_with_experts(u);
  if (torch::GradMode::is_enabled()) {
    // Backward needs the parameters again (recomputation reads them): gather when the gradient
    // of this unit's output arrives, before the unit's own backward runs.
    for (auto& o : out)
      if (o.requires_grad()) {
        o.register_hook([this, index](const Tensor& g) {
          auto fetch = [this](FlatUnit& v) {
            if (v.gathered) return;
            gather(v, -1);
            v.gathered_for_backward = true;
          };
          FlatUnit& unit = units_[static_cast<size_t>(index)];
          fetch(unit);
          for (size_t e : unit.experts) fetch(units_[e]);
          return g;
        });
        break;
      }
  }
  return out;
}

void ZeroDataParallel::reduce_gradients() {
  torch::NoGradGuard no_grad;
  sync_.finish();
  // The delayed update: the previous step's host update has run beside this step's compute; its
  // parameters go up now that backward is done with the old ones, and the next forward awaits them.
  offload_.upload_delayed_update();
  for (size_t k = 0; k < units_.size(); ++k) {
    if (options_.gradients_left_to_autograd) masters_.take_autograd_gradients(k);
    else masters_.take_reduced(k, sync_.take_reduced(k), offload_.take_gradient_down(k));
  }
}

bool ZeroDataParallel::gradients_overflowed() {
  offload_.synchronize_gradients();
  Tensor t = masters_.nonfinite_flag().reshape({1});
  comm_.all_reduce_sum(t);
  return t.item<double>() > 0;
}

std::vector<MasterShard>& ZeroDataParallel::shards() {
  offload_.wait_host_update();
  return masters_.all();
}

void ZeroDataParallel::after_step() {
  if (!options_.offload) publish_master();  // offloaded: the host update does it
  masters_.clear_gradients();
  units_.zero_gradients();
}

void ZeroDataParallel::publish_master() {
  torch::NoGradGuard no_grad;
  offload_.wait_host_update();
  offload_.forget_updates();  // replaced by what follows
  // fp32 without offload updated the working parameters in place; otherwise copy them over.
  const bool copy_master = options_.dtype != DType::Fp32 || options_.offload;
  for (size_t k = 0; k < units_.size(); ++k) {
    FlatUnit& u = units_[k];
    MasterShard& m = masters_[k];
    // The host step wrote them already (to their slice, or to the upload buffer).
    const Tensor& source = m.params_written ? m.param_out : m.master;
    const bool copy = copy_master && !(m.params_written && m.param_out.device() == units_.device());
    m.params_written = false;
    Tensor mine = u.working_slice();
    if (copy && !source.is_same(mine)) mine.copy_(source);
    // (one data rank: its shard is the whole buffer, nothing to gather; the copies cost an H100
    // 2.6 ms per step on the 1B decoder at ZeRO-2)
    if (options_.stage >= 1 && options_.stage <= 2 && u.group->world_size() > 1) u.group->all_gather(mine.clone(), u.full);
  }
}

ZeroDataParallel::StateBytes ZeroDataParallel::state_bytes() const {
  StateBytes b;
  b.parameters_and_gradients = units_.parameter_and_gradient_bytes();
  b.masters = masters_.master_bytes();
  b.offload_buffers = offload_buffer_bytes_;
  return b;
}

}  // namespace dsrun
