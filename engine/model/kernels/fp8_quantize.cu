// FP8 operands for scaled matrix products (engine/model/fp8_linear): the maxima of a bf16 matrix
// (per row, per column, whole), then the matrix and its transpose quantised in one pass.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernels/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace {

using namespace dsrun_kernels;

// A 64 x 64 tile a block: 8 warps of 32 threads, each thread two adjacent columns (one 4-byte
// load: a warp reads a row's 128 bytes) of every 8th row.
constexpr int kTile = 64, kWarps = 8;

// Maxima of |x| of non-negative floats: their bit patterns order as unsigned integers do.
__device__ inline void atomic_max_nonnegative(float* at, float v) { atomicMax(reinterpret_cast<unsigned int*>(at), __float_as_uint(v)); }

__device__ inline float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__global__ void __launch_bounds__(256) amax_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax,
                                                   float* tensor_amax) {
  __shared__ float columns[kWarps][kTile];
  __shared__ float warps[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r0 = blockIdx.y * int64_t{kTile}, c = blockIdx.x * int64_t{kTile} + 2 * lane;
  float col0 = 0, col1 = 0, all = 0;
  for (int i = warp; i < kTile; i += kWarps) {
    const int64_t r = r0 + i;
    float a = 0, b = 0;
    if (r < rows && c < cols) {  // cols is even (checked by the caller)
      const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(x + r * cols + c);
      a = fabsf(__bfloat162float(v.x));
      b = fabsf(__bfloat162float(v.y));
    }
    col0 = fmaxf(col0, a);
    col1 = fmaxf(col1, b);
    if (row_amax) {
      const float m = warp_max(fmaxf(a, b));
      if (lane == 0 && r < rows) atomic_max_nonnegative(row_amax + r, m);
    }
  }
  all = fmaxf(col0, col1);
  if (col_amax) {
    columns[warp][2 * lane] = col0;
    columns[warp][2 * lane + 1] = col1;
    __syncthreads();
    if (warp == 0)
      for (int j = lane; j < kTile; j += 32) {
        float m = 0;
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, columns[w][j]);
        if (blockIdx.x * int64_t{kTile} + j < cols) atomic_max_nonnegative(col_amax + blockIdx.x * int64_t{kTile} + j, m);
      }
  }
  if (tensor_amax) {
    all = warp_max(all);
    if (lane == 0) warps[warp] = all;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = 0;
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warps[w]);
      atomic_max_nonnegative(tensor_amax, m);
    }
  }
}

// The largest finite value of each FP8 kind (E4M3 "fn": 448; E5M2: 57344), and the smallest maximum
// a scale is taken from (an all-zero row scales by 448 / 1e-12 and stays zero).
__device__ inline float fp8_max(int kind) { return kind == 0 ? 448.0f : 57344.0f; }
constexpr float kAmaxFloor = 1e-12f;

__device__ inline uint16_t to_fp8x2(float a, float b, int kind) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind == 0 ? __NV_E4M3 : __NV_E5M2);
}

// q = x · (max / amax) as FP8 in x's layout and qT the same of xᵀ; rowwise: q's scale per row of x
// (amax_q[r]) and qT's per column (amax_t[c]); tensorwise: both amax_q[0]. Inverse scales (what the
// product multiplies back by) go to inv_q and inv_t (tensorwise: inv_q[0] alone).
__global__ void __launch_bounds__(256) quantize_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int kind, int rowwise,
                                                       const float* amax_q, const float* amax_t, uint8_t* q, uint8_t* qt, float* inv_q, float* inv_t) {
  __shared__ float tile[kTile][kTile + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r0 = blockIdx.y * int64_t{kTile}, c0 = blockIdx.x * int64_t{kTile};
  const int64_t c = c0 + 2 * lane;
  const float top = fp8_max(kind);
  const float whole = rowwise ? 0.0f : top / fmaxf(amax_q[0], kAmaxFloor);
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv_q[0] = fmaxf(amax_q[0], kAmaxFloor) / top;
  for (int i = warp; i < kTile; i += kWarps) {
    const int64_t r = r0 + i;
    float a = 0, b = 0;
    if (r < rows && c < cols) {
      const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(x + r * cols + c);
      a = __bfloat162float(v.x);
      b = __bfloat162float(v.y);
      if (q) {
        const float s = rowwise ? top / fmaxf(amax_q[r], kAmaxFloor) : whole;
        *reinterpret_cast<uint16_t*>(q + r * cols + c) = to_fp8x2(a * s, b * s, kind);
      }
      if (rowwise && c0 == 0 && lane == 0 && inv_q) inv_q[r] = fmaxf(amax_q[r], kAmaxFloor) / top;
    }
    tile[i][2 * lane] = a;
    tile[i][2 * lane + 1] = b;
  }
  if (!qt) return;
  __syncthreads();
  // qT [cols, rows]: row j of the tile's transpose is column c0 + j of x; a thread writes two rows' values.
  for (int j = warp; j < kTile; j += kWarps) {
    const int64_t cc = c0 + j, rr = r0 + 2 * lane;
    if (cc >= cols || rr >= rows) continue;
    const float s = rowwise ? top / fmaxf(amax_t[cc], kAmaxFloor) : whole;
    if (rr + 1 < rows) {
      *reinterpret_cast<uint16_t*>(qt + cc * rows + rr) = to_fp8x2(tile[2 * lane][j] * s, tile[2 * lane + 1][j] * s, kind);
    } else {
      qt[cc * rows + rr] = static_cast<uint8_t>(to_fp8x2(tile[2 * lane][j] * s, 0.0f, kind) & 0xff);
    }
    if (rowwise && r0 == 0 && lane == 0 && inv_t) inv_t[cc] = fmaxf(amax_t[cc], kAmaxFloor) / top;
  }
}

dim3 tiles(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
}

}  // namespace

extern "C" {

void dsrun_fp8_amax(const void* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax, float* tensor_amax, cudaStream_t stream) {
  if (row_amax) cudaMemsetAsync(row_amax, 0, sizeof(float) * rows, stream);
  if (col_amax) cudaMemsetAsync(col_amax, 0, sizeof(float) * cols, stream);
  if (tensor_amax) cudaMemsetAsync(tensor_amax, 0, sizeof(float), stream);
  if (rows > 0 && cols > 0)
    amax_kernel<<<tiles(rows, cols), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, row_amax, col_amax, tensor_amax);
  note_launch();
}

void dsrun_fp8_quantize(const void* x, int64_t rows, int64_t cols, int kind, int rowwise, const float* amax_q, const float* amax_t, void* q,
                        void* qt, float* inv_q, float* inv_t, cudaStream_t stream) {
  if (rows > 0 && cols > 0)
    quantize_kernel<<<tiles(rows, cols), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, kind, rowwise, amax_q, amax_t,
                                                           static_cast<uint8_t*>(q), static_cast<uint8_t*>(qt), inv_q, inv_t);
  note_launch();
}
}
