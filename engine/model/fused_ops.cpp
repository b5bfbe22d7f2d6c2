#include "engine/model/fused_ops.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"

#ifdef DSRUN_WITH_FUSED_KERNELS
#include "engine/model/fused_kernels.h"

#include <ATen/cuda/CUDAContext.h>
#endif

namespace dsrun::fused {

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The reference expressions: what the kernels compute, and what runs where they do not.
Tensor rms_norm_reference(const Tensor& x, const Tensor& weight, double eps) {
  Tensor xf = x.to(torch::kFloat32);  // the mean of squares in fp32, as DeepSeek does
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type()) * weight;
}

Tensor rotary_reference(const Tensor& qk, int64_t head_dim, const Tensor& cos, const Tensor& sin, const Tensor& positions) {
  const int64_t b = qk.size(0), s = qk.size(1), heads = qk.size(2) / head_dim, half = head_dim / 2;
  Tensor x = qk.reshape({b, s, heads, head_dim});
  Tensor c, sn;  // each token's row of the tables, [b or 1, s, 1, head_dim]
  if (positions.defined()) {
    const Tensor rows = positions.to(cos.device()).reshape({-1});
    c = cos.index_select(0, rows).to(qk.scalar_type()).view({b, s, 1, head_dim});
    sn = sin.index_select(0, rows).to(qk.scalar_type()).view({b, s, 1, head_dim});
  } else {
    c = cos.narrow(0, 0, s).to(qk.scalar_type()).view({1, s, 1, head_dim});
    sn = sin.narrow(0, 0, s).to(qk.scalar_type()).view({1, s, 1, head_dim});
  }
  Tensor rotated = torch::cat({-x.narrow(3, half, half), x.narrow(3, 0, half)}, -1);
  return (x * c + rotated * sn).reshape({b, s, heads * head_dim});
}

// (fp32 products and sum, as the kernel; a dropped pair's weight is 0 and its row any)
Tensor combine_rows_reference(const Tensor& rows, const Tensor& place, const Tensor& weights, int64_t k) {
  const int64_t tokens = place.numel() / k;
  const Tensor kept = place >= 0;
  Tensor w = weights.defined() ? weights.reshape({tokens, k}) : torch::ones({tokens, k}, rows.options().dtype(torch::kFloat32));
  w = w * kept.view({tokens, k}).to(torch::kFloat32);
  if (rows.size(0) == 0) return torch::zeros({tokens, rows.size(1)}, rows.options());  // (every pair dropped)
  const Tensor picked = rows.index_select(0, place.clamp_min(0)).to(torch::kFloat32).view({tokens, k, rows.size(1)});
  return (picked * w.unsqueeze(-1)).sum(1).to(rows.scalar_type());
}

Tensor swiglu_reference(const Tensor& gate_up) {
  std::vector<Tensor> gu = gate_up.chunk(2, -1);
  return torch::silu(gu[0]) * gu[1];
}

#ifdef DSRUN_WITH_FUSED_KERNELS

int kernel_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kBFloat16: return DSRUN_BF16;
    case torch::kFloat16: return DSRUN_F16;
    default: return DSRUN_F32;
  }
}

bool kernel_dtype_ok(const Tensor& t) {
  const auto d = t.scalar_type();
  return d == torch::kFloat32 || d == torch::kBFloat16 || d == torch::kFloat16;
}

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    return kernel_forward(ctx, x, weight, eps, Tensor());
  }
  // y = rms_norm(x), and x's copy into `copy` where defined; saves what backward reads.
  static Tensor kernel_forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps, const Tensor& copy) {
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    Tensor x2 = x.contiguous();
    Tensor y = torch::empty_like(x2);
    Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
    dsrun_rms_norm_forward(x2.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), copy.defined() ? copy.data_ptr() : nullptr,
                           rows, cols, static_cast<float>(eps), kernel_dtype(x), stream());
    DSRUN_CHECK_LAUNCH();
    ctx->save_for_backward({x2, weight, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const auto [dx, dw] = kernel_backward(grads[0], saved[0], saved[1], saved[2], Tensor());
    return {dx, dw, Tensor()};
  }
  // {dx (+ d_add where defined, in the kernel), dw}.
  static std::pair<Tensor, Tensor> kernel_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& d_add) {
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    Tensor dy = grad.contiguous();
    Tensor add = d_add.defined() ? d_add.contiguous() : Tensor();
    Tensor dx = torch::empty_like(x);
    Tensor partial = torch::empty({dsrun_rms_norm_partials(rows), cols}, x.options().dtype(torch::kFloat32));
    dsrun_rms_norm_backward(dy.data_ptr(), x.data_ptr(), weight.contiguous().data_ptr(), rstd.data_ptr<float>(), add.defined() ? add.data_ptr() : nullptr,
                            dx.data_ptr(), partial.data_ptr<float>(), rows, cols, kernel_dtype(x), stream());
    DSRUN_CHECK_LAUNCH();
    Tensor dw = torch::empty({cols}, weight.options());
    dsrun_column_sum(partial.data_ptr<float>(), partial.size(0), cols, dw.data_ptr(), kernel_dtype(weight), stream());
    DSRUN_CHECK_LAUNCH();
    return {dx, dw.view(weight.sizes())};
  }
};

