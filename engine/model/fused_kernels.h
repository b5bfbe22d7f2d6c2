// CUDA kernels for the decoder's elementwise work (RMSNorm, rotary embedding, SwiGLU, the loss's
// softmax, a MoE layer's combine), forward and backward, one pass over memory each: a flat C
// interface on raw pointers, so nvcc compiles no torch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

extern "C" {

// Element types of activations and weights; norms and rotations compute in fp32 whatever they are.
enum DsrunFusedDType { DSRUN_F32 = 0, DSRUN_BF16 = 1, DSRUN_F16 = 2 };

// Row sizes the RMSNorm kernels take: cols a multiple of 128, at most 8192 (others take the reference ops).
int dsrun_rms_norm_supported(int64_t cols);
// The number of partial weight-gradient rows dsrun_rms_norm_backward writes (sum them over rows).
int dsrun_rms_norm_partials(int64_t rows);

// y = (x · rstd) · w, rstd = 1/sqrt(mean(x²) + eps) per row of x [rows, cols]; the normalised
// value is rounded to the element type before the weight multiplies it (as the reference does).
// x_copy, if not null, gets a copy of x.
void dsrun_rms_norm_forward(const void* x, const void* w, void* y, float* rstd, void* x_copy, int64_t rows, int64_t cols, float eps,
                            int dtype, cudaStream_t stream);
// out [cols] in `dtype` = the sum over rows of partial [rows, cols] fp32 (in row order, rounded once):
// dw from the RMSNorm backward's partial sums.
void dsrun_column_sum(const float* partial, int64_t rows, int64_t cols, void* out, int dtype, cudaStream_t stream);
// dx and partial sums of dw ([dsrun_rms_norm_partials(rows), cols], fp32) from dy, x, w, rstd;
// d_add, if not null ([rows, cols]), is added to dx in fp32 (the gradient of x's copy).
void dsrun_rms_norm_backward(const void* dy, const void* x, const void* w, const float* rstd, const void* d_add, void* dx, float* dw_partial,
                             int64_t rows, int64_t cols, int dtype, cudaStream_t stream);

// Rotates the first half of each head against its second half (Llama layout), in fp32:
// out1 = x1·cos - x2·sin, out2 = x2·cos + x1·sin. in: [tokens, heads·head_dim] with row stride
// in_stride (elements); out: [tokens, heads·head_dim] with row stride out_stride; cos/sin:
// [>= seq, head_dim] fp32 with equal halves (the first half is read);
// token t sits at position positions[t] ([tokens] int64; documents packed in a row), or where
// positions is null at t % seq. inverse = 1 rotates by -angle (the backward).
void dsrun_rotary(const void* in, int64_t in_stride, void* out, int64_t out_stride, const float* cos, const float* sin,
                  const int64_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, int64_t seq, int inverse, int dtype,
                  cudaStream_t stream);

// out[r, j] = silu(g) · u with g = gate_up[r, j], u = gate_up[r, inner + j]; gate_up [rows, 2·inner].
void dsrun_swiglu_forward(const void* gate_up, void* out, int64_t rows, int64_t inner, int dtype, cudaStream_t stream);
// d_gate_up [rows, 2·inner] from d_out [rows, inner] and gate_up.
void dsrun_swiglu_backward(const void* d_out, const void* gate_up, void* d_gate_up, int64_t rows, int64_t inner, int dtype,
                           cudaStream_t stream);

// The token cross-entropy's gradient with respect to a chunk of fp32 logits z [rows, cols]:
// out = (exp(z - lse[r]) - one_hot(target[r]) where here[r]) · scale · (*scale_ptr unless null),
// in the element type `dtype`; lse, the log-sum-exp of each row over the whole vocabulary.
void dsrun_softmax_gradient(const float* z, const float* lse, const int64_t* target, const bool* here, const float* scale_ptr, float scale,
                            void* out, int64_t rows, int64_t cols, int dtype, cudaStream_t stream);

// The loss and its gradient on a chunk of fp32 logits z [rows, cols] in one kernel: lse[r] (log Σ
// exp over the row), target_logit[r] (z[r, target[r]] where here[r], else 0) and grad =
// (exp(z - lse[r]) - one_hot(target[r]) where here[r]) · scale in `dtype`. Only where
// dsrun_cross_entropy_rows_supported (cols a multiple of 4, z 16-byte aligned).
int dsrun_cross_entropy_rows_supported(const float* z, int64_t cols);
void dsrun_cross_entropy_rows(const float* z, const int64_t* target, const bool* here, float scale, void* grad, float* lse, float* target_logit,
                              int64_t rows, int64_t cols, int dtype, cudaStream_t stream);

// Σ x² over x's n elements in fp32, as partial sums: partial[b] for the first blocks b it uses, at
// most dsrun_sum_of_squares_blocks() of them (the rest untouched).
int dsrun_sum_of_squares_blocks(void);
void dsrun_sum_of_squares(const void* x, int64_t n, int dtype, float* partial, cudaStream_t stream);

// x[i] *= *factor for i < n (factor on the device), computed in fp32.
void dsrun_scale(void* x, int64_t n, const float* factor, int dtype, cudaStream_t stream);

// lse[r] = log Σ_c exp(z[r, c]) over each row of fp32 z [rows, cols], in one pass over z.
void dsrun_row_logsumexp(const float* z, float* lse, int64_t rows, int64_t cols, cudaStream_t stream);

// FP8 operands (engine/model/fp8_linear.cpp), of a bf16 matrix x [rows, cols] (rows and cols
// multiples of 8, x 16-byte aligned), or of `batch` of them one after another (rowwise only: each
// its own maxima and scales, the outputs likewise one after another; a MoE layer's experts). dsrun_fp8_amax: the maxima of |x| asked for (null: not wanted) per row
// [rows], per column [cols] and whole [1], zeroed first. dsrun_fp8_quantize: q = x · (max / amax) in
// x's layout and qt the same of xᵀ ([cols, rows]), either null when not wanted, FP8 of `kind` (0 E4M3,
// 1 E5M2; saturating); rowwise = 1: q's scale from amax_q per row, qt's from amax_t per column, inverse
// scales to inv_q [rows] and inv_t [cols]; rowwise = 0: both from amax_q[0], its inverse to inv_q[0].
void dsrun_fp8_amax(const void* x, int64_t batch, int64_t rows, int64_t cols, float* row_amax, float* col_amax, float* tensor_amax, cudaStream_t stream);
void dsrun_fp8_quantize(const void* x, int64_t batch, int64_t rows, int64_t cols, int kind, int rowwise, const float* amax_q, const float* amax_t,
                        void* q, void* qt, float* inv_q, float* inv_t, cudaStream_t stream);
// Rowwise q alone (no transpose) in one pass, a warp a row kept in registers: x [rows, cols] with cols
// a multiple of 8 and at most dsrun_fp8_quantize_rows_max_cols(); inv_q [rows].
int64_t dsrun_fp8_quantize_rows_max_cols(void);
void dsrun_fp8_quantize_rows(const void* x, int64_t rows, int64_t cols, int kind, void* q, float* inv_q, cudaStream_t stream);
// Blockwise, in one pass (rows and cols multiples of 128): square = 0: q's scales per 1 x 128 block of
// a row to inv_q [rows, cols / 128] column-major, qt's per 128 rows of a column to inv_t [cols, rows /
// 128] column-major; square = 1: one scale per 128 x 128 block for both, inv_q [rows / 128, cols /
// 128] row-major and inv_t its transpose. q, qt, inv_q and inv_t may be null when not wanted (in pairs).
void dsrun_fp8_quantize_blocks(const void* x, int64_t rows, int64_t cols, int kind, int square, void* q, void* qt, float* inv_q, float* inv_t,
                               cudaStream_t stream);

// A MoE layer's combine: out[t] = Σ_i w[t·k + i] · src[place[t·k + i]] for t < tokens, i < k,
// accumulated in fp32 (place < 0: a dropped pair, skipped; w null: weights of 1). src [any, cols],
// out [tokens, cols], cols a multiple of 4; w fp32 [tokens · k].
void dsrun_combine_rows(const void* src, const int64_t* place, const float* w, void* out, int64_t tokens, int k, int64_t cols, int dtype,
                        cudaStream_t stream);
// Its gradient: d_src[place[p]] = w[p] · d_out[t] (rows no pair names are left as they are) and
// d_w[p] = Σ_c d_out[t, c] · src[place[p], c] (0 for a dropped pair), p = t·k + i; w and d_w fp32.
void dsrun_combine_rows_backward(const void* d_out, const void* src, const int64_t* place, const float* w, void* d_src, float* d_w,
                                 int64_t tokens, int k, int64_t cols, int dtype, cudaStream_t stream);
// The last launch error as text, or nullptr: callers turn it into an exception with file:line.
const char* dsrun_fused_last_error(void);
}

// For the C++ callers (with engine/common/error.hpp): after a call above, its launch error as a
// dsrun::Error naming the caller's file:line.
#define DSRUN_CHECK_LAUNCH()                                                                                                   \
  do {                                                                                                                        \
    if (const char* e = dsrun_fused_last_error()) ::dsrun::fail_at(__FILE__, __LINE__, std::string("CUDA kernel launch failed: ") + e); \
  } while (0)
