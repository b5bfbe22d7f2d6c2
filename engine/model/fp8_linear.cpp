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

// fp32 values scaled by max / amax (amax broadcast against them, floored), saturated and rounded to
// FP8, with the inverse scale amax / max the product multiplies back by. Every scaling's expressions.
std::pair<Tensor, Tensor> quantize(const Tensor& values, const Tensor& amax, bool e5m2) {
  const double top = fp8_max(e5m2);
  const Tensor a = amax.clamp_min(kAmaxFloor);
  return {(values * (top / a)).clamp(-top, top).to(compat::fp8_dtype(e5m2)), a / top};
}

// The expressions the kernels compute: scale = max / amax in fp32, x · scale saturated and rounded.
Fp8Operand quantize_reference(const Tensor& x, Fp8Scaling scaling, bool e5m2, bool want_q, bool want_qt) {
  const Tensor xf = x.to(torch::kFloat32);
  Fp8Operand o;
  if (scaling == Fp8Scaling::Rowwise) {
    if (want_q) std::tie(o.q, o.inv_q) = quantize(xf, xf.abs().amax(1, true), e5m2);
    if (want_qt) {
      const Tensor t = xf.t().contiguous();
      std::tie(o.qt, o.inv_t) = quantize(t, t.abs().amax(1, true), e5m2);
    }
  } else {
    const Tensor amax = xf.abs().amax();
    Tensor inv;
    if (want_q) std::tie(o.q, inv) = quantize(xf, amax, e5m2);
    if (want_qt) std::tie(o.qt, inv) = quantize(xf.t().contiguous(), amax, e5m2);
    o.inv_q = o.inv_t = inv.reshape({});
  }
  return o;
}

// Blockwise 1 x 128: each row's blocks of 128 columns scaled apart (x [rows, cols] fp32); the
// scales [rows, cols / 128] column-major, the layout torch's scaled product asks of them.
std::pair<Tensor, Tensor> quantize_row_blocks(const Tensor& xf, bool e5m2) {
  const int64_t rows = xf.size(0), cols = xf.size(1);
  const Tensor blocks = xf.view({rows, cols / 128, 128});
  const auto [q, inv] = quantize(blocks, blocks.abs().amax(2, true), e5m2);
  return {q.view({rows, cols}), inv.view({rows, cols / 128}).t().contiguous().t()};
}

Fp8Operand quantize_blockwise(const Tensor& x, bool e5m2, bool want_q, bool want_qt) {
  const Tensor xf = x.to(torch::kFloat32);
  Fp8Operand o;
  if (want_q) std::tie(o.q, o.inv_q) = quantize_row_blocks(xf, e5m2);
  if (want_qt) std::tie(o.qt, o.inv_t) = quantize_row_blocks(xf.t().contiguous(), e5m2);
  return o;
}

#ifdef DSRUN_WITH_FUSED_KERNELS
// x [rows, cols], or rowwise [batch, rows, cols]: each matrix its own scales, shaped as quantize_fp8
// and quantize_fp8_experts return them.
Fp8Operand quantize_kernels(const Tensor& x, Fp8Scaling scaling, bool e5m2, bool want_q, bool want_qt) {
  const bool batched = x.dim() == 3;
  const int64_t batch = batched ? x.size(0) : 1, rows = x.size(-2), cols = x.size(-1);
  const bool rowwise = scaling == Fp8Scaling::Rowwise;
  DSRUN_ASSERT(rowwise || !batched, "matrices one after another are quantised rowwise");
  const auto f32 = x.options().dtype(torch::kFloat32);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  Tensor row_amax = rowwise && want_q ? torch::empty({batch * rows}, f32) : Tensor();
  Tensor col_amax = rowwise && want_qt ? torch::empty({batch * cols}, f32) : Tensor();
  Tensor amax = rowwise ? Tensor() : torch::empty({1}, f32);
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  dsrun_fp8_amax(x.data_ptr(), batch, rows, cols, ptr(row_amax), ptr(col_amax), ptr(amax), stream);
  DSRUN_CHECK_LAUNCH();
  Fp8Operand o;
  const auto fp8 = x.options().dtype(compat::fp8_dtype(e5m2));
  auto shaped = [&](int64_t a, int64_t b) { return batched ? std::vector<int64_t>{batch, a, b} : std::vector<int64_t>{a, b}; };
  if (want_q) o.q = torch::empty(shaped(rows, cols), fp8);
  if (want_qt) o.qt = torch::empty(shaped(cols, rows), fp8);
  if (rowwise) {
    if (want_q) o.inv_q = torch::empty(batched ? std::vector<int64_t>{batch, rows} : std::vector<int64_t>{rows, 1}, f32);
    if (want_qt) o.inv_t = torch::empty(batched ? std::vector<int64_t>{batch, cols} : std::vector<int64_t>{cols, 1}, f32);
  } else {
    o.inv_q = torch::empty({}, f32);
    o.inv_t = o.inv_q;
  }
  dsrun_fp8_quantize(x.data_ptr(), batch, rows, cols, e5m2 ? 1 : 0, rowwise ? 1 : 0, rowwise ? ptr(row_amax) : ptr(amax), ptr(col_amax),
                     want_q ? o.q.data_ptr() : nullptr, want_qt ? o.qt.data_ptr() : nullptr, ptr(o.inv_q), rowwise ? ptr(o.inv_t) : nullptr, stream);
  DSRUN_CHECK_LAUNCH();
  return o;
}