// {a copy of x, rms_norm(x)} from one read of x; backward adds the copy's gradient to x's inside
// the norm's backward kernel. The copy is the residual stream's next value, for the layer after
// the norm to add its output into in place (its matrix product's epilogue): the two residual adds
// of a block and autograd's two sums of the stream's gradient cost no kernel of their own.
struct ResidualRmsNormFunction : torch::autograd::Function<ResidualRmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    const int64_t cols = x.size(-1);
    Tensor copy = torch::empty({x.numel() / cols, cols}, x.options());
    Tensor y = RmsNormFunction::kernel_forward(ctx, x, weight, eps, copy);
    return {copy, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const Tensor& d_copy = grads[0];
    if (!grads[1].defined()) return {d_copy, Tensor(), Tensor()};  // (the norm's output unused)
    const auto [dx, dw] = RmsNormFunction::kernel_backward(grads[1], saved[0], saved[1], saved[2], d_copy);
    return {dx, dw, Tensor()};
  }
};

// [b, s, n] with unit stride in the last dimension and rows one after another (any row stride).
Tensor as_rows(const Tensor& t) { return t.stride(2) == 1 && t.stride(0) == t.size(1) * t.stride(1) ? t : t.contiguous(); }

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  // qk: [b, s, n] with unit stride in its last dimension; the result is contiguous.
  // positions: [b · s] int64 on the device, or undefined (position = index in the row).
  static Tensor forward(AutogradContext* ctx, const Tensor& qk, int64_t head_dim, const Tensor& cos, const Tensor& sin, const Tensor& positions) {
    const int64_t b = qk.size(0), s = qk.size(1), n = qk.size(2);
    const Tensor in = as_rows(qk);
    Tensor out = torch::empty({b, s, n}, qk.options());
    dsrun_rotary(in.data_ptr(), in.stride(1), out.data_ptr(), n, cos.data_ptr<float>(), sin.data_ptr<float>(), position_rows(positions), b * s,
                 n / head_dim, head_dim, s, /*inverse=*/0, kernel_dtype(qk), stream());
    DSRUN_CHECK_LAUNCH();
    ctx->saved_data["head_dim"] = head_dim;
    ctx->save_for_backward({cos, sin, positions});
    return out;
  }
  // (autograd takes no undefined tensor argument: no positions is an empty one)
  static const int64_t* position_rows(const Tensor& positions) { return positions.numel() > 0 ? positions.data_ptr<int64_t>() : nullptr; }
  // The rotation is orthogonal: its gradient is the rotation by the opposite angle.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const int64_t head_dim = ctx->saved_data["head_dim"].toInt();
    Tensor g = grads[0].contiguous();
    const int64_t b = g.size(0), s = g.size(1), n = g.size(2);
    Tensor dx = torch::empty_like(g);
    dsrun_rotary(g.data_ptr(), n, dx.data_ptr(), n, saved[0].data_ptr<float>(), saved[1].data_ptr<float>(), position_rows(saved[2]), b * s,
                 n / head_dim, head_dim, s, /*inverse=*/1, kernel_dtype(g), stream());
    DSRUN_CHECK_LAUNCH();
    return {dx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The q/k/v projection and rotary in one function: x · wᵀ -> q and k rotated (two contiguous
// tensors), v as a view of the product. Backward never joins the three gradients into one: q's
// and k's are rotated back into one buffer of their columns, and the products run on it and on
// v's gradient as attention left it: x's gradient as two products summed in the second's epilogue,
// w's by row blocks. (Joining them cost a copy of v's gradient, 1.5 ms of the 1B's H100 step; the
// earlier form, rotary then two splits, concatenated twice: 3.7 ms.)
struct QkvProjectionFunction : torch::autograd::Function<QkvProjectionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, int64_t q_width, int64_t k_width, int64_t head_dim,
                               const Tensor& cos, const Tensor& sin, const Tensor& positions) {
    const int64_t b = x.size(0), s = x.size(1), n = weight.size(0);
    const Tensor in = torch::linear(x, weight);  // [b, s, q | k | v], contiguous
    Tensor q = torch::empty({b, s, q_width}, in.options()), k = torch::empty({b, s, k_width}, in.options());
    const int64_t* rows = RotaryFunction::position_rows(positions);
    const char* base = static_cast<const char*>(in.data_ptr());
    dsrun_rotary(base, n, q.data_ptr(), q_width, cos.data_ptr<float>(), sin.data_ptr<float>(), rows, b * s, q_width / head_dim, head_dim, s,
                 /*inverse=*/0, kernel_dtype(in), stream());
    DSRUN_CHECK_LAUNCH();
    dsrun_rotary(base + q_width * in.element_size(), n, k.data_ptr(), k_width, cos.data_ptr<float>(), sin.data_ptr<float>(), rows, b * s,
                 k_width / head_dim, head_dim, s, /*inverse=*/0, kernel_dtype(in), stream());
    DSRUN_CHECK_LAUNCH();
    ctx->saved_data["q_width"] = q_width;
    ctx->saved_data["k_width"] = k_width;
    ctx->saved_data["head_dim"] = head_dim;
    ctx->save_for_backward({x, weight, cos, sin, positions});
    return {q, k, in.narrow(2, q_width + k_width, n - q_width - k_width)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1];
    const int64_t q_width = ctx->saved_data["q_width"].toInt(), k_width = ctx->saved_data["k_width"].toInt();
    const int64_t head_dim = ctx->saved_data["head_dim"].toInt();
    const int64_t b = x.size(0), s = x.size(1), qk = q_width + k_width, v_width = weight.size(0) - qk;
    DSRUN_ASSERT(grads[2].defined(), "the q/k/v projection: v's gradient (v is always read)");
    Tensor d_qk = torch::empty({b, s, qk}, x.options());
    char* out = static_cast<char*>(d_qk.data_ptr());
    const int64_t* rows = RotaryFunction::position_rows(saved[4]);
    int64_t column = 0;
    for (int i : {0, 1}) {
      const int64_t width = i == 0 ? q_width : k_width;
      if (!grads[i].defined()) {
        d_qk.narrow(2, column, width).zero_();
      } else {
        const Tensor g = as_rows(grads[i]);
        dsrun_rotary(g.data_ptr(), g.stride(1), out + column * d_qk.element_size(), qk, saved[2].data_ptr<float>(), saved[3].data_ptr<float>(),
                     rows, b * s, width / head_dim, head_dim, s, /*inverse=*/1, kernel_dtype(g), stream());
        DSRUN_CHECK_LAUNCH();
      }
      column += width;
    }
    // [b · s, width] matrices: v's gradient as attention wrote it where its rows lie evenly (a view), else a copy.
    const Tensor d_qk_rows = d_qk.view({b * s, qk}), d_v_rows = as_rows(grads[2]).reshape({b * s, v_width});
    const Tensor x_rows = x.reshape({b * s, x.size(2)});
    Tensor dx = at::mm(d_qk_rows, weight.narrow(0, 0, qk));
    dx.addmm_(d_v_rows, weight.narrow(0, qk, v_width));
    Tensor dw = torch::empty_like(weight);
    Tensor dw_qk = dw.narrow(0, 0, qk), dw_v = dw.narrow(0, qk, v_width);
    at::mm_out(dw_qk, d_qk_rows.t(), x_rows);
    at::mm_out(dw_v, d_v_rows.t(), x_rows);
    return {dx.view(x.sizes()), dw, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate_up) {
    Tensor in = gate_up.contiguous();
    const int64_t inner = in.size(-1) / 2, rows = in.numel() / in.size(-1);
    std::vector<int64_t> shape = in.sizes().vec();
    shape.back() = inner;
    Tensor out = torch::empty(shape, in.options());
    dsrun_swiglu_forward(in.data_ptr(), out.data_ptr(), rows, inner, kernel_dtype(in), stream());
    DSRUN_CHECK_LAUNCH();
    ctx->save_for_backward({in});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {kernel_backward(ctx->get_saved_variables()[0], grads[0])};
  }
  static Tensor kernel_backward(const Tensor& in, const Tensor& grad) {
    Tensor d_out = grad.contiguous();
    const int64_t inner = in.size(-1) / 2, rows = in.numel() / in.size(-1);
    Tensor d_in = torch::empty_like(in);
    dsrun_swiglu_backward(d_out.data_ptr(), in.data_ptr(), d_in.data_ptr(), rows, inner, kernel_dtype(in), stream());
    DSRUN_CHECK_LAUNCH();
    return d_in;
  }
};

// The combine kernel on contiguous rows [M, H] and place [T·k]: [T, H]; weights fp32 [T·k], or null for 1.
Tensor run_combine_kernel(const Tensor& rows, const Tensor& place, const float* weights, int64_t k) {
  const int64_t tokens = place.numel() / k;
  Tensor out = torch::empty({tokens, rows.size(1)}, rows.options());
  dsrun_combine_rows(rows.data_ptr(), place.data_ptr<int64_t>(), weights, out.data_ptr(), tokens, static_cast<int>(k), rows.size(1), kernel_dtype(rows),
                     stream());
  DSRUN_CHECK_LAUNCH();
  return out;
}

// rows [M, H] (M: the kept pairs), place [T·k], weights [T, k] fp32 -> [T, H].
struct CombineRowsFunction : torch::autograd::Function<CombineRowsFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, const Tensor& place, const Tensor& weights) {
    ctx->save_for_backward({rows, place, weights});
    return run_combine_kernel(rows, place, weights.data_ptr<float>(), weights.size(1));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const Tensor &rows = saved[0], &place = saved[1], &weights = saved[2];
    const Tensor d_out = grads[0].contiguous();
    Tensor d_rows = torch::empty_like(rows), d_weights = torch::empty_like(weights);
    dsrun_combine_rows_backward(d_out.data_ptr(), rows.data_ptr(), place.data_ptr<int64_t>(), weights.data_ptr<float>(), d_rows.data_ptr(),
                                d_weights.data_ptr<float>(), weights.size(0), static_cast<int>(weights.size(1)), rows.size(1), kernel_dtype(rows), stream());
    DSRUN_CHECK_LAUNCH();
    return {d_rows, Tensor(), d_weights};
  }
};

