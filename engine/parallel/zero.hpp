// Data parallelism with ZeRO stages 0-3 over flat per-unit buffers, applied to a Model from outside.
// A deferred model (parameters without values) is materialised here unit by unit: a rank holds
// one unit in fp32 at a time, then only what its stage keeps.
// Stage 0 all-reduces gradients; 1 shards fp32 master weights and optimizer states; 2 also shards
// gradients (reduce-scatter every micro-batch); 3 also shards parameters, gathered per unit.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/copy_stream.hpp"
#include "engine/parallel/flat_layout.hpp"
#include "engine/parallel/unit_worker.hpp"

#include <torch/torch.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dsrun {

struct ZeroOptions {
  int stage = 0;
  DType dtype = DType::Fp32;              // compute dtype of the working parameters and gradients
  bool activation_checkpointing = false;  // recompute checkpointable units in backward
  bool offload = false;                   // fp32 master weights and optimizer states on the host
  bool offload_params = false;            // stage 3: the parameter shards on the host too
  // Offload: the host step of step t runs while step t+1 computes, on the parameters from before
  // it (ZeRO-Offload's one-step delayed parameter update).
  bool delayed_update = false;
  double bucket_bytes = 25e6;             // stage 0 all-reduce granularity
  torch::Device device = torch::kCPU;     // where a deferred model's units are built (otherwise: its parameters' device)
  // A deferred model's initial values of parameter `name` in its current shape (tensor
  // parallelism: this rank's slice of the full weight). Empty: the model's initialize_parameter.
  std::function<void(const std::string& name, torch::Tensor& values)> initial_values;
  // Keep the gradient squares of replicated parameters (TensorSplit::Replicated) apart from the
  // split ones' (gradient_squares), for a norm over tensor-parallel ranks.
  bool separate_replicated_norm = false;
  // Expert parallelism: routed-expert units (ParameterUnit::experts_of) are sharded and reduced
  // over these ranks, the data ranks keeping the same experts, instead of the whole data group.
  // Null: no expert parallelism.
  Communicator* expert_replicas = nullptr;
  // Masters on a GPU: the optimizer's step applies grad_scale and clip_scale as it reads the
  // gradient (the fused Adam kernel's grad_scale), so neither costs a pass over the fp32 gradient,
  // and the norm is taken from the reduced gradient in the working dtype.
  bool step_applies_scales = false;
  // Masters on a GPU whose step is dsrun's own kernel (engine/train/adam_kernel.h): the gradient
  // stays in the working dtype (no fp32 copy of it) and the step writes the working parameters as
  // it updates the master (MasterShard::param_out is their slice), so publish_master copies nothing.
  bool step_reads_working_gradient = false;
  // One rank at stage 0-2 (nothing to reduce, nothing to shard), with step_reads_working_gradient:
  // no flat gradient buffer. Each parameter's gradient stays where autograd puts it (the first micro-batch's is
  // taken over, not added to a zeroed bucket; after the step it is dropped, not zeroed) and the
  // step reads it there (MasterShard::grad_pieces): 8 bytes per bf16 parameter and step less.
  bool gradients_left_to_autograd = false;
};

// The torch dtype of a recipe dtype.
inline torch::ScalarType torch_dtype(DType d) {
  return d == DType::Bf16 ? torch::kBFloat16 : d == DType::Fp16 ? torch::kFloat16 : torch::kFloat32;
}

// The part of the flat parameter space one rank updates: fp32 master weights, their gradient,
// and which elements get weight decay (matrices do; norms and biases do not).
struct MasterShard {
  torch::Tensor master;  // fp32, updated in place by the optimizer
  // The averaged gradient for master is grad · grad_scale · clip_scale. A master on the device
  // gets grad in fp32, with the factors applied (both 1) unless ZeroOptions::step_applies_scales
  // leaves them to the step. A master in host memory (CPU ranks,
  // offload) gets grad as reduced, in the working dtype, and the fused host step applies the
  // factors as it reads it: no fp32 copy of the gradient is ever made.
  torch::Tensor grad;
  // ZeroOptions::gradients_left_to_autograd: in place of grad, each parameter's gradient (contiguous,
  // flattened) with its offset within master, in parameter order (grad is then undefined).
  std::vector<std::pair<int64_t, torch::Tensor>> grad_pieces;
  double grad_scale = 1, clip_scale = 1;
  // Undefined, or a scalar fp32 tensor on the master's device that the step divides the gradient
  // by as well: clipping decided on the device (ZeroDataParallel::clip_on_device), no host read.
  torch::Tensor clip_divisor;
  torch::Tensor grad_sq;  // host masters and step_applies_scales: Σ (g · grad_scale)² as an fp64 scalar, taken where the gradient was reduced (undefined: not taken)
  // Host masters: where the host step writes the working parameters (the rank's slice): the slice
  // itself when it is in host memory, else a pinned upload buffer that publish_master copies to
  // the device. Device masters: their slice with ZeroOptions::step_reads_working_gradient, else undefined.
  torch::Tensor param_out;
  bool params_written = false;
  // Offload: the gradient shard comes down into this host buffer (pinned on GPU ranks), so that
  // the host step can read it while the next step's gradients accumulate. The delayed update has
  // two, swapped every step: one read by the host step, one filled by the backward under way.
  torch::Tensor grad_staging, grad_staging_spare;
  std::vector<std::pair<int64_t, int64_t>> decay_ranges;  // [begin, end) within master (FlatUnitLayout)
  // The gradient as fp32 with its factors applied (norms, overflow checks, tests).
  torch::Tensor scaled_grad() const;
  // grad, or grad_pieces laid out as one flat tensor (for the paths that read it whole).
  torch::Tensor flat_grad() const;
};

