#include "engine/model/grouped_experts.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"
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

Tensor grouped_swiglu_experts(const Tensor& rows, const Tensor& counts, const std::vector<Tensor>& gate_up, const std::vector<Tensor>& down) {
  check_experts(counts, gate_up, down);
  const Tensor offs = counts.cumsum(0).to(torch::kInt32);  // the groups' row ends, on the device
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
