#include "engine/parallel/zero.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/model/fused_ops.hpp"
#include "engine/parallel/recompute.hpp"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <iostream>
#include <map>

namespace dsrun {

using torch::Tensor;
using torch::autograd::variable_list;

namespace {

// A gradient in fp32 with its factors applied, with the same roundings as the fused host step:
// (g · grad_scale) · clip_scale, each in fp32.
Tensor scaled_fp32(const Tensor& grad, double grad_scale, double clip_scale) {
  Tensor g = grad.to(torch::kFloat32);
  if (grad_scale != 1) g = g * grad_scale;
  if (clip_scale != 1) g = g * clip_scale;
  return g;
}

// Σ (g · scale)² as an fp64 scalar where g is. On CPUs with exactly the roundings of
// MasterShard::scaled_grad (offloaded runs follow the others bitwise); on GPUs the norm kernel
// reads the working dtype, so no fp32 copy of the shard is made.
Tensor squared_norm(const Tensor& g, double scale) {
  if (g.is_cuda())
    return at::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kFloat32).to(torch::kFloat64).pow(2).mul(scale * scale);
  return scaled_fp32(g, scale, 1).pow(2).sum().to(torch::kFloat64);
}

// Runs after a parameter's AccumulateGrad node: its gradient for this backward is complete.
struct GradientReadyHook : torch::autograd::FunctionPostHook {
  explicit GradientReadyHook(std::function<void()> fn) : fn(std::move(fn)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    fn();
    return outputs;
  }
  std::function<void()> fn;
};

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

struct ZeroDataParallel::Unit {
  size_t index = 0;
  std::string name;
  Communicator* group = nullptr;  // the ranks its shards are spread over (ZeroDataParallel::unit_group)
  bool routed_experts = false;    // ParameterUnit::experts_of: kept apart from the unit that reads them
  std::vector<size_t> experts;    // the routed-expert units this unit's computation reads
  bool checkpointable = false;
  std::vector<Tensor> params;
  FlatUnitLayout layout;
  std::vector<std::pair<int64_t, int64_t>> replicated_ranges;  // [begin, end) within the shard: TensorSplit::Replicated parameters
  Tensor full;         // working parameters, compute dtype, [padded]; stage 3: only while gathered
  Tensor param_shard;  // stage 3: this rank's slice of the working parameters
  Tensor grad_acc;     // stage 0-1: [padded], the parameters' .grad are views of it; stage 2-3: [shard]; compute dtype
  Tensor reduced;      // stage 1: this rank's reduced shard of grad_acc, once the last micro-batch's reduction is done
  Tensor prefetched;   // stage 3, parameter shards on the host: this unit's shard already on its way to the device
  CopyEvent prefetch_done;
  bool gathered = false;
  bool gathered_for_backward = false;
  bool always_gets_gradients = true;  // may start its reduction from the gradient-ready hooks
  size_t grads_ready = 0;             // parameters whose gradient is complete in this backward
  bool reduction_started = false;     // in this micro-batch
  // Offload: the events of this unit's gradient coming down and parameters going up, and whether
  // a host update of this unit is under way or its parameters have not been awaited yet.
  CopyEvent down, up;
  bool gradient_down = false;
  bool awaiting_update = false;
};

// Host buffers come from one block per purpose, sliced shard by shard: CUDA's pinned-memory
// allocator rounds every block up to a power of two, which per-shard blocks would pay many times.
class ZeroDataParallel::HostBuffers {
 public:
  // block_numel: every unit's shard together, the most one purpose holds.
  HostBuffers(torch::Device device, int64_t block_numel) : device_(device), block_numel_(block_numel) {}

  // The next slot of the purpose's block, holding a copy of t.
  Tensor copy(const std::string& purpose, const Tensor& t) {
    Block& b = blocks_[purpose];
    if (!b.block.defined()) {
      try {
        b.block = device_.is_cuda() ? pinned_host_tensor(block_numel_, t.scalar_type()) : torch::empty({block_numel_}, t.options().device(torch::kCPU));
      } catch (const std::exception& e) {  // out of (pinnable) host memory: say which setting holds it
        ErrorContext c;
        c.key = "parallel.offload";
        c.hint = "the plan's host table counts what offload holds; check hardware.host_memory_gib against this machine, or offload less";
        throw Error("cannot allocate " + std::to_string(block_numel_ * t.element_size()) + " bytes of " + (device_.is_cuda() ? "pinned " : "") +
                        "host memory for the offloaded " + purpose + ": " + std::string(e.what()).substr(0, 200),
                    c);
      }
    }
    Tensor slot = b.block.narrow(0, b.used, t.numel());
    b.used += t.numel();
    return slot.copy_(t.flatten());
  }

