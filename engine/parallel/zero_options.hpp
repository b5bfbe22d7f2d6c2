// ZeRO's options, shared by its owners (flat units, master shards, gradient sync, offload): what
// the plan decided for the data dimension, taken as one small struct.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/recipe/kinds.hpp"

#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>

namespace dsrun {

struct ZeroOptions {
  int stage = 0;
  DType dtype = DType::Fp32;              // compute dtype of the working parameters (and autograd's gradients)
  // The gradient accumulator's dtype, in which micro-batches are summed and ranks reduce
  // (ExecutionModes::gradient_dtype); nullopt: dtype. Wider than dtype, autograd's gradients are
  // added into it unit by unit as backward completes them (Megatron-Core's main_grad).
  std::optional<DType> grad_dtype;
  DType gradient_dtype() const { return grad_dtype.value_or(dtype); }
  // Whether autograd's gradients are added into a wider accumulator rather than made in it.
  bool gradients_widened() const { return gradient_dtype() != dtype; }
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
  // The execution modes of the step (recipe/execution_modes.hpp), as the plan pinned them.
  // Masters on a GPU: the optimizer's step applies grad_scale and clip_scale as it reads the
  // gradient (the fused Adam kernel's grad_scale), so neither costs a pass over the fp32 gradient,
  // and the norm is taken from the reduced gradient in the working dtype.
  bool step_applies_scales = false;
  // Masters on a GPU whose step is dsrun's own kernel (engine/train/adam_kernel.h): the gradient
  // is read as it was accumulated, in the gradient dtype (no fp32 copy of a bf16 one) and the step writes the working parameters as
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

}  // namespace dsrun
