#include "engine/model/fp8_linear.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"

#ifdef DSRUN_WITH_FUSED_KERNELS
#include "engine/model/fused_kernels.h"

#include <ATen/cuda/CUDAContext.h>
#endif

namespace dsrun {

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kAmaxFloor = 1e-12;  // the kernels' floor too: an all-zero row stays zero

double fp8_max(bool e5m2) { return e5m2 ? 57344.0 : 448.0; }

// The expressions the kernels compute: scale = max / amax in fp32, x · scale saturated and rounded.
Fp8Operand quantize_reference(const Tensor& x, Fp8Scaling scaling, bool e5m2, bool want_q, bool want_qt) {
  const double top = fp8_max(e5m2);
  const Tensor xf = x.to(torch::kFloat32);
  const torch::ScalarType kind = compat::fp8_dtype(e5m2);
  auto quantize = [&](const Tensor& values, const Tensor& amax) {
    const Tensor a = amax.clamp_min(kAmaxFloor);
    return std::make_pair((values * (top / a)).clamp(-top, top).to(kind), a / top);
  };
  Fp8Operand o;
  if (scaling == Fp8Scaling::Rowwise) {
    if (want_q) std::tie(o.q, o.inv_q) = quantize(xf, xf.abs().amax(1, true));
    if (want_qt) {
      const Tensor t = xf.t().contiguous();
      std::tie(o.qt, o.inv_t) = quantize(t, t.abs().amax(1, true));
    }
  } else {
    const Tensor amax = xf.abs().amax();
    Tensor inv;
    if (want_q) std::tie(o.q, inv) = quantize(xf, amax);
    if (want_qt) std::tie(o.qt, inv) = quantize(xf.t().contiguous(), amax);
    o.inv_q = o.inv_t = inv.reshape({});
  }
  return o;
}

#ifdef DSRUN_WITH_FUSED_KERNELS
Fp8Operand quantize_kernels(const Tensor& x, Fp8Scaling scaling, bool e5m2, bool want_q, bool want_qt) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const bool rowwise = scaling == Fp8Scaling::Rowwise;
  const auto f32 = x.options().dtype(torch::kFloat32);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  Tensor row_amax = rowwise && want_q ? torch::empty({rows}, f32) : Tensor();
  Tensor col_amax = rowwise && want_qt ? torch::empty({cols}, f32) : Tensor();
  Tensor amax = rowwise ? Tensor() : torch::empty({1}, f32);
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  dsrun_fp8_amax(x.data_ptr(), rows, cols, ptr(row_amax), ptr(col_amax), ptr(amax), stream);
  DSRUN_CHECK_LAUNCH();
  Fp8Operand o;
  const auto fp8 = x.options().dtype(compat::fp8_dtype(e5m2));
  if (want_q) o.q = torch::empty({rows, cols}, fp8);
  if (want_qt) o.qt = torch::empty({cols, rows}, fp8);
  if (rowwise) {
    if (want_q) o.inv_q = torch::empty({rows, 1}, f32);
    if (want_qt) o.inv_t = torch::empty({cols, 1}, f32);
  } else {
    o.inv_q = torch::empty({}, f32);
    o.inv_t = o.inv_q;
  }
  dsrun_fp8_quantize(x.data_ptr(), rows, cols, e5m2 ? 1 : 0, rowwise ? 1 : 0, rowwise ? ptr(row_amax) : ptr(amax), ptr(col_amax),
                     want_q ? o.q.data_ptr() : nullptr, want_qt ? o.qt.data_ptr() : nullptr, ptr(o.inv_q),
                     rowwise ? ptr(o.inv_t) : nullptr, stream);
  DSRUN_CHECK_LAUNCH();
  return o;
}
#endif

// A product's scales as _scaled_mm takes them: tensorwise as they are, rowwise a's [M, 1] and b's [1, N].
Tensor as_b_scale(const Tensor& inv, Fp8Scaling scaling) { return scaling == Fp8Scaling::Rowwise ? inv.view({1, -1}) : inv; }