  // Bytes of the staging and upload buffers: the master weights and parameter shards are counted
  // as model states.
  double buffer_bytes() const {
    double bytes = 0;
    for (const auto& [purpose, b] : blocks_)
      if (purpose != "master weights" && purpose != "parameter shards") bytes += static_cast<double>(b.block.numel() * b.block.element_size());
    return bytes;
  }

 private:
  struct Block {
    Tensor block;
    int64_t used = 0;
  };
  torch::Device device_;
  int64_t block_numel_;
  std::map<std::string, Block> blocks_;
};

ZeroDataParallel::ZeroDataParallel(Model& model, Communicator& comm, const ZeroOptions& options)
    : model_(model), comm_(comm), options_(options) {
  DSRUN_ASSERT(options.stage >= 0 && options.stage <= 3, "ZeRO stage validated by the recipe");
  DSRUN_ASSERT(!options.gradients_left_to_autograd || (comm.world_size() == 1 && options.stage <= 2 && !options.offload && !options.expert_replicas),
               "gradients left to autograd: one rank, ZeRO 0-2, nothing offloaded");
  torch::NoGradGuard no_grad;
  std::vector<ParameterUnit> model_units = model.parameter_units();
  const bool deferred = model.deferred();
  device_ = deferred || model_units.empty() || model_units[0].params.empty() ? options.device : model_units[0].params[0].device();
  // ZeRO-Offload: fp32 master weights and optimizer states in host memory (pinned, for fast copies,
  // when there is a GPU). On CPU ranks host and device are one memory: the same code path runs,
  // with separate host copies, and nothing crosses a bus.
  offload_to_host_ = options.offload;
  DSRUN_ASSERT(!options.delayed_update || options.offload, "the delayed update is validated by the recipe");
  gradients_down_in_backward_ = offload_to_host_ && device_.is_cuda();
  down_stream_ = std::make_unique<CopyStream>(device_);
  up_stream_ = std::make_unique<CopyStream>(device_);

  // Every layout first: the host blocks are sized by all the shards together.
  std::vector<FlatUnitLayout> layouts;
  int64_t all_shards = 0;
  for (const auto& pu : model_units) {
    DSRUN_ASSERT(pu.experts_of < 0 || options.expert_replicas != nullptr, "routed experts kept apart need their replicas' group");
    layouts.push_back(lay_out(pu));
    all_shards += layouts.back().shard;
  }
  HostBuffers host(device_, all_shards);
  for (size_t k = 0; k < model_units.size(); ++k) add_unit(model_units[k], std::move(layouts[k]), host);
  for (size_t k = 0; k < model_units.size(); ++k)
    if (model_units[k].experts_of >= 0) units_.at(static_cast<size_t>(model_units[k].experts_of))->experts.push_back(k);
  offload_buffer_bytes_ = host.buffer_bytes();
}

FlatUnitLayout ZeroDataParallel::lay_out(const ParameterUnit& pu) const {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : pu.params) shapes.push_back(p.sizes().vec());
  Communicator& group = pu.experts_of >= 0 ? *options_.expert_replicas : comm_;
  return lay_out_flat_unit(shapes, group.world_size(), group.rank(), options_.stage >= 1);
}

// One unit at a time, so that a deferred model's fp32 values exist for one unit only.
void ZeroDataParallel::add_unit(const ParameterUnit& pu, FlatUnitLayout layout, HostBuffers& host) {
  auto u = std::make_unique<Unit>();
  u->index = units_.size();
  u->name = pu.name;
  u->routed_experts = pu.experts_of >= 0;
  u->group = u->routed_experts ? options_.expert_replicas : &comm_;
  u->checkpointable = pu.checkpointable;
  u->always_gets_gradients = pu.always_gets_gradients;
  u->params = pu.params;
  u->layout = std::move(layout);
  if (options_.separate_replicated_norm) u->replicated_ranges = replicated_ranges(pu, u->layout);
  Tensor flat32 = materialise_values(pu, u->layout);
  create_working_parameters(*u, flat32, host);
  shards_.push_back(create_master_shard(*u, flat32, host));
  bind_parameters(*u);
  attach_gradient_ready_hooks(*u);
  if (options_.stage == 3) release(*u);
  units_.push_back(std::move(u));
}

