// A MoE layer's routed experts as one computation: SwiGLU experts over rows grouped expert by
// expert, two grouped matrix products forward and four backward, on weights stacked without a copy.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace dsrun {

// down_e(silu(gate_e(x)) · up_e(x)) for every row x of expert e's group. rows: [M, hidden], grouped
// by expert; counts: [E] int64 on rows' device, the rows of each expert in turn (they sum to M);
// gate_up[e]: [2 · inner, hidden] (gate rows, then up rows), down[e]: [hidden, inner], leaves of
// the model. Returns [M, hidden]. Nothing is read back to the host where compat::grouped_mm runs
// its kernel; backward keeps rows and the gate/up products, not the weights (ZeRO-3 gathers them
// again for backward and the function reads them then). fp8 (execution.fp8_routed_experts, CUDA,
// bf16): forward's and the input gradients' products in FP8 with row scales, the weights' transposes
// kept in FP8 for backward instead (grouped_experts.cpp); hidden and inner multiples of 16.
torch::Tensor grouped_swiglu_experts(const torch::Tensor& rows, const torch::Tensor& counts, const std::vector<torch::Tensor>& gate_up,
                                     const std::vector<torch::Tensor>& down, bool fp8 = false);

// The same computation expert by expert through autograd's own ops: the reference the grouped
// function is tested against.
torch::Tensor looped_swiglu_experts(const torch::Tensor& rows, const torch::Tensor& counts, const std::vector<torch::Tensor>& gate_up,
                                    const std::vector<torch::Tensor>& down);

// The weights as one [E, ...] tensor: a view of their memory where they lie one after another
// (ZeRO's flat buffer keeps each kind of a layer's routed expert weights together, DeepSeekModel's
// unit order), else a copy. `viewed`, if given, says which.
torch::Tensor stack_weights(const std::vector<torch::Tensor>& weights, bool* viewed = nullptr);

}  // namespace dsrun
