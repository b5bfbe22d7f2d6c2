// RMSNorm forward and backward: the kernels, their launch geometry (threads a row, per-thread
// array sizes, 16-byte row access) and the dsrun_rms_norm_* entry points of fused_kernels.h.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernel_types.cuh"
#include "engine/model/kernels/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace {

using namespace dsrun_kernels;

constexpr int kMaxPerThread = 16;  // columns per thread in the RMSNorm kernels (cols <= 16 · threads)

// 256 threads where they divide the row: twice the warps of 128 per row for the same registers
// per thread (an H100 profile of the 1B decoder: the backward at 128 threads, 2 blocks per SM, ran
// at a sixth of memory bandwidth). At most 512: the backward's 16 columns a thread take 118
// registers, too many for 1024 threads a block.
int norm_threads(int64_t cols) {
  for (int t : {256, 512, 128})
    if (cols % t == 0 && cols / t <= kMaxPerThread) return t;
  return 0;
}

// Which columns of a row thread t owns (per = cols / blockDim of them): with VEC the contiguous
// run t·per .. t·per + per - 1, read and written 16 bytes at a time (rows 16-byte aligned and per
// a whole number of 16-byte pieces); otherwise t, t + blockDim, ... one element at a time. (An
// H100 profile of the 1B decoder showed the one-element form of the backward at a sixth of memory
// bandwidth: too few bytes in flight per thread.)
template <bool VEC>
__device__ __forceinline__ int64_t column(int j, int per) {
  return VEC ? static_cast<int64_t>(threadIdx.x) * per + j : threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
}

template <typename T, bool VEC, int N>
__device__ __forceinline__ void load_row(const T* row, int per, float (&v)[N]) {
  if constexpr (VEC) {
    constexpr int E = 16 / sizeof(T);  // elements per 16-byte piece
    const uint4* src = reinterpret_cast<const uint4*>(row + static_cast<int64_t>(threadIdx.x) * per);
#pragma unroll
    for (int k = 0; k < N / E; ++k)
      if (k * E < per) {
        const uint4 raw = src[k];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int m = 0; m < E; ++m) v[k * E + m] = to_f32(e[m]);
      }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < per) v[j] = to_f32(row[column<false>(j, per)]);
  }
}

template <typename T, bool VEC, int N>
__device__ __forceinline__ void store_row(T* row, int per, const float (&v)[N]) {
  if constexpr (VEC) {
    constexpr int E = 16 / sizeof(T);
    uint4* dst = reinterpret_cast<uint4*>(row + static_cast<int64_t>(threadIdx.x) * per);
#pragma unroll
    for (int k = 0; k < N / E; ++k)
      if (k * E < per) {
        uint4 raw;
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int m = 0; m < E; ++m) e[m] = from_f32<T>(v[k * E + m]);
        dst[k] = raw;
      }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < per) row[column<false>(j, per)] = from_f32<T>(v[j]);
  }
}

// One block per row; N >= cols / blockDim (the per-thread arrays' size: registers, and so blocks per SM).
// x_copy, if not null, gets a copy of x (the residual stream's next value, for a matrix product to add into).
template <typename T, bool VEC, int N>
__global__ void rms_norm_forward_kernel(const T* x, const T* w, T* y, float* rstd, T* x_copy, int64_t cols, float eps) {
  __shared__ float shared[32];
  const int per = static_cast<int>(cols / blockDim.x);
  float v[N];
  load_row<T, VEC, N>(x + blockIdx.x * cols, per, v);
  if (x_copy) store_row<T, VEC, N>(x_copy + blockIdx.x * cols, per, v);
  float sq = 0;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (j < per) sq += v[j] * v[j];
  const float r = rsqrtf(block_sum(sq, shared) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (j < per) v[j] = round_via<T>(v[j] * r) * to_f32(w[column<VEC>(j, per)]);
  store_row<T, VEC, N>(y + blockIdx.x * cols, per, v);
}

// Each block walks rows blockIdx.x, blockIdx.x + gridDim.x, ...; dx per row (plus d_add's row where
// given: the gradient of x's copy, summed here in fp32 instead of by autograd), and its own partial
// sum of dw kept in registers and written once (no atomics).
// (N = 8 runs at most 256 threads a block: bounded to 64 registers, 4 blocks fit on an SM; N = 16
// at most 512, its 118 registers)
template <typename T, bool VEC, int N>
__global__ void __launch_bounds__(N == 8 ? 256 : 512, N == 8 ? 4 : 1) rms_norm_backward_kernel(const T* dy, const T* x, const T* w, const float* rstd, const T* d_add, T* dx, float* dw_partial,
                                         int64_t rows, int64_t cols) {
  __shared__ float shared[32];
  const int per = static_cast<int>(cols / blockDim.x);
  float wv[N], dw[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    dw[j] = 0;
    if (j < per) wv[j] = to_f32(w[column<VEC>(j, per)]);
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float r = rstd[row];
    float xv[N], g[N];
    load_row<T, VEC, N>(x + row * cols, per, xv);
    load_row<T, VEC, N>(dy + row * cols, per, g);
    float dot = 0;  // Σ g·x, g = dy·w the gradient of the normalised value
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < per) {
        dw[j] += g[j] * round_via<T>(xv[j] * r);
        g[j] *= wv[j];
        dot += g[j] * xv[j];
      }
    const float k = block_sum(dot, shared) * r * r * r / static_cast<float>(cols);
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < per) g[j] = g[j] * r - xv[j] * k;
    if (d_add) {
      load_row<T, VEC, N>(d_add + row * cols, per, xv);  // (x's values are no longer needed)
#pragma unroll
      for (int j = 0; j < N; ++j)
        if (j < per) g[j] += xv[j];
    }
    store_row<T, VEC, N>(dx + row * cols, per, g);
  }
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (j < per) dw_partial[blockIdx.x * cols + column<VEC>(j, per)] = dw[j];
}

