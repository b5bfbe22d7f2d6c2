#include "engine/parallel/flat_units.hpp"

#include "engine/common/error.hpp"

namespace dsrun {

using torch::Tensor;

namespace {

// Where the unit's replicated parameters fall within this rank's shard.
std::vector<std::pair<int64_t, int64_t>> replicated_ranges(const ParameterUnit& pu, const FlatUnitLayout& l) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < pu.params.size(); ++i) {
    if (i < pu.splits.size() && pu.splits[i].kind != TensorSplit::Replicated) continue;
    const int64_t begin = std::max(l.offsets[i], l.shard_begin), end = std::min(l.offsets[i] + l.numels[i], l.shard_begin + l.shard);
    if (begin < end) ranges.push_back({begin - l.shard_begin, end - l.shard_begin});
  }
  return ranges;
}

}  // namespace

Tensor FlatUnit::working_slice() const { return param_shard.defined() ? param_shard : full.narrow(0, layout.shard_begin, layout.shard); }

FlatUnits::FlatUnits(Model& model, Communicator& data_group, const ZeroOptions& options) : model_(model), data_group_(data_group), options_(options) {
  std::vector<ParameterUnit> units = model.parameter_units();
  device_ = model.deferred() || units.empty() || units[0].params.empty() ? options.device : units[0].params[0].device();
}

FlatUnitLayout FlatUnits::lay_out(const ParameterUnit& pu) const {
  DSRUN_ASSERT(pu.experts_of < 0 || options_.expert_replicas != nullptr, "routed experts kept apart need their replicas' group");
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : pu.params) shapes.push_back(p.sizes().vec());
  Communicator& group = pu.experts_of >= 0 ? *options_.expert_replicas : data_group_;
  return lay_out_flat_unit(shapes, group.world_size(), group.rank(), options_.stage >= 1);
}

Tensor FlatUnits::add(const ParameterUnit& pu, FlatUnitLayout layout, HostBuffers& host) {
  auto u = std::make_unique<FlatUnit>();
  u->index = units_.size();
  u->name = pu.name;
  u->routed_experts = pu.experts_of >= 0;
  u->group = u->routed_experts ? options_.expert_replicas : &data_group_;
  u->always_gets_gradients = pu.always_gets_gradients;
  u->params = pu.params;
  u->layout = std::move(layout);
  if (options_.separate_replicated_norm) u->replicated_ranges = replicated_ranges(pu, u->layout);
  Tensor flat32 = materialise_values(pu, u->layout);
  create_working_parameters(*u, flat32, host);
  bind_parameters(*u);
  // Routed experts are listed after every unit that reads them.
  if (pu.experts_of >= 0) units_.at(static_cast<size_t>(pu.experts_of))->experts.push_back(u->index);
  units_.push_back(std::move(u));
  return flat32;
}

Tensor FlatUnits::materialise_values(const ParameterUnit& pu, const FlatUnitLayout& l) const {
  Tensor flat32 = torch::zeros({l.padded}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
  for (size_t i = 0; i < pu.params.size(); ++i) {
    Tensor values = pu.params[i].detach();
    if (model_.deferred()) {  // this parameter's initial values, built now and dropped after the copy
      values = torch::empty(l.shapes[i], torch::TensorOptions().dtype(torch::kFloat32));
      if (options_.initial_values) options_.initial_values(pu.names.at(i), values);
      else model_.initialize_parameter(pu.names.at(i), values);
    }
    flat32.narrow(0, l.offsets[i], l.numels[i]).copy_(values.flatten());
  }
  return flat32;
}

void FlatUnits::create_working_parameters(FlatUnit& u, const Tensor& flat32, HostBuffers& host) const {
  const FlatUnitLayout& l = u.layout;
  const auto compute = torch_dtype(options_.dtype);
  const bool mixed = compute != torch::kFloat32;
  if (options_.stage <= 2) {
    u.full = mixed ? flat32.to(compute) : flat32;
    return;
  }
  Tensor region32 = flat32.narrow(0, l.shard_begin, l.shard);
  u.param_shard = mixed ? region32.to(compute) : region32.clone();
  if (options_.offload_params) u.param_shard = host.copy("parameter shards", u.param_shard);  // gathered through the device
}

void FlatUnits::bind_parameters(FlatUnit& u) const {
  const FlatUnitLayout& l = u.layout;
  const auto compute = torch_dtype(options_.dtype);
  if (!options_.gradients_left_to_autograd)
    u.grad_acc = torch::zeros({options_.stage <= 1 ? l.padded : l.shard}, torch::TensorOptions().dtype(torch_dtype(options_.gradient_dtype())).device(device_));
  if (options_.stage <= 2) {
    u.gathered = true;
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(u.full.narrow(0, l.offsets[i], l.numels[i]).view(l.shapes[i]));
  } else {
    // The gradient accumulators (GradientSync::attach_hooks) record the parameters' shape and
    // dtype: give them the gathered ones before the first release.
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(torch::empty(l.shapes[i], torch::TensorOptions().dtype(compute).device(device_)));
  }
  // Stage 0-1: autograd accumulates straight into grad_acc (gradients as views of it, as DDP's
  // gradient_as_bucket_view), so nothing is copied between micro-batches. A wider accumulator
  // cannot be a gradient's storage: GradientSync adds each micro-batch's gradients into it.
  if (options_.stage <= 1 && !options_.gradients_left_to_autograd && !options_.gradients_widened())
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].mutable_grad() = u.grad_acc.narrow(0, l.offsets[i], l.numels[i]).view(l.shapes[i]);
}

void FlatUnits::gather(FlatUnit& u, const Tensor& shard) {
  if (u.gathered) return;
  torch::NoGradGuard no_grad;
  u.full = torch::empty({u.layout.padded}, u.param_shard.options().device(device_).pinned_memory(false));
  const Tensor& mine = shard.defined() ? shard : u.param_shard.device() == device_ ? u.param_shard : u.param_shard.to(device_, /*non_blocking=*/true);
  u.group->all_gather(mine, u.full);
  for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(u.full.narrow(0, u.layout.offsets[i], u.layout.numels[i]).view(u.layout.shapes[i]));
  u.gathered = true;
}

void FlatUnits::release(FlatUnit& u) {
  torch::NoGradGuard no_grad;
  // Tensors autograd saved keep their own reference; the gathered buffer goes when they do.
  for (auto& p : u.params)
    p.set_data(torch::empty({0}, (u.param_shard.defined() ? u.param_shard.options() : p.options()).device(device_).pinned_memory(false)));
  u.full = Tensor();
  u.gathered = false;
  u.gathered_for_backward = false;
}

void FlatUnits::zero_gradients() {
  for (auto& u : units_) {
    if (!options_.gradients_left_to_autograd) u->grad_acc.zero_();
    else
      for (auto& p : u->params) p.mutable_grad() = Tensor();  // dropped: the next backward's are taken over
  }
}

double FlatUnits::parameter_and_gradient_bytes() const {
  double bytes = 0;
  for (const auto& u : units_) {
    const Tensor& params = options_.stage == 3 ? u->param_shard : u->full;
    // (gradients left to autograd: what it holds once backward is done, the unit's size)
    const double grads = options_.gradients_left_to_autograd ? static_cast<double>(u->layout.padded * params.element_size())
                                                            : static_cast<double>(u->grad_acc.numel() * u->grad_acc.element_size());
    bytes += static_cast<double>(params.numel() * params.element_size()) + grads;
  }
  return bytes;
}

}  // namespace dsrun