class ZeroDataParallel final : public UnitRunner {
 public:
  ZeroDataParallel(Model& model, Communicator& comm, const ZeroOptions& options);
  ~ZeroDataParallel() override;

  // UnitRunner: gathers (stage 3), checkpoints, and arranges the re-gather for backward.
  Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) override;

  // Before each micro-batch's forward: whether its backward is the last before reduce_gradients()
  // (stages 0-1 reduce once per step, after the last micro-batch; 2-3 after every one). Without
  // a call every backward counts as the last.
  void begin_micro_batch(bool last);
  // Gradient reduction overlaps backward: as soon as autograd has accumulated every gradient of a
  // unit, that unit's all-reduce (stage 0-1, last micro-batch) or reduce-scatter (stage 2-3) starts
  // on the communicator's stream, and stage 2-3 free the unit's full gradients (stage 3 also its
  // gathered parameters). after_backward() starts what is left (units some of whose parameters
  // got no gradient, such as MoE blocks) and, at stage 2-3, waits for this micro-batch's reductions.
  // A pipeline's backward covers one chunk: only its units (local numbering) are concerned.
  void after_backward(UnitRange units = {0, -1});
  // After the last micro-batch: completes the reduction so that shards() hold averaged gradients.
  void reduce_gradients();
  // The gradients' 2-norm over the data-parallel ranks (for global-norm clipping).
  double global_grad_norm();
  // The squares behind that norm, summed over the data-parallel ranks, apart for the parameters
  // the model marks as split by tensor parallelism and those it replicates (without
  // ZeroOptions::separate_replicated_norm, all count as split and `replicated` is 0). Routed
  // experts count as split: every expert once, whichever data ranks keep it.
  struct GradientSquares {
    double split = 0, replicated = 0;
  };
  GradientSquares gradient_squares();
  // The same sums as a [split, replicated] fp64 tensor where the gradients are, the collectives run
  // there too: on GPUs the host reads nothing.
  torch::Tensor gradient_squares_tensor();
  // Global-norm clipping decided on the device: every shard's step divides its gradient by
  // max(1, (norm + 1e-6) / max_norm) where norm > max_norm (the factor scale_gradients would apply
  // after a host read), norm a scalar tensor on the masters' device.
  void clip_on_device(const torch::Tensor& norm, double max_norm);
  void scale_gradients(double factor);
  // True if any gradient element on any rank is inf or NaN (fp16 overflow).
  bool gradients_overflowed();
  std::vector<MasterShard>& shards();
  // After the optimizer: master weights -> working parameters on every rank; gradients zeroed.
  // With offload the host update does the first half itself (start_host_update).
  void after_step();
  // Offload: the optimizer step runs on a host thread, one task per unit in forward order
  // (update_unit(k) updates shard k's master and writes its param_out); each unit's parameters go
  // up as soon as they are written, and the next forward waits for each unit alone. With the
  // delayed update they go up after the next step's backward instead.
  bool host_update_pipelined() const { return offload_to_host_; }
  void start_host_update(std::function<void(size_t)> update_unit);
  // Waits for the host update under way (before reading master weights or optimizer states).
  void wait_host_update();
  // Offload: waits until unit k's updated parameters are up (before reading them outside its
  // forward, as a pipeline's tied embedding does). Collective over the data ranks at stages 0-2.
  void await_parameters(size_t k) { await_update(*units_.at(k)); }
  // Seconds the last host update ran, and seconds compute waited for host updates since the last call.
  struct OffloadTimes {
    double host_update_s = 0, waited_s = 0;
  };
  OffloadTimes take_offload_times();
  // Master weights -> working parameters on every rank (after_step's first half; also after a restore).
  void publish_master();

  // The flat layout, for checkpoints: unit k has unit_numel(k) elements (padding excluded), its
  // parameters at unit_offsets(k), and shards()[k].master holds elements from master_begin(k).
  size_t unit_count() const { return units_.size(); }
  const std::string& unit_name(size_t k) const;
  int64_t unit_numel(size_t k) const;
  int64_t master_begin(size_t k) const;
  const std::vector<torch::Tensor>& unit_params(size_t k) const;
  const std::vector<int64_t>& unit_offsets(size_t k) const;
  const std::vector<int64_t>& unit_shape(size_t k, size_t i) const;
  // The ranks unit k's shards are spread over: the data group, or for routed experts the ranks
  // keeping the same ones.
  Communicator& unit_group(size_t k) const;
  void zero_gradients();
  // Reductions that started from the gradient-ready hooks, during backward (since construction).
  int64_t overlapped_reductions() const { return overlapped_reductions_; }

  // Bytes this rank holds for model states now (parameters, gradients, master, optimizer states
  // are added by the optimizer), to compare with the plan.
  double parameter_and_gradient_bytes() const;
  double master_bytes() const;
  // Of those, the bytes kept in host memory (offload), not on the device.
  double host_bytes() const { return offload_to_host_ ? master_bytes() + offload_buffer_bytes_ : 0; }
  // Offload's gradient staging and upload buffers (in host memory).
  double offload_buffer_bytes() const { return offload_buffer_bytes_; }

 private:
  struct Unit;
  class HostBuffers;
  // The constructor's steps. Every unit is laid out first (the host buffers are sized by all the
  // shards together); then each is built whole before the next (add_unit), in these steps.
  FlatUnitLayout lay_out(const ParameterUnit& pu) const;
  void add_unit(const ParameterUnit& pu, FlatUnitLayout layout, HostBuffers& host);
  // The unit's fp32 values in one flat buffer (padding zero); a deferred model's are built here.
  torch::Tensor materialise_values(const ParameterUnit& pu, const FlatUnitLayout& layout) const;
  // Stage 0-2: the whole flat buffer in the compute dtype; stage 3: this rank's slice of it.
  void create_working_parameters(Unit& u, const torch::Tensor& flat32, HostBuffers& host);
  // The fp32 master, and with offload its host buffers (parameter upload, gradient staging).
  MasterShard create_master_shard(Unit& u, const torch::Tensor& flat32, HostBuffers& host);
  // The gradient accumulator, and the parameters (and at stage 0-1 their gradients) as views of the buffers.
  void bind_parameters(Unit& u);
  // Each parameter's AccumulateGrad reports to on_gradient_ready, so reductions overlap backward.
  void attach_gradient_ready_hooks(Unit& u);

  void gather(Unit& u, int direction);  // direction: +1 in forward, -1 in backward (which unit to prefetch)
  void release(Unit& u);
  // With the routed experts kept apart (ParameterUnit::experts_of) that its computation reads.
  void gather_with_experts(Unit& u, int direction);
  void release_with_experts(Unit& u);
  void on_gradient_ready(size_t unit);  // an AccumulateGrad of one of the unit's parameters finished
  void start_reduction(Unit& u, bool during_backward);
  // gradients_left_to_autograd: the unit's gradients as autograd left them -> m.grad_pieces, their squared norm.
  void take_autograd_gradients(Unit& u, MasterShard& m);
  // Offload on a GPU, last micro-batch: the reduced shard comes down on down_stream_ as soon as its
  // reduction is done, its squared norm taken on the device on the way.
  void send_gradient_down(Unit& u, PendingCollective reduce, const torch::Tensor& flat, const torch::Tensor& mine);
  void track_reduction(PendingCollective reduction, double bytes);
  void upload_parameters(Unit& u);     // param_out -> the unit's working slice, on up_stream_
  void await_update(Unit& u);          // before a unit's parameters are read: its host update is done and up
  void await_all_updates();
  void wait_pending();

  Model& model_;
  Communicator& comm_;
  ZeroOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<MasterShard> shards_;
  std::vector<std::shared_ptr<UnitFn>> live_fns_;  // callables checkpointed units need in backward
  std::vector<int> forward_stack_;                 // units whose computation is running (nesting)
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;  // own the gradient-ready hooks
  std::shared_ptr<ZeroDataParallel*> alive_ = std::make_shared<ZeroDataParallel*>(this);  // null once destroyed
  std::vector<PendingCollective> pending_;         // reductions started and not yet waited for
  // Stage 1-3: each reduction in flight with the bytes of gradient it copies, oldest first; at
  // most two buckets' worth (parallel.bucket_bytes), as the plan counts (track_reduction).
  struct Reduction {
    PendingCollective done;
    double bytes = 0;
  };
  std::deque<Reduction> reductions_;
  double reduction_bytes_ = 0;
  bool last_micro_batch_ = true;
  int64_t overlapped_reductions_ = 0;
  bool offload_to_host_ = false;                   // master and optimizer states in host memory
  torch::Device device_{torch::kCPU};              // where the working parameters compute
  bool gradients_down_in_backward_ = false;        // offload on a GPU: send_gradient_down
  double offload_buffer_bytes_ = 0;
  bool update_launched_ = false;                   // delayed update: a host update whose parameters have not gone up
  std::unique_ptr<CopyStream> down_stream_, up_stream_;
  UnitWorker worker_;  // last member: destroyed first, so its tasks never outlive what they use
};

}  // namespace dsrun