// Whether the RMSNorm kernels may move `per` elements per thread 16 bytes at a time: whole pieces,
// and every row of every pointer 16-byte aligned (rows of per · threads elements follow each other).
template <typename T>
bool vectorised(int per, std::initializer_list<const void*> pointers) {
  if ((per * sizeof(T)) % 16 != 0) return false;
  for (const void* p : pointers)
    if (!aligned_to(p, 16)) return false;
  return true;
}

// Calls fn with the per-thread array size the RMSNorm kernels take for `per` columns a thread: 8
// where it suffices (hidden 2048 at 256 threads), else 16. (An H100 profile of the 1B decoder had the
// backward at 46% of memory bandwidth with arrays of 16: its 118 registers allowed 2 of its 8 blocks per SM.)
template <typename Fn>
void with_row_array(int per, Fn&& fn) {
  if (per <= 8) fn(std::integral_constant<int, 8>());
  else fn(std::integral_constant<int, 16>());
}

}  // namespace

extern "C" {

int dsrun_rms_norm_supported(int64_t cols) { return norm_threads(cols) > 0; }
// Blocks of the backward, each with its own partial sum of dw: 4 per SM of an H100 (132 SMs), as many
// as fit at once at 256 threads and 64 registers (twice that ran in two waves and left twice the
// partials to sum: 12 us a norm on the 1B); the partials' sum is [528, cols].
int dsrun_rms_norm_partials(int64_t rows) { return static_cast<int>(rows < 528 ? rows : 528); }

void dsrun_rms_norm_forward(const void* x, const void* w, void* y, float* rstd, void* x_copy, int64_t rows, int64_t cols, float eps,
                            int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int threads = norm_threads(cols);
    const bool vec = vectorised<T>(cols / threads, {x, y, x_copy ? x_copy : y});
    with_row_array(static_cast<int>(cols / threads), [&](auto n) {
      constexpr int N = decltype(n)::value;
      auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, static_cast<T*>(x_copy), cols, eps);
      };
      if (vec) launch(rms_norm_forward_kernel<T, true, N>);
      else launch(rms_norm_forward_kernel<T, false, N>);
    });
  });
  note_launch();
}

void dsrun_rms_norm_backward(const void* dy, const void* x, const void* w, const float* rstd, const void* d_add, void* dx, float* dw_partial,
                             int64_t rows, int64_t cols, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int threads = norm_threads(cols);
    const bool vec = vectorised<T>(cols / threads, {dy, x, dx, d_add ? d_add : dx});
    with_row_array(static_cast<int>(cols / threads), [&](auto n) {
      constexpr int N = decltype(n)::value;
      auto launch = [&](auto kernel) {
        kernel<<<dsrun_rms_norm_partials(rows), threads, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w),
                                                                      rstd, static_cast<const T*>(d_add), static_cast<T*>(dx), dw_partial, rows, cols);
      };
      if (vec) launch(rms_norm_backward_kernel<T, true, N>);
      else launch(rms_norm_backward_kernel<T, false, N>);
    });
  });
  note_launch();
}
}
