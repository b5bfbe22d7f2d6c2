// FP8 linear layers (precision.fp8): y = x · wᵀ with the forward product and both gradients' as
// torch's scaled FP8 products (torchao's float8 training, three products in one autograd function).
#pragma once

#include "engine/recipe/kinds.hpp"

#include <torch/torch.h>

namespace dsrun {

// y [..., N] = x [..., K] · weightᵀ (weight [N, K]), x and weight bf16, y bf16. x and weight as E4M3,
// the output's gradient as E5M2 (tensorwise) or E4M3 (rowwise, blockwise), each scaled from its own
// maximum now (per tensor; per row for the product's rows and per column for the transposed
// operands backward reads; blockwise, DeepSeek-V3's: per 128 elements of a row for activations and
// gradients, along the summed dimension of each product, and per 128 x 128 block for the weight
// where its sizes / 128 are multiples of 4, as cuBLASLt reads those scales; per 1 x 128 otherwise);
// fp32 accumulation. Forward keeps x's and the weight's transposed FP8 copies (a byte an element)
// for backward. K, N and the rows of x (its elements / K) must be multiples of 16 (blockwise: 128,
// refused otherwise, naming precision.fp8). scaling None: torch::linear.
torch::Tensor fp8_linear(const torch::Tensor& x, const torch::Tensor& weight, Fp8Scaling scaling);

// One matrix's FP8 operands: q in its layout and qt of its transpose (either undefined when not
// asked for), and the inverse scales the product multiplies back by: tensorwise one element for
// both (inv_q; inv_t the same tensor); rowwise inv_q [rows, 1] for q's rows and inv_t [cols, 1] for
// qt's rows (x's columns); blockwise 1 x 128 (quantize_fp8) inv_q [rows, cols / 128] and inv_t
// [cols, rows / 128], each column-major as torch's scaled product reads them; blockwise 128 x 128
// (quantize_fp8_weight_blocks) inv_q [rows / 128, cols / 128] and inv_t its transpose, row-major.
struct Fp8Operand {
  torch::Tensor q, qt, inv_q, inv_t;
};

// x [rows, cols] bf16 (contiguous) quantised: on CUDA builds by engine/model/kernels/fp8_quantize.cu
// (tensorwise and rowwise: the maxima, then q and qt in one pass; blockwise: one pass); elsewhere,
// and with reference = true, the libtorch expressions the kernels compute.
Fp8Operand quantize_fp8(const torch::Tensor& x, Fp8Scaling scaling, bool e5m2, bool want_q, bool want_qt, bool reference = false);
// A weight [rows, cols] (bf16, contiguous, multiples of 128) as E4M3 in 128 x 128 blocks, q and qt
// both: the blocks of the transpose are the same blocks, so one quantisation serves forward and
// backward. reference as above.
Fp8Operand quantize_fp8_weight_blocks(const torch::Tensor& weight, bool reference = false);
// A MoE layer's routed expert weights w [E, rows, cols] (bf16, contiguous) as E4M3, each expert
// rowwise on its own: q [E, rows, cols] with inv_q [E, rows] (per row), qt [E, cols, rows] (each
// expert's transpose) with inv_t [E, cols] (per column of w), the layouts and scales torch's grouped
// scaled product takes. One pass for the maxima and one for both copies. reference as above.
Fp8Operand quantize_fp8_experts(const torch::Tensor& w, bool want_q, bool want_qt, bool reference = false);

}  // namespace dsrun