Tensor ZeroDataParallel::materialise_values(const ParameterUnit& pu, const FlatUnitLayout& l) const {
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

void ZeroDataParallel::create_working_parameters(Unit& u, const Tensor& flat32, HostBuffers& host) {
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

MasterShard ZeroDataParallel::create_master_shard(Unit& u, const Tensor& flat32, HostBuffers& host) {
  const FlatUnitLayout& l = u.layout;
  const auto compute = torch_dtype(options_.dtype);
  const bool mixed = compute != torch::kFloat32;
  Tensor region32 = flat32.narrow(0, l.shard_begin, l.shard);
  MasterShard m;
  if (mixed) m.master = region32.clone();
  else m.master = options_.stage <= 2 ? u.full.narrow(0, l.shard_begin, l.shard) : u.param_shard;  // fp32: updated in place
  if (offload_to_host_) m.master = host.copy("master weights", region32);
  // The host step writes the working parameters itself: into their slice where it is in host
  // memory too, else into a pinned buffer that goes up in one copy (also on the host with the
  // delayed update, whose parameters change only between steps). The gradient shard comes
  // down into a buffer of its own, which the host step reads while the next step computes.
  if (m.master.device().is_cpu() && (mixed || offload_to_host_)) {
    Tensor slot = options_.stage == 3 ? u.param_shard : u.full.narrow(0, l.shard_begin, l.shard);
    m.param_out = slot.device().is_cpu() && !options_.delayed_update ? slot : host.copy("upload buffers", torch::empty({l.shard}, slot.options().device(torch::kCPU)));
  } else if (mixed && options_.step_reads_working_gradient && !m.master.device().is_cpu()) {
    m.param_out = options_.stage == 3 ? u.param_shard : u.full.narrow(0, l.shard_begin, l.shard);  // the device step writes them
  }
  if (offload_to_host_) {
    auto staging = [&](const std::string& purpose) { return host.copy(purpose, torch::zeros({l.shard}, torch::TensorOptions().dtype(compute))); };
    m.grad_staging = staging("gradient staging");
    if (options_.delayed_update) m.grad_staging_spare = staging("gradient staging (delayed update)");
  }
  m.decay_ranges = l.decay_ranges;
  return m;
}

void ZeroDataParallel::bind_parameters(Unit& u) {
  const FlatUnitLayout& l = u.layout;
  const auto compute = torch_dtype(options_.dtype);
  if (!options_.gradients_left_to_autograd)
    u.grad_acc = torch::zeros({options_.stage <= 1 ? l.padded : l.shard}, torch::TensorOptions().dtype(compute).device(device_));
  if (options_.stage <= 2) {
    u.gathered = true;
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(u.full.narrow(0, l.offsets[i], l.numels[i]).view(l.shapes[i]));
  } else {
    // The gradient accumulators (attach_gradient_ready_hooks) record the parameters' shape and
    // dtype: give them the gathered ones before the first release.
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(torch::empty(l.shapes[i], torch::TensorOptions().dtype(compute).device(device_)));
  }
  // Stage 0-1: autograd accumulates straight into grad_acc (gradients as views of it, as DDP's
  // gradient_as_bucket_view), so nothing is copied between micro-batches.
  if (options_.stage <= 1 && !options_.gradients_left_to_autograd)
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].mutable_grad() = u.grad_acc.narrow(0, l.offsets[i], l.numels[i]).view(l.shapes[i]);
}

void ZeroDataParallel::attach_gradient_ready_hooks(Unit& u) {
  const size_t index = u.index;
  for (auto& p : u.params) {
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(p);
    DSRUN_ASSERT(accumulator != nullptr, "model parameters require gradients");
    accumulator->add_post_hook(std::make_unique<GradientReadyHook>([alive = alive_, index] {
      if (*alive) (*alive)->on_gradient_ready(index);
    }));
    grad_accumulators_.push_back(std::move(accumulator));
  }
}

// The model may outlive this object, and with it the accumulators' hooks: they check alive_.
ZeroDataParallel::~ZeroDataParallel() {
  *alive_ = nullptr;
  try {
    worker_.wait_all();
  } catch (const std::exception& e) {  // reached only while another error unwinds (the trainer waits at its end)
    std::cerr << "host update failed while the run was ending: " << e.what() << std::endl;
  }
}

void ZeroDataParallel::gather(Unit& u, int direction) {
  if (u.gathered) return;
  torch::NoGradGuard no_grad;
  u.full = torch::empty({u.layout.padded}, u.param_shard.options().device(device_).pinned_memory(false));
  Tensor shard;
  if (u.prefetched.defined()) {
    u.prefetch_done.block_current();
    shard = std::move(u.prefetched);
  } else {
    shard = u.param_shard.device() == device_ ? u.param_shard : u.param_shard.to(device_, /*non_blocking=*/true);
  }
  u.group->all_gather(shard, u.full);
  for (size_t i = 0; i < u.params.size(); ++i) u.params[i].set_data(u.full.narrow(0, u.layout.offsets[i], u.layout.numels[i]).view(u.layout.shapes[i]));
  u.gathered = true;
  // Parameter shards in host memory: the next unit's comes up on up_stream_ while this one computes
  // (forward: the next unit; backward: the previous), once its host update is done.
  const int64_t next_index = static_cast<int64_t>(u.index) + direction;
  if (!options_.offload_params || !device_.is_cuda() || next_index < 0 || next_index >= static_cast<int64_t>(units_.size())) return;
  Unit& next = *units_[static_cast<size_t>(next_index)];
  if (next.gathered || next.prefetched.defined()) return;
  if (next.awaiting_update) {
    if (!options_.delayed_update && !worker_.finished(next.index)) return;  // not written yet: no waiting here
    await_update(next);
  }
  Tensor buffer = torch::empty({next.layout.shard}, next.param_shard.options().device(device_).pinned_memory(false));
  up_stream_->follow_current();  // the buffer's memory was last used by the compute stream
  up_stream_->run([&] { buffer.copy_(next.param_shard, /*non_blocking=*/true); });
  up_stream_->keep_alive(buffer);
  next.prefetch_done = up_stream_->record();
  next.prefetched = buffer;
}

void ZeroDataParallel::release(Unit& u) {
  torch::NoGradGuard no_grad;
  // Tensors autograd saved keep their own reference; the gathered buffer goes when they do.
  for (auto& p : u.params)
    p.set_data(torch::empty({0}, (u.param_shard.defined() ? u.param_shard.options() : p.options()).device(device_).pinned_memory(false)));
  u.full = Tensor();
  u.gathered = false;
  u.gathered_for_backward = false;
}

void ZeroDataParallel::gather_with_experts(Unit& u, int direction) {
  gather(u, direction);
  for (size_t e : u.experts) gather(*units_[e], direction);
}

void ZeroDataParallel::release_with_experts(Unit& u) {
  release(u);
  for (size_t e : u.experts) release(*units_[e]);
}

Tensors ZeroDataParallel::run(int index, const UnitFn& fn, const Tensors& inputs) {
  Unit& u = *units_.at(index);
  const bool stage3 = options_.stage == 3;
  const bool grad = torch::GradMode::is_enabled();
  await_update(u);
  for (size_t e : u.experts) await_update(*units_[e]);
  if (stage3) gather_with_experts(u, +1);
  forward_stack_.push_back(index);
  Tensors out;
  if (options_.activation_checkpointing && u.checkpointable && grad) {
    auto kept = std::make_shared<UnitFn>(fn);
    live_fns_.push_back(kept);
    out = run_recomputed(kept, inputs);
  } else {
    out = fn(inputs);
  }
  forward_stack_.pop_back();
  if (!stage3) return out;
  release_with_experts(u);
  if (grad) {
    // Backward needs the parameters again (recomputation reads them): gather when the gradient
    // of this unit's output arrives, before the unit's own backward runs.
    for (auto& o : out)
      if (o.requires_grad()) {
        o.register_hook([this, index](const Tensor& g) {
          auto fetch = [this](Unit& v) {
            if (v.gathered) return;
            gather(v, -1);
            v.gathered_for_backward = true;
          };
          Unit& unit = *units_[index];
          fetch(unit);
          for (size_t e : unit.experts) fetch(*units_[e]);
          return g;
        });
        break;
      }
  }
  return out;
}

void ZeroDataParallel::begin_micro_batch(bool last) { last_micro_batch_ = last; }

void ZeroDataParallel::on_gradient_ready(size_t index) {
  Unit& u = *units_[index];
  // Backward reads every unit's parameters: a unit the forward did not run is awaited here.
  if (!options_.delayed_update) await_all_updates();
  if (++u.grads_ready == u.params.size() && u.always_gets_gradients) start_reduction(u, /*during_backward=*/true);
}

// Runs on autograd's thread (from the hooks) or the trainer's (after_backward), always in the
// same order on every rank: the backward graph is the same on all of them.
void ZeroDataParallel::start_reduction(Unit& u, bool during_backward) {
  if (u.reduction_started || options_.gradients_left_to_autograd) return;  // (one rank: nothing to reduce)
  u.reduction_started = true;
  torch::NoGradGuard no_grad;
  if (options_.stage <= 1 && !last_micro_batch_) return;  // keep accumulating in grad_acc; reduced once per step
  if (during_backward) ++overlapped_reductions_;
  if (options_.stage <= 1) {
    if (options_.stage == 0) {
      const int64_t bucket = std::max<int64_t>(1, static_cast<int64_t>(options_.bucket_bytes / u.grad_acc.element_size()));
      for (int64_t begin = 0; begin < u.layout.padded; begin += bucket) {
        Tensor slice = u.grad_acc.narrow(0, begin, std::min(bucket, u.layout.padded - begin));
        pending_.push_back(u.group->all_reduce_sum_async(slice));
      }
    } else {
      u.reduced = torch::empty({u.layout.shard}, u.grad_acc.options());
      PendingCollective reduce = u.group->reduce_scatter_sum_async(u.grad_acc, u.reduced);
      if (gradients_down_in_backward_) send_gradient_down(u, std::move(reduce), Tensor(), u.reduced);
      else track_reduction(std::move(reduce), static_cast<double>(u.grad_acc.numel()) * static_cast<double>(u.grad_acc.element_size()));
    }
    return;
  }
  // Stage 2-3: this micro-batch's full gradient goes to one flat buffer and is reduce-scattered;
  // the parameters' own gradients (and at stage 3 their gathered values) are freed now.
  Tensor flat = torch::empty({u.layout.padded}, u.grad_acc.options());
  if (u.layout.padded > u.layout.numel) flat.narrow(0, u.layout.numel, u.layout.padded - u.layout.numel).zero_();
  for (size_t i = 0; i < u.params.size(); ++i) {
    Tensor& g = u.params[i].mutable_grad();
    Tensor slot = flat.narrow(0, u.layout.offsets[i], u.layout.numels[i]);
    if (g.defined()) slot.copy_(g.flatten());
    else slot.zero_();  // an MoE expert no token chose: zero gradient
    g = Tensor();
  }
  if (u.gathered_for_backward) release(u);
  Tensor mine = torch::empty({u.layout.shard}, flat.options());
  PendingCollective reduce = u.group->reduce_scatter_sum_async(flat, mine);
  if (gradients_down_in_backward_ && last_micro_batch_) {
    send_gradient_down(u, std::move(reduce), flat, mine);
    return;
  }
  Tensor acc = u.grad_acc;
  track_reduction(PendingCollective([reduce, acc, mine]() mutable {
                    reduce.wait();
                    acc.add_(mine);
                  }),
                  static_cast<double>(flat.numel()) * static_cast<double>(flat.element_size()));
}

// At most two buckets of gradient in flight (DeepSpeed's reduce_bucket_size with overlap_comm).
// Unbounded, every unit's gradient copy (stage 2's flat buffer; on Gloo, which has no
// reduce-scatter, the copy it all-reduces) lived until the end of backward: the whole model's
// gradient once or twice over, which the plan never counted (CPU ranks measured 25% above it).
// The oldest reductions finish first; one unit larger than the budget goes alone.
void ZeroDataParallel::track_reduction(PendingCollective reduction, double bytes) {
  while (!reductions_.empty() && reduction_bytes_ + bytes > 2 * options_.bucket_bytes) {
    reductions_.front().done.wait();
    reduction_bytes_ -= reductions_.front().bytes;
    reductions_.pop_front();
  }
  reductions_.push_back({std::move(reduction), bytes});
  reduction_bytes_ += bytes;
}

void ZeroDataParallel::send_gradient_down(Unit& u, PendingCollective reduce, const Tensor& flat, const Tensor& mine) {
  MasterShard& m = shards_[u.index];
  const double inv_world = 1.0 / comm_.world_size();
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
  u.down = down_stream_->record();
  u.gradient_down = true;
}

void ZeroDataParallel::upload_parameters(Unit& u) {
  MasterShard& m = shards_[u.index];
  Tensor slot = options_.stage == 3 ? u.param_shard : u.full.narrow(0, u.layout.shard_begin, u.layout.shard);
  if (!m.param_out.defined() || m.param_out.data_ptr() == slot.data_ptr()) {  // written in place
    u.up = CopyEvent();
    return;
  }
  if (options_.offload_params) {
    // The delayed update with the parameter shard in host memory: the buffer the host step wrote
    // becomes the shard, and the old shard the next update's buffer, once the device has stopped
    // reading it (the caller's up_stream_ follows the compute queued so far; the event marks it).
    std::swap(u.param_shard, m.param_out);
    u.up = up_stream_->record();
    return;
  }
  up_stream_->run([&] {
    torch::NoGradGuard no_grad;
    slot.copy_(m.param_out, /*non_blocking=*/true);
  });
  u.up = up_stream_->record();
}

void ZeroDataParallel::await_update(Unit& u) {
  if (!u.awaiting_update) return;
  // The delayed update's parameters went up at the last step's end; the worker is on the next update.
  if (!options_.delayed_update) worker_.wait(u.index);
  u.up.block_current();
  u.awaiting_update = false;
  if (options_.stage <= 2 && u.group->world_size() > 1) {  // the other ranks' slices (they publish theirs in the same order)
    torch::NoGradGuard no_grad;
    u.group->all_gather(u.full.narrow(0, u.layout.shard_begin, u.layout.shard).clone(), u.full);
  }
}

void ZeroDataParallel::await_all_updates() {
  for (auto& u : units_) await_update(*u);
}

void ZeroDataParallel::start_host_update(std::function<void(size_t)> update_unit) {
  DSRUN_ASSERT(offload_to_host_, "a host update needs offloaded master weights");
  worker_.wait_all();
  const bool delayed = options_.delayed_update;
  if (!delayed) {  // (the delayed update uploads, and flags units to await, in reduce_gradients)
    // Uploads go after everything queued so far: the compute that last read the parameters.
    up_stream_->follow_current();
    for (auto& u : units_) u->awaiting_update = true;
  }
  update_launched_ = delayed;
  worker_.start(units_.size(), [this, update_unit = std::move(update_unit), delayed](size_t k) {
    torch::NoGradGuard no_grad;
    Unit& u = *units_[k];
    u.down.synchronize();            // the gradient shard is in host memory
    if (delayed) u.up.synchronize();  // the previous parameters have left the upload buffer
    update_unit(k);
    if (!delayed) upload_parameters(u);
  });
  // The delayed update's next backward fills the other staging buffer.
  if (delayed)
    for (auto& m : shards_) std::swap(m.grad_staging, m.grad_staging_spare);
}

void ZeroDataParallel::wait_host_update() { worker_.wait_all(); }

ZeroDataParallel::OffloadTimes ZeroDataParallel::take_offload_times() {
  OffloadTimes t;
  t.host_update_s = worker_.last_run_seconds();
  t.waited_s = worker_.take_wait_seconds();
  return t;
}

void ZeroDataParallel::wait_pending() {
  for (auto& p : pending_) p.wait();
  pending_.clear();
  for (auto& r : reductions_) r.done.wait();
  reductions_.clear();
  reduction_bytes_ = 0;
}

void ZeroDataParallel::after_backward(UnitRange range) {
  if (range.end < 0) range.end = static_cast<int>(units_.size());
  // The range's units and the routed experts they read (listed after every other unit).
  std::vector<Unit*> done;
  for (int k = range.begin; k < range.end; ++k)
    if (!units_[k]->routed_experts) done.push_back(units_[k].get());
  for (int k = range.begin; k < range.end; ++k)
    for (size_t e : units_[k]->experts) done.push_back(units_[e].get());
  for (Unit* u : done) start_reduction(*u, /*during_backward=*/false);  // units the hooks did not start, in unit order
  if (options_.stage >= 2) wait_pending();
  // The gradients that came down were read on down_stream_: what follows (zeroing them, the
  // norm) waits for it.
  if (gradients_down_in_backward_ && last_micro_batch_) down_stream_->record().block_current();
  for (Unit* u : done) {
    u->grads_ready = 0;
    u->reduction_started = false;
  }
}

void ZeroDataParallel::reduce_gradients() {
  torch::NoGradGuard no_grad;
  wait_pending();
  // The delayed update: the previous step's host update has run beside this step's compute; its
  // parameters go up now that backward is done with the old ones, and the next forward awaits them.
  if (update_launched_) {
    worker_.wait_all();
    up_stream_->follow_current();
    for (auto& u : units_) {
      upload_parameters(*u);
      u->awaiting_update = true;
    }
    update_launched_ = false;
  }
  const double inv_world = 1.0 / comm_.world_size();
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = *units_[k];
    MasterShard& m = shards_[k];
    if (options_.gradients_left_to_autograd) {
      take_autograd_gradients(u, m);
      continue;
    }
    Tensor reduced = options_.stage == 1 ? u.reduced : u.grad_acc;
    if (m.master.device().is_cpu()) {  // the fused host step reads it as it is
      if (u.gradient_down) {  // came down during backward (send_gradient_down)
        m.grad = m.grad_staging;
        u.gradient_down = false;
      } else {
        // The norm is taken where the gradient is (on the GPU: no fp32 copy on the host).
        m.grad_sq = squared_norm(reduced, inv_world);
        m.grad = m.grad_staging.defined() ? m.grad_staging.copy_(reduced) : reduced.to(torch::kCPU);
      }
      m.grad_scale = inv_world;
      m.clip_scale = 1;
    } else if (options_.step_applies_scales && reduced.is_cuda()) {
      m.grad_sq = squared_norm(reduced, inv_world);
      m.grad = options_.step_reads_working_gradient ? reduced : reduced.to(m.master.device(), torch::kFloat32);
      m.grad_scale = inv_world;
      m.clip_scale = 1;
    } else {
      m.grad = reduced.to(m.master.device(), torch::kFloat32).mul_(inv_world);
    }
    u.reduced = Tensor();
  }
  last_micro_batch_ = true;
}