struct Fp8LinearFunction : torch::autograd::Function<Fp8LinearFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, int64_t scaling_index) {
    const auto scaling = static_cast<Fp8Scaling>(scaling_index);
    const int64_t k = weight.size(1), n = weight.size(0);
    const Tensor x2 = x.reshape({-1, k}).contiguous();
    const Fp8Operand xq = quantize_fp8(x2, scaling, false, true, weight.requires_grad());
    // The weight's transpose too, in the same pass: backward's input gradient takes it (one byte a
    // parameter kept until then, against a second pass over the weight).
    const Fp8Operand wq = quantize_fp8(weight.contiguous(), scaling, false, true, true);
    const Tensor y = compat::scaled_mm(xq.q, wq.q.t(), xq.inv_q, as_b_scale(wq.inv_q, scaling));
    ctx->save_for_backward({xq.qt, xq.inv_t, wq.qt, wq.inv_t});
    ctx->saved_data["scaling"] = scaling_index;
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    return y.view(shape);
  }

  // dx = g · w (g's rows by w's columns), dw = gᵀ · x (g's columns by x's columns): each operand on
  // the side of the product it sits, with its scales along the dimension that is not summed.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto scaling = static_cast<Fp8Scaling>(ctx->saved_data["scaling"].toInt());
    const std::vector<Tensor> saved = ctx->get_saved_variables();
    const Tensor &xqt = saved[0], &x_inv_t = saved[1], &wqt = saved[2], &w_inv_t = saved[3];
    const int64_t k = wqt.size(0), n = wqt.size(1);
    const Tensor g = grads[0].reshape({-1, n}).contiguous();
    const bool want_dw = xqt.defined();
    // Gradients as E5M2 under one scale per tensor (their range needs the exponent bits); per row,
    // as torchao's rowwise recipe, E4M3: each row's own scale covers its range, and cuBLAS's
    // E5M2 x E4M3 rowwise products ran slower (docs/benchmarks.md).
    const Fp8Operand gq = quantize_fp8(g, scaling, scaling == Fp8Scaling::Tensorwise, true, want_dw);
    Tensor dx = compat::scaled_mm(gq.q, wqt.t(), gq.inv_q, as_b_scale(w_inv_t, scaling));
    std::vector<int64_t> shape = grads[0].sizes().vec();
    shape.back() = k;
    Tensor dw = want_dw ? compat::scaled_mm(gq.qt, xqt.t(), gq.inv_t, as_b_scale(x_inv_t, scaling)) : Tensor();
    return {dx.view(shape), dw, Tensor()};
  }
};

}  // namespace

Fp8Operand quantize_fp8(const Tensor& x, Fp8Scaling scaling, bool e5m2, bool want_q, bool want_qt, bool reference) {
  DSRUN_ASSERT(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "FP8 operands come from a contiguous bf16 matrix");
  DSRUN_ASSERT(scaling == Fp8Scaling::Tensorwise || scaling == Fp8Scaling::Rowwise, "tensorwise or rowwise scaling (blockwise is refused by the recipe)");
#ifdef DSRUN_WITH_FUSED_KERNELS
  // (the kernels read 16 bytes and write 8 at a time)
  if (!reference && x.is_cuda() && x.size(1) % 8 == 0 && x.size(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0)
    return quantize_kernels(x, scaling, e5m2, want_q, want_qt);
#endif
  return quantize_reference(x, scaling, e5m2, want_q, want_qt);
}

Tensor fp8_linear(const Tensor& x, const Tensor& weight, Fp8Scaling scaling) {
  if (scaling == Fp8Scaling::None) return torch::linear(x, weight);
  const int64_t k = weight.size(1), n = weight.size(0), rows = x.numel() / std::max<int64_t>(1, k);
  if (k % 16 != 0 || n % 16 != 0 || rows % 16 != 0) {
    ErrorContext c;
    c.key = "precision.fp8";
    c.hint = "FP8 products need sizes in multiples of 16: tokens per micro-batch (batch.micro x batch.seq_len) and the layer's sizes";
    throw Error("an FP8 linear layer of [" + std::to_string(n) + ", " + std::to_string(k) + "] got " + std::to_string(rows) + " rows", c);
  }
  return Fp8LinearFunction::apply(x, weight, static_cast<int64_t>(scaling));
}

}  // namespace dsrun