// Blockwise in one kernel: 1 x 128 blocks both ways (square = false), or 128 x 128 (a weight's).
Fp8Operand quantize_blocks_kernel(const Tensor& x, bool square, bool e5m2, bool want_q, bool want_qt) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const auto f32 = x.options().dtype(torch::kFloat32), fp8 = x.options().dtype(compat::fp8_dtype(e5m2));
  Fp8Operand o;
  if (want_q) {
    o.q = torch::empty({rows, cols}, fp8);
    o.inv_q = square ? torch::empty({rows / 128, cols / 128}, f32) : torch::empty({cols / 128, rows}, f32).t();
  }
  if (want_qt) {
    o.qt = torch::empty({cols, rows}, fp8);
    o.inv_t = square ? torch::empty({cols / 128, rows / 128}, f32) : torch::empty({rows / 128, cols}, f32).t();
  }
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  dsrun_fp8_quantize_blocks(x.data_ptr(), rows, cols, e5m2 ? 1 : 0, square ? 1 : 0, ptr(o.q), ptr(o.qt), static_cast<float*>(ptr(o.inv_q)),
                            static_cast<float*>(ptr(o.inv_t)), at::cuda::getCurrentCUDAStream(x.device().index()).stream());
  DSRUN_CHECK_LAUNCH();
  return o;
}

// Where the kernels take x as it is: a CUDA bf16 matrix read 16 bytes at a time (and written 8).
bool kernels_take(const Tensor& x, int64_t multiple) {
  return x.is_cuda() && x.size(-2) % multiple == 0 && x.size(-1) % multiple == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
}
#endif

// A product's scales as _scaled_mm takes them for its second operand b [K, N] (column-major, the
// transpose of the operand quantised): tensorwise as they are, rowwise [1, N], blockwise the
// transpose of the quantised operand's (torch checks b's scales transposed against bᵀ).
Tensor as_b_scale(const Tensor& inv, Fp8Scaling scaling) {
  if (scaling == Fp8Scaling::Rowwise) return inv.view({1, -1});
  if (scaling == Fp8Scaling::Blockwise) return inv.t();
  return inv;
}

// Blockwise: the weight [n, k] in 128 x 128 blocks where cuBLASLt reads their scales as laid out.
// It takes no leading dimension for them and reads rows padded to 16 bytes (PyTorch's tests pad
// them; its _scaled_mm accepts no padding), so both n / 128 and k / 128 must be multiples of 4
// (forward reads the weight's scales, the input gradient its transpose's). Otherwise the weight is
// quantised like the activations, 1 x 128 along each product's summed dimension (two passes).
bool square_weight_blocks(Fp8Scaling scaling, int64_t n, int64_t k) { return scaling == Fp8Scaling::Blockwise && (n / 128) % 4 == 0 && (k / 128) % 4 == 0; }

struct Fp8LinearFunction : torch::autograd::Function<Fp8LinearFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, int64_t scaling_index) {
    const auto scaling = static_cast<Fp8Scaling>(scaling_index);
    const int64_t k = weight.size(1), n = weight.size(0);
    const Tensor x2 = x.reshape({-1, k}).contiguous();
    const Fp8Operand xq = quantize_fp8(x2, scaling, false, true, weight.requires_grad());
    // The weight's transpose too, in the same pass: backward's input gradient takes it (one byte a
    // parameter kept until then, against a second pass over the weight).
    const Fp8Operand wq = square_weight_blocks(scaling, n, k) ? quantize_fp8_weight_blocks(weight.contiguous()) : quantize_fp8(weight.contiguous(), scaling, false, true, true);
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
    // E5M2 x E4M3 rowwise products ran slower (docs/benchmarks.md); per block, as DeepSeek-V3, E4M3.
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
  DSRUN_ASSERT(scaling != Fp8Scaling::None, "an FP8 scaling");
  if (scaling == Fp8Scaling::Blockwise) {
    DSRUN_ASSERT((!want_q || x.size(1) % 128 == 0) && (!want_qt || x.size(0) % 128 == 0), "blocks of 128 along the summed dimension (fp8_linear checks)");
#ifdef DSRUN_WITH_FUSED_KERNELS
    if (!reference && kernels_take(x, 128)) return quantize_blocks_kernel(x, /*square=*/false, e5m2, want_q, want_qt);
#endif
    return quantize_blockwise(x, e5m2, want_q, want_qt);
  }
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (!reference && scaling == Fp8Scaling::Rowwise && want_q && !want_qt && x.is_cuda() && x.size(1) % 8 == 0 &&
      x.size(1) <= dsrun_fp8_quantize_rows_max_cols() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) {
    // One pass: a row's maximum, then its scaling, from registers (the routed experts' operands).
    Fp8Operand o;
    o.q = torch::empty({x.size(0), x.size(1)}, x.options().dtype(compat::fp8_dtype(e5m2)));
    o.inv_q = torch::empty({x.size(0), 1}, x.options().dtype(torch::kFloat32));
    dsrun_fp8_quantize_rows(x.data_ptr(), x.size(0), x.size(1), e5m2 ? 1 : 0, o.q.data_ptr(), o.inv_q.data_ptr<float>(),
                            at::cuda::getCurrentCUDAStream(x.device().index()).stream());
    DSRUN_CHECK_LAUNCH();
    return o;
  }
  if (!reference && kernels_take(x, 8)) return quantize_kernels(x, scaling, e5m2, want_q, want_qt);
#endif
  return quantize_reference(x, scaling, e5m2, want_q, want_qt);
}