torch::Tensor ZeroDataParallel::gradient_squares_tensor() {
  // Summed in fp64, shard by shard, where the squares are. Only units laid out with
  // separate_replicated_norm have replicated ranges; otherwise that part is 0.
  Tensor total, replicated, experts;
  auto add = [](Tensor& sum, const Tensor& term) {
    if (!sum.defined()) sum = torch::zeros({}, term.options());
    sum += term;
  };
  for (size_t k = 0; k < shards_.size(); ++k) {
    const MasterShard& s = shards_[k];
    // (grad_sq leaves out clip_scale, which by now holds fp16's unscaling alone, if anything)
    Tensor squares = !s.grad_sq.defined() ? s.scaled_grad().pow(2).sum().to(torch::kFloat64) : s.clip_scale == 1 ? s.grad_sq : s.grad_sq * (s.clip_scale * s.clip_scale);
    add(units_[k]->routed_experts ? experts : total, squares);
    if (units_[k]->replicated_ranges.empty()) continue;
    Tensor g = s.scaled_grad();
    for (const auto& [begin, end] : units_[k]->replicated_ranges) add(replicated, g.narrow(0, begin, end - begin).pow(2).sum().to(torch::kFloat64));
  }
  const Tensor& any = total.defined() ? total : replicated.defined() ? replicated : experts;
  const auto options = any.defined() ? any.options() : torch::TensorOptions().dtype(torch::kFloat64);
  for (Tensor* t : {&total, &replicated, &experts})
    if (!t->defined()) *t = torch::zeros({}, options);
  // Shards are disjoint over the data ranks (stage 1-3), and so are the expert shards; at stage 0
  // every rank holds whole gradients, the same as the ranks keeping the same experts.
  Tensor sums = torch::stack({total - replicated, replicated, experts});
  if (options_.stage == 0) sums.narrow(0, 0, 2).zero_();
  if (options_.stage == 0 && options_.expert_replicas) sums.narrow(0, 2, 1).div_(options_.expert_replicas->world_size());
  if (options_.stage >= 1 || options_.expert_replicas) comm_.all_reduce_sum(sums);
  if (options_.stage == 0) return torch::stack({total - replicated + sums[2], replicated});
  return torch::stack({sums[0] + sums[2], sums[1]});
}

