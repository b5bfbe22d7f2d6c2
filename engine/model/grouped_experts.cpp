#include "engine/model/grouped_experts.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/model/fp8_linear.hpp"
#include "engine/model/fused_ops.hpp"

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// x [M, H] grouped by expert, w1 [E, 2I, H], w2 [E, H, I]. Forward: h = x·w1ᵀ, a = swiglu(h),
// y = a·w2ᵀ, expert by expert. Backward: the products' transposes, as PyTorch's own derivative
// of _grouped_mm takes them; a is recomputed from h rather than kept (one elementwise kernel
// against M × I values held per layer).
struct GroupedSwiGLU : torch::autograd::Function<GroupedSwiGLU> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, const Tensor& offs, at::TensorList gate_up, at::TensorList down) {
    const Tensor w1 = stack_weights(gate_up.vec()), w2 = stack_weights(down.vec());
    const Tensor x = rows.contiguous();
    Tensor h = compat::grouped_mm(x, w1.transpose(1, 2), offs);
    Tensor y = compat::grouped_mm(fused::swiglu(h), w2.transpose(1, 2), offs);
    // The weights are saved as the leaves they are, not as the stacked views: ZeRO-3 releases and
    // gathers a leaf's memory between forward and backward, and a saved view would keep it.
    variable_list saved = {x, offs, h};
    saved.insert(saved.end(), gate_up.begin(), gate_up.end());
    saved.insert(saved.end(), down.begin(), down.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["experts"] = static_cast<int64_t>(gate_up.size());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t experts = static_cast<size_t>(ctx->saved_data["experts"].toInt());
    const Tensor &x = saved[0], &offs = saved[1], &h = saved[2];
    const Tensor w1 = stack_weights({saved.begin() + 3, saved.begin() + 3 + experts});
    const Tensor w2 = stack_weights({saved.begin() + 3 + experts, saved.end()});
    const Tensor dy = grads[0].contiguous();
    const Tensor a = fused::swiglu(h);
    const Tensor da = compat::grouped_mm(dy, w2, offs);            // [M, I]
    const Tensor dw2 = compat::grouped_mm(dy.t(), a, offs);        // [E, H, I]
    const Tensor dh = fused::swiglu_backward(h, da);               // [M, 2I]
    const Tensor dx = compat::grouped_mm(dh, w1, offs);            // [M, H]
    const Tensor dw1 = compat::grouped_mm(dh.t(), x, offs);        // [E, 2I, H]
    variable_list out = {dx, Tensor()};
    for (size_t e = 0; e < experts; ++e) out.push_back(dw1[static_cast<int64_t>(e)]);
    for (size_t e = 0; e < experts; ++e) out.push_back(dw2[static_cast<int64_t>(e)]);
    return out;
  }
};

// The same experts with four of the six products in FP8 (execution.fp8_routed_experts), as
// torchao's float8 MoE training takes them: forward's two and the input gradients' two through
// torch's grouped scaled product, which takes row scales only (whatever precision.fp8's scaling):
// each row of x, a, dy and dh scaled on its own, each expert's weight per output row forward and per
// column (its transpose's rows) backward. The weight gradients stay bf16 grouped products: in FP8
// each would need scales per expert along the tokens (the summed dimension). Forward quantises each
// weight and its transpose in one pass and keeps the transposes (a byte a parameter) for backward,
// as fp8_linear does; backward reads no bf16 weight.
struct GroupedSwiGLUFp8 : torch::autograd::Function<GroupedSwiGLUFp8> {
  // x [M, K] bf16 by w [E, N, K] (quantised: wq, scales [E, N]): [M, N] bf16. Forward's products
  // take CUTLASS's fast accumulation, as torchao's float8 recipes do; the gradients' do not.
  static Tensor product(const Tensor& x, const Tensor& wq, const Tensor& w_inv, const Tensor& offs, bool forward) {
    const Fp8Operand xq = quantize_fp8(x.contiguous(), Fp8Scaling::Rowwise, false, true, false);
    return compat::scaled_grouped_mm(xq.q, wq.transpose(1, 2), xq.inv_q.view({-1}), w_inv, offs, /*fast_accum=*/forward);
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& rows, const Tensor& offs, at::TensorList gate_up, at::TensorList down) {
    const Tensor x = rows.contiguous();
    const Fp8Operand w1 = quantize_fp8_experts(stack_weights(gate_up.vec()).contiguous(), true, true);
    const Fp8Operand w2 = quantize_fp8_experts(stack_weights(down.vec()).contiguous(), true, true);
    Tensor h = product(x, w1.q, w1.inv_q, offs, true);
    Tensor y = product(fused::swiglu(h), w2.q, w2.inv_q, offs, true);
    ctx->save_for_backward({x, offs, h, w1.qt, w1.inv_t, w2.qt, w2.inv_t});
    ctx->saved_data["experts"] = static_cast<int64_t>(gate_up.size());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t experts = static_cast<size_t>(ctx->saved_data["experts"].toInt());
    const Tensor &x = saved[0], &offs = saved[1], &h = saved[2], &w1t = saved[3], &w1t_inv = saved[4], &w2t = saved[5], &w2t_inv = saved[6];
    const Tensor dy = grads[0].contiguous();
    const Tensor a = fused::swiglu(h);
    const Tensor da = product(dy, w2t, w2t_inv, offs, false);    // [M, I] = dy · w2
    const Tensor dw2 = compat::grouped_mm(dy.t(), a, offs);  // [E, H, I]
    const Tensor dh = fused::swiglu_backward(h, da);         // [M, 2I]
    const Tensor dx = product(dh, w1t, w1t_inv, offs, false);    // [M, H] = dh · w1
    const Tensor dw1 = compat::grouped_mm(dh.t(), x, offs);  // [E, 2I, H]
    variable_list out = {dx, Tensor()};
    for (size_t e = 0; e < experts; ++e) out.push_back(dw1[static_cast<int64_t>(e)]);
    for (size_t e = 0; e < experts; ++e) out.push_back(dw2[static_cast<int64_t>(e)]);
    return out;
  }
};

