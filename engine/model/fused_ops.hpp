// The decoder's elementwise ops (RMSNorm, rotary embedding, SwiGLU, a MoE layer's combine, the loss's softmax) as autograd
// functions: on CUDA one fused kernel forward and one backward each (engine/model/kernels/); elsewhere plain libtorch ops.
#pragma once

#include <torch/torch.h>

namespace dsrun::fused {

// (x · rsqrt(mean(x²) + eps)) · weight over the last dimension, the mean in fp32.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// {a contiguous copy of x as [rows, last dimension], rms_norm(x)}: the copy is the residual stream's next value, which the
// caller may add into in place (a matrix product's addmm_); on CUDA one kernel reads x once for
// both, and backward adds the copy's gradient to x's inside the norm's backward kernel.
std::vector<torch::Tensor> rms_norm_with_copy(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Rotary position embedding of q and k heads in one call, Llama layout (each head's first half
// rotates against its second half). qk: [b, s, heads · head_dim], any row stride; cos and sin:
// [>= s, head_dim] fp32 with both halves equal. Returns a contiguous [b, s, heads · head_dim].
// positions ([b, s] int64, any device), if defined, says which row of the tables each token takes
// (documents packed in a row restart at 0); undefined, token j of a row takes row j.
torch::Tensor rotary(const torch::Tensor& qk, int64_t head_dim, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& positions = {});

// The q/k/v projection x [b, s, h] · weightᵀ ([q_width + k_width + v_width, h], q, k and v rows
// stacked) -> {q, k, v}: q and k rotated as rotary() does (contiguous), v the product's last
// columns. On CUDA backward never joins the three gradients: q's and k's rotated into one buffer,
// the products run on it and on v's gradient as it comes; elsewhere linear, rotary() and two splits.
std::vector<torch::Tensor> project_qkv(const torch::Tensor& x, const torch::Tensor& weight, int64_t q_width, int64_t k_width, int64_t head_dim,
                                       const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions = {});

// {q, k, v} of an already made projection qkv [b, s, q_width + k_width + v_width] (an FP8 one, which
// project_qkv's fused backward does not take): q and k rotated as rotary() does, v its last columns.
std::vector<torch::Tensor> rotate_qkv(const torch::Tensor& qkv, int64_t q_width, int64_t k_width, int64_t head_dim, const torch::Tensor& cos,
                                      const torch::Tensor& sin, const torch::Tensor& positions = {});

// silu(gate) · up where gate_up = [gate | up] along the last dimension.
torch::Tensor swiglu(const torch::Tensor& gate_up);
// The gradient of swiglu at gate_up for the output's gradient d_out (outside autograd: for
// functions that write their own backward, engine/model/grouped_experts.cpp).
torch::Tensor swiglu_backward(const torch::Tensor& gate_up, const torch::Tensor& d_out);

// The token cross-entropy's gradient on a chunk of fp32 logits z [rows, V] in `dtype`:
// (softmax(z) - one_hot(column where here)) · scale · factor, with softmax from each row's
// log-sum-exp lse [rows] (over the whole vocabulary) and `factor` a scalar fp32 tensor on z's device
// or undefined. One pass on CUDA; elsewhere z is overwritten on the way.
torch::Tensor softmax_gradient(torch::Tensor& z, const torch::Tensor& lse, const torch::Tensor& column, const torch::Tensor& here,
                               double scale, const torch::Tensor& factor, torch::ScalarType dtype);

// A MoE layer's combine: out [T, H], out[t] = Σ_i weights[t, i] · rows[place[t·k + i]] over token
// t's k = weights.size(1) choices, summed in fp32 and rounded once to rows' dtype. place: [T · k]
// int64 on rows' device, the row of each (token, choice) pair, or -1 for a pair that has none (dropped
// by a capacity). weights: [T, k] fp32 with autograd; undefined: weights of 1, for backward passes
// (no gradient flows then). On CUDA one kernel each way, no [T · k, H] intermediate.
torch::Tensor combine_rows(const torch::Tensor& rows, const torch::Tensor& place, const torch::Tensor& weights, int64_t k);

// The token cross-entropy on a chunk of fp32 logits z [rows, V]: writes each row's log-sum-exp
// into lse [rows] and its target's logit (z[column] where here, else 0) into target_logit [rows],
// and returns the gradient (softmax(z) - one_hot(column where here)) · scale in `dtype`. On CUDA
// one kernel (z read from memory once); elsewhere the ops above, z overwritten on the way.
torch::Tensor cross_entropy_rows(torch::Tensor& z, const torch::Tensor& column, const torch::Tensor& here, double scale, torch::ScalarType dtype,
                                 torch::Tensor lse, torch::Tensor target_logit);

// x *= factor (a one-element fp32 tensor) in place, in fp32 and rounded once; on CUDA one
// vectorised kernel reading the factor on the device (libtorch broadcasts a 0-dim CUDA tensor
// through its strided, unvectorised path: 260 us for the 1B's head gradient on an H100).
void scale_(torch::Tensor& x, const torch::Tensor& factor);

// Σ x² over every element of `tensors`, an fp64 scalar on their device (the gradients' norm). On
// CUDA one kernel per tensor writing fp32 partial sums (16-byte reads: libtorch's multi-tensor norm
// read the 1B's bf16 gradients at 1.7 TB/s on an H100), summed in fp64; elsewhere
// compat::sum_of_squares (per-tensor fp32 norms). (Eight tensors a launch, their addresses passed
// by value, ran twice as long: 1.8 ms a step against 0.84.)
torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& tensors);

// log Σ exp over each row of fp32 z [rows, V] -> [rows] fp32 (one pass on CUDA).
torch::Tensor row_logsumexp(const torch::Tensor& z);

// True where the fused CUDA kernels run for x (a CUDA tensor in a CUDA build); for tests.
bool fused_kernels_active(const torch::Tensor& x);

}  // namespace dsrun::fused