void ZeroDataParallel::take_autograd_gradients(Unit& u, MasterShard& m) {
  m.grad = Tensor();
  m.grad_pieces.clear();
  std::vector<Tensor> pieces;
  for (size_t i = 0; i < u.params.size(); ++i) {
    Tensor g = u.params[i].grad();
    // A parameter this step did not reach gets a zero gradient, as the flat buffer would hold.
    g = g.defined() ? g.contiguous().view({-1}) : torch::zeros({u.layout.numels[i]}, u.params[i].options());
    m.grad_pieces.push_back({u.layout.offsets[i], g});
    pieces.push_back(g);
  }
  m.grad_sq = fused::sum_of_squares(pieces);
  m.grad_scale = 1;
  m.clip_scale = 1;
}

ZeroDataParallel::GradientSquares ZeroDataParallel::gradient_squares() {
  const Tensor sums = gradient_squares_tensor().to(torch::kCPU);
  return GradientSquares{sums[0].item<double>(), sums[1].item<double>()};
}

double ZeroDataParallel::global_grad_norm() {
  const GradientSquares sq = gradient_squares();
  return std::sqrt(sq.split + sq.replicated);
}

void ZeroDataParallel::clip_on_device(const torch::Tensor& norm, double max_norm) {
  torch::NoGradGuard no_grad;
  const Tensor divisor = torch::where(norm > max_norm, (norm + 1e-6) / max_norm, torch::ones_like(norm)).to(torch::kFloat32);
  for (auto& s : shards_) s.clip_divisor = divisor.to(s.master.device());
}