void check_experts(const Tensor& counts, const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down) {
  DSRUN_ASSERT(!gate_up.empty() && gate_up.size() == down.size() && counts.numel() == static_cast<int64_t>(gate_up.size()),
               "one count, one gate/up and one down weight per expert");
}

}  // namespace

Tensor stack_weights(const std::vector<Tensor>& weights, bool* viewed) {
  DSRUN_ASSERT(!weights.empty(), "stacking no weights");
  const Tensor& first = weights[0];
  const int64_t bytes = first.numel() * static_cast<int64_t>(first.element_size());
  bool adjacent = first.is_contiguous();
  for (size_t e = 1; e < weights.size() && adjacent; ++e) {
    const Tensor& w = weights[e];
    adjacent = w.is_contiguous() && w.sizes() == first.sizes() && w.scalar_type() == first.scalar_type() && w.device() == first.device() &&
               w.storage().is_alias_of(first.storage()) &&
               static_cast<const char*>(w.data_ptr()) == static_cast<const char*>(first.data_ptr()) + static_cast<int64_t>(e) * bytes;
  }
  if (viewed) *viewed = adjacent;
  if (!adjacent) return torch::stack(weights);
  std::vector<int64_t> shape = {static_cast<int64_t>(weights.size())};
  for (int64_t d : first.sizes()) shape.push_back(d);
  torch::NoGradGuard no_grad;
  return torch::empty({0}, first.options()).set_(first.storage(), first.storage_offset(), shape);  // (no strides: contiguous)
}

Tensor grouped_swiglu_experts(const Tensor& rows, const Tensor& counts, const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down, bool fp8) {
  check_experts(counts, gate_up, down);
  const Tensor offs = counts.cumsum(0).to(torch::kInt32);  // the groups' row ends, on the device
  // (No rows here: the grouped FP8 kernel takes no empty operand, and there is nothing to compute.)
  if (fp8 && rows.size(0) > 0) return GroupedSwiGLUFp8::apply(rows, offs, at::TensorList(gate_up), at::TensorList(down));
  return GroupedSwiGLU::apply(rows, offs, at::TensorList(gate_up), at::TensorList(down));  // (as lists: every weight an input)
}

Tensor looped_swiglu_experts(const Tensor& rows, const Tensor& counts, const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down) {
  check_experts(counts, gate_up, down);
  const Tensor host = counts.to(torch::kCPU, torch::kInt64);
  const std::vector<int64_t> sizes(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  std::vector<Tensor> parts, inputs = rows.split_with_sizes(sizes);
  for (size_t e = 0; e < sizes.size(); ++e)
    if (sizes[e] > 0) parts.push_back(torch::linear(fused::swiglu(torch::linear(inputs[e], gate_up[e])), down[e]));
  return parts.empty() ? torch::zeros({0, down[0].size(0)}, rows.options()) : torch::cat(parts);
}

}  // namespace dsrun