// Whether the rotary kernels run for x [b, s, n] with these tables.
bool rotary_kernel_runs(const Tensor& x, const Tensor& cos) {
  return fused_kernels_active(x) && x.stride(2) == 1 && cos.is_cuda() && cos.scalar_type() == torch::kFloat32;
}

// The table row each token of x reads ([b · s] int64 on x's device), or empty: its index in the row.
// The kernels read the tables' rows by position and the first half of each row.
Tensor rotary_rows(const Tensor& x, const Tensor& positions) {
  return positions.defined() ? positions.to(x.device(), torch::kInt64).contiguous().view({-1}) : torch::empty({0}, x.options().dtype(torch::kInt64));
}

#endif  // DSRUN_WITH_FUSED_KERNELS

}  // namespace

bool fused_kernels_active(const torch::Tensor& x) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  return x.is_cuda() && kernel_dtype_ok(x);
#else
  (void)x;
  return false;
#endif
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (fused_kernels_active(x) && weight.scalar_type() == x.scalar_type() && dsrun_rms_norm_supported(x.size(-1)))
    return RmsNormFunction::apply(x, weight, eps);
#endif
  return rms_norm_reference(x, weight, eps);
}

std::vector<torch::Tensor> rms_norm_with_copy(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (fused_kernels_active(x) && weight.scalar_type() == x.scalar_type() && dsrun_rms_norm_supported(x.size(-1)))
    return ResidualRmsNormFunction::apply(x, weight, eps);
#endif
  return {x.reshape({-1, x.size(-1)}).clone(torch::MemoryFormat::Contiguous), rms_norm(x, weight, eps)};
}