void ZeroDataParallel::scale_gradients(double factor) {
  for (auto& s : shards_) {
    if (s.master.device().is_cpu() || options_.step_applies_scales) s.clip_scale *= factor;  // applied by the step
    else s.grad.mul_(factor);  // (gradients_left_to_autograd implies step_applies_scales)
  }
}

torch::Tensor MasterShard::scaled_grad() const {
  Tensor g = scaled_fp32(flat_grad(), grad_scale, clip_scale);
  if (clip_divisor.defined()) g = g / clip_divisor.to(g.device());
  return g;
}

torch::Tensor MasterShard::flat_grad() const {
  if (grad.defined() || grad_pieces.empty()) return grad;
  Tensor flat = torch::zeros({master.numel()}, grad_pieces[0].second.options());
  for (const auto& [offset, piece] : grad_pieces) flat.narrow(0, offset, piece.numel()).copy_(piece);
  return flat;
}

bool ZeroDataParallel::gradients_overflowed() {
  for (auto& u : units_) u->down.synchronize();  // the host copies are complete
  double bad = 0;
  for (auto& s : shards_) bad += s.flat_grad().isfinite().logical_not().any().item<bool>() ? 1 : 0;
  Tensor t = torch::tensor({bad}, torch::kFloat64);
  comm_.all_reduce_sum(t);
  return t.item<double>() > 0;
}