Fp8Operand quantize_fp8_weight_blocks(const Tensor& weight, bool reference) {
  DSRUN_ASSERT(weight.dim() == 2 && weight.size(0) % 128 == 0 && weight.size(1) % 128 == 0, "a weight in whole 128 x 128 blocks (fp8_linear checks)");
  DSRUN_ASSERT(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous(), "FP8 operands come from a contiguous bf16 matrix");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (!reference && kernels_take(weight, 128)) return quantize_blocks_kernel(weight, /*square=*/true, false, true, true);
#endif
  const int64_t rows = weight.size(0), cols = weight.size(1);
  const Tensor blocks = weight.to(torch::kFloat32).view({rows / 128, 128, cols / 128, 128});
  const auto [q, inv] = quantize(blocks, blocks.abs().amax({1, 3}, true), false);
  Fp8Operand o;
  o.q = q.view({rows, cols});
  o.qt = o.q.t().contiguous();
  o.inv_q = inv.view({rows / 128, cols / 128});
  o.inv_t = o.inv_q.t().contiguous();
  return o;
}

Fp8Operand quantize_fp8_experts(const Tensor& w, bool want_q, bool want_qt, bool reference) {
  DSRUN_ASSERT(w.dim() == 3 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "FP8 expert operands come from contiguous bf16 [experts, rows, cols]");
#ifdef DSRUN_WITH_FUSED_KERNELS
  if (!reference && kernels_take(w, 8)) return quantize_kernels(w, Fp8Scaling::Rowwise, false, want_q, want_qt);
#endif
  const Tensor wf = w.to(torch::kFloat32);
  Fp8Operand o;
  if (want_q) {
    std::tie(o.q, o.inv_q) = quantize(wf, wf.abs().amax(2, true), false);
    o.inv_q = o.inv_q.squeeze(2);
  }
  if (want_qt) {
    const Tensor t = wf.transpose(1, 2).contiguous();
    std::tie(o.qt, o.inv_t) = quantize(t, t.abs().amax(2, true), false);
    o.inv_t = o.inv_t.squeeze(2);
  }
  return o;
}

Tensor fp8_linear(const Tensor& x, const Tensor& weight, Fp8Scaling scaling) {
  if (scaling == Fp8Scaling::None) return torch::linear(x, weight);
  const int64_t k = weight.size(1), n = weight.size(0), rows = x.numel() / std::max<int64_t>(1, k);
  const bool blockwise = scaling == Fp8Scaling::Blockwise;
  const int64_t multiple = blockwise ? 128 : 16;
  if (k % multiple != 0 || n % multiple != 0 || rows % multiple != 0) {
    ErrorContext c;
    c.key = "precision.fp8";
    c.hint = blockwise ? "blockwise FP8 scales whole blocks of 128 (no padding): tokens per micro-batch (batch.micro x batch.seq_len) and each layer's sizes "
                         "(after the tensor split) in multiples of 128, or precision.fp8 = \"rowwise\""
                       : "FP8 products need sizes in multiples of 16: tokens per micro-batch (batch.micro x batch.seq_len) and the layer's sizes";
    throw Error("an FP8 linear layer of [" + std::to_string(n) + ", " + std::to_string(k) + "] got " + std::to_string(rows) + " rows, not all multiples of " +
                    std::to_string(multiple),
                c);
  }
  if (blockwise && !compat::kHasBlockwiseScaledMm) {
    ErrorContext c;
    c.key = "precision.fp8";
    c.hint = "use precision.fp8 = \"rowwise\", or build against PyTorch 2.9 or later (scripts/gpu_build.sh)";
    throw Error("blockwise FP8 products need PyTorch 2.9 or later (this build's scaled products take tensor and row scales only)", c);
  }
  return Fp8LinearFunction::apply(x, weight, static_cast<int64_t>(scaling));
}

}  // namespace dsrun