std::vector<torch::Tensor> project_qkv(const torch::Tensor& x, const torch::Tensor& weight, int64_t q_width, int64_t k_width, int64_t head_dim,
                                       const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions) {
  DSRUN_ASSERT(x.dim() == 3 && weight.dim() == 2 && weight.size(1) == x.size(2) && q_width % head_dim == 0 && k_width % head_dim == 0 &&
                   q_width + k_width < weight.size(0),
               "project_qkv takes x [b, s, h] and weight [q | k | v, h]");
  DSRUN_ASSERT(!positions.defined() || positions.numel() == x.size(0) * x.size(1), "rotary: one position per token");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (rotary_kernel_runs(x, cos) && weight.scalar_type() == x.scalar_type() && x.is_contiguous() && weight.is_contiguous())
    return QkvProjectionFunction::apply(x, weight, q_width, k_width, head_dim, cos.contiguous(), sin.contiguous(), rotary_rows(x, positions));
#endif
  return rotate_qkv(torch::linear(x, weight), q_width, k_width, head_dim, cos, sin, positions);
}

std::vector<torch::Tensor> rotate_qkv(const torch::Tensor& qkv, int64_t q_width, int64_t k_width, int64_t head_dim, const torch::Tensor& cos,
                                      const torch::Tensor& sin, const torch::Tensor& positions) {
  // q and k by one split, not two narrows: backward joins their gradients with one copy, where
  // each narrow's would fill a zero tensor of the whole width and add it.
  std::vector<Tensor> qk_v = qkv.split_with_sizes({q_width + k_width, qkv.size(2) - q_width - k_width}, -1);
  std::vector<Tensor> q_k = rotary(qk_v[0], head_dim, cos, sin, positions).split_with_sizes({q_width, k_width}, -1);
  return {q_k[0], q_k[1], qk_v[1]};
}