std::vector<MasterShard>& ZeroDataParallel::shards() {
  wait_host_update();  // callers read or write master weights and states
  return shards_;
}

void ZeroDataParallel::after_step() {
  if (!offload_to_host_) publish_master();  // offloaded: the host update does it
  for (auto& m : shards_) {
    m.grad = Tensor();
    m.grad_pieces.clear();
    m.grad_scale = m.clip_scale = 1;
    m.clip_divisor = Tensor();
    m.grad_sq = Tensor();
    if (offload_to_host_) m.params_written = false;
  }
  zero_gradients();
  live_fns_.clear();
}

const std::string& ZeroDataParallel::unit_name(size_t k) const { return units_.at(k)->name; }
int64_t ZeroDataParallel::unit_numel(size_t k) const { return units_.at(k)->layout.numel; }
int64_t ZeroDataParallel::master_begin(size_t k) const { return units_.at(k)->layout.shard_begin; }
const std::vector<Tensor>& ZeroDataParallel::unit_params(size_t k) const { return units_.at(k)->params; }
const std::vector<int64_t>& ZeroDataParallel::unit_offsets(size_t k) const { return units_.at(k)->layout.offsets; }
const std::vector<int64_t>& ZeroDataParallel::unit_shape(size_t k, size_t i) const { return units_.at(k)->layout.shapes.at(i); }
Communicator& ZeroDataParallel::unit_group(size_t k) const { return *units_.at(k)->group; }

