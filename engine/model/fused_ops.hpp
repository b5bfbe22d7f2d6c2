// The decoder's elementwise ops (RMSNorm, rotary embedding, SwiGLU) as autograd functions: on CUDA
// one fused kernel forward and one backward each (fused_kernels.cu); elsewhere plain libtorch ops.
#pragma once

#include <torch/torch.h>

namespace dsrun::fused {

// (x · rsqrt(mean(x²) + eps)) · weight over the last dimension, the mean in fp32.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Rotary position embedding of q and k heads in one call, Llama layout (each head's first half
// rotates against its second half). qk: [b, s, heads · head_dim], any row stride; cos and sin:
// [>= s, head_dim] fp32 with both halves equal. Returns a contiguous [b, s, heads · head_dim].
torch::Tensor rotary(const torch::Tensor& qk, int64_t head_dim, const torch::Tensor& cos, const torch::Tensor& sin);

// silu(gate) · up where gate_up = [gate | up] along the last dimension.
torch::Tensor swiglu(const torch::Tensor& gate_up);
// The gradient of swiglu at gate_up for the output's gradient d_out (outside autograd: for
// functions that write their own backward, engine/model/grouped_experts.cpp).
torch::Tensor swiglu_backward(const torch::Tensor& gate_up, const torch::Tensor& d_out);

// True where the fused CUDA kernels run for x (a CUDA tensor in a CUDA build); for tests.
bool fused_kernels_active(const torch::Tensor& x);

}  // namespace dsrun::fused