torch::Tensor rotary(const torch::Tensor& qk, int64_t head_dim, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions) {
  DSRUN_ASSERT(qk.dim() == 3 && qk.size(2) % head_dim == 0 && head_dim % 2 == 0, "rotary takes [b, s, heads · head_dim]");
  DSRUN_ASSERT(!positions.defined() || positions.numel() == qk.size(0) * qk.size(1), "rotary: one position per token");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (rotary_kernel_runs(qk, cos)) return RotaryFunction::apply(qk, head_dim, cos.contiguous(), sin.contiguous(), rotary_rows(qk, positions));
#endif
  return rotary_reference(qk, head_dim, cos, sin, positions);
}

torch::Tensor swiglu(const torch::Tensor& gate_up) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (fused_kernels_active(gate_up)) return SwigluFunction::apply(gate_up);
#endif
  return swiglu_reference(gate_up);
}

torch::Tensor softmax_gradient(torch::Tensor& z, const torch::Tensor& lse, const torch::Tensor& column, const torch::Tensor& here,
                               double scale, const torch::Tensor& factor, torch::ScalarType dtype) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (z.is_cuda() && z.is_contiguous()) {
    Tensor out = torch::empty(z.sizes(), z.options().dtype(dtype));
    const Tensor l = lse.contiguous(), c = column.to(torch::kInt64).contiguous(), h = here.to(torch::kBool).contiguous();
    const Tensor f = factor.defined() ? factor.to(z.device(), torch::kFloat32).contiguous() : Tensor();
    dsrun_softmax_gradient(z.data_ptr<float>(), l.data_ptr<float>(), c.data_ptr<int64_t>(), h.data_ptr<bool>(),
                           f.defined() ? f.data_ptr<float>() : nullptr, static_cast<float>(scale), out.data_ptr(), z.size(0), z.size(1),
                           kernel_dtype(out), stream());
    DSRUN_CHECK_LAUNCH();
    return out;
  }
#endif
  z.sub_(lse.unsqueeze(1)).exp_();
  z.scatter_add_(1, column.unsqueeze(1), here.to(z.scalar_type()).neg().unsqueeze(1));
  z.mul_(scale);
  if (factor.defined()) z.mul_(factor.to(z.device(), torch::kFloat32));
  return z.to(dtype);
}

torch::Tensor cross_entropy_rows(torch::Tensor& z, const torch::Tensor& column, const torch::Tensor& here, double scale, torch::ScalarType dtype,
                                 torch::Tensor lse, torch::Tensor target_logit) {
  DSRUN_ASSERT(z.dim() == 2 && z.scalar_type() == torch::kFloat32 && lse.numel() == z.size(0) && target_logit.numel() == z.size(0),
               "cross_entropy_rows takes fp32 z [rows, V] and one lse and target logit per row");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (z.is_cuda() && z.is_contiguous() && lse.is_contiguous() && target_logit.is_contiguous() &&
      dsrun_cross_entropy_rows_supported(z.data_ptr<float>(), z.size(1))) {
    Tensor out = torch::empty(z.sizes(), z.options().dtype(dtype));
    const Tensor c = column.to(torch::kInt64).contiguous(), h = here.to(torch::kBool).contiguous();
    dsrun_cross_entropy_rows(z.data_ptr<float>(), c.data_ptr<int64_t>(), h.data_ptr<bool>(), static_cast<float>(scale), out.data_ptr(),
                             lse.data_ptr<float>(), target_logit.data_ptr<float>(), z.size(0), z.size(1), kernel_dtype(out), stream());
    DSRUN_CHECK_LAUNCH();
    return out;
  }
#endif
  target_logit.copy_(z.gather(1, column.unsqueeze(1)).squeeze(1).mul(here));
  lse.copy_(row_logsumexp(z));
  return softmax_gradient(z, lse, column, here, scale, Tensor(), dtype);
}