void ZeroDataParallel::publish_master() {
  torch::NoGradGuard no_grad;
  wait_host_update();
  for (auto& u : units_) u->awaiting_update = false;  // replaced by what follows
  update_launched_ = false;
  // fp32 without offload updated the working parameters in place; otherwise copy them over.
  const bool copy_master = options_.dtype != DType::Fp32 || offload_to_host_;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = *units_[k];
    MasterShard& m = shards_[k];
    // The host step wrote them already (to their slice, or to the upload buffer).
    const Tensor& source = m.params_written ? m.param_out : m.master;
    const bool copy = copy_master && !(m.params_written && m.param_out.device() == device_);
    m.params_written = false;
    if (options_.stage == 3) {
      if (copy && !source.is_same(u.param_shard)) u.param_shard.copy_(source);
    } else {
      Tensor mine = u.full.narrow(0, u.layout.shard_begin, u.layout.shard);
      if (copy && !source.is_same(mine)) mine.copy_(source);
      // (one data rank: its shard is the whole buffer, nothing to gather; the copies cost an H100
      // 2.6 ms per step on the 1B decoder at ZeRO-2)
      if (options_.stage >= 1 && u.group->world_size() > 1) u.group->all_gather(mine.clone(), u.full);
    }
  }
}

void ZeroDataParallel::zero_gradients() {
  for (auto& u : units_) {
    if (!options_.gradients_left_to_autograd) u->grad_acc.zero_();
    else
      for (auto& p : u->params) p.mutable_grad() = Tensor();  // dropped: the next backward's are taken over
  }
}

double ZeroDataParallel::parameter_and_gradient_bytes() const {
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

double ZeroDataParallel::master_bytes() const {
  if (options_.dtype == DType::Fp32 && !offload_to_host_) return 0;  // the master weights are the working parameters
  double bytes = 0;
  for (const auto& s : shards_) bytes += static_cast<double>(s.master.numel() * s.master.element_size());
  return bytes;
}

}  // namespace dsrun