void scale_(torch::Tensor& x, const torch::Tensor& factor) {
  DSRUN_ASSERT(factor.numel() == 1, "scale_ takes a scalar factor");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (fused_kernels_active(x) && x.is_contiguous() && factor.is_cuda() && factor.scalar_type() == torch::kFloat32 && factor.device() == x.device()) {
    dsrun_scale(x.data_ptr(), x.numel(), factor.data_ptr<float>(), kernel_dtype(x), stream());
    DSRUN_CHECK_LAUNCH();
    return;
  }
#endif
  x.mul_(factor.to(x.device()));
}

torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& tensors) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  bool kernels = !tensors.empty();
  for (const Tensor& t : tensors) kernels = kernels && fused_kernels_active(t) && t.is_contiguous() && t.device() == tensors[0].device();
  if (kernels) {
    const int64_t blocks = dsrun_sum_of_squares_blocks();
    Tensor partial = torch::zeros({static_cast<int64_t>(tensors.size()), blocks}, tensors[0].options().dtype(torch::kFloat32));
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].numel() == 0) continue;
      dsrun_sum_of_squares(tensors[i].data_ptr(), tensors[i].numel(), kernel_dtype(tensors[i]), partial.data_ptr<float>() + i * blocks, stream());
      DSRUN_CHECK_LAUNCH();
    }
    return partial.sum(torch::kFloat64);
  }
#endif
  return compat::sum_of_squares(tensors);
}

torch::Tensor combine_rows(const torch::Tensor& rows, const torch::Tensor& place, const torch::Tensor& weights, int64_t k) {
  DSRUN_ASSERT(rows.dim() == 2 && place.dim() == 1 && k > 0 && place.numel() % k == 0 && place.scalar_type() == torch::kInt64, "combine_rows takes rows [M, H] and place [T·k]");
  DSRUN_ASSERT(!weights.defined() || (weights.scalar_type() == torch::kFloat32 && weights.numel() == place.numel()), "combine_rows: fp32 weights, one per pair");
  DSRUN_ASSERT(weights.defined() || !torch::GradMode::is_enabled() || !rows.requires_grad(), "combine_rows without weights is for backward passes");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (fused_kernels_active(rows) && rows.size(1) % 4 == 0 && rows.size(0) > 0 && place.is_cuda()) {
    const Tensor r = rows.contiguous(), p = place.contiguous();
    if (weights.defined()) return CombineRowsFunction::apply(r, p, weights.reshape({place.numel() / k, k}).contiguous());
    return run_combine_kernel(r, p, nullptr, k);
  }
#endif
  return combine_rows_reference(rows, place, weights, k);
}

torch::Tensor row_logsumexp(const torch::Tensor& z) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (z.is_cuda() && z.is_contiguous() && z.dim() == 2 && z.scalar_type() == torch::kFloat32) {
    Tensor lse = torch::empty({z.size(0)}, z.options());
    dsrun_row_logsumexp(z.data_ptr<float>(), lse.data_ptr<float>(), z.size(0), z.size(1), stream());
    DSRUN_CHECK_LAUNCH();
    return lse;
  }
#endif
  return z.logsumexp(1);
}

torch::Tensor swiglu_backward(const torch::Tensor& gate_up, const torch::Tensor& d_out) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (fused_kernels_active(gate_up) && gate_up.is_contiguous()) return SwigluFunction::kernel_backward(gate_up, d_out);
#endif
  torch::AutoGradMode enable(true);
  Tensor in = gate_up.detach().requires_grad_(true);
  return torch::autograd::grad({swiglu_reference(in)}, {in}, {d_out})[0];
}

}  // namespace dsrun::fused
