// Whole-tensor and column reductions and scaling: column_sum (the RMSNorm weight gradient's
// partials), sum_of_squares (partial Σ x²), scale (x *= *factor), and their dsrun_ entry points.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernel_types.cuh"
#include "engine/model/kernels/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace {

using namespace dsrun_kernels;

// out[c] = Σ_r partial[r, c] over partial [rows, cols] fp32, in row order, rounded once to T: the
// RMSNorm weight's gradient from the backward's per-block sums. A block takes 32 columns and its 32
// warps take every 32nd row each; their sums are added in warp order (deterministic). (libtorch's
// sum then a conversion took 19 us per norm on the 1B's H100 profile.) 32 warps a block, each with
// four loads in flight: a row's column is a dependent chain otherwise.
template <typename T>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* partial, int64_t rows, int64_t cols, T* out) {
  __shared__ float sums[32][33];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = blockIdx.x * 32 + lane;
  float acc = 0;
  if (c < cols) {
#pragma unroll 4
    for (int64_t r = warp; r < rows; r += 32) acc += partial[r * cols + c];
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && c < cols) {
    float total = 0;
    for (int w = 0; w < 32; ++w) total += sums[w][lane];
    out[c] = from_f32<T>(total);
  }
}

// Σ x² over n elements in fp32, each block's share written to partial[blockIdx.x]; eight elements a
// thread and step where aligned (VEC), two steps' loads in flight.
template <typename T, bool VEC>
__global__ void sum_of_squares_kernel(const T* x, int64_t n, float* partial) {
  __shared__ float shared[32];
  constexpr int E = VEC ? 8 : 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * E;
  float acc = 0;
  int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * E;
  for (; i + stride + E <= n; i += 2 * stride) {
    float a[E], b[E];
    load_n<E>(x + i, a);
    load_n<E>(x + i + stride, b);
#pragma unroll
    for (int e = 0; e < E; ++e) acc += a[e] * a[e] + b[e] * b[e];
  }
  for (; i + E <= n; i += stride) {
    float a[E];
    load_n<E>(x + i, a);
#pragma unroll
    for (int e = 0; e < E; ++e) acc += a[e] * a[e];
  }
  if (VEC && blockIdx.x == 0)  // the last n % 8 elements
    for (int64_t t = n / E * E + threadIdx.x; t < n; t += blockDim.x) acc += to_f32(x[t]) * to_f32(x[t]);
  const float total = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// x *= *factor, n elements (four per access where aligned: VEC), in fp32, rounded once.
template <typename T, bool VEC>
__global__ void scale_kernel(T* x, int64_t n, const float* factor) {
  const float f = *factor;
  const int64_t start = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (VEC) {
    for (int64_t q = start; q < n / 4; q += stride) {
      float v[4];
      load4(x + q * 4, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] *= f;
      store4(x + q * 4, v);
    }
    for (int64_t i = n / 4 * 4 + start; i < n; i += stride) x[i] = from_f32<T>(to_f32(x[i]) * f);
  } else {
    for (int64_t i = start; i < n; i += stride) x[i] = from_f32<T>(to_f32(x[i]) * f);
  }
}

}  // namespace

extern "C" {

void dsrun_scale(void* x, int64_t n, const float* factor, int dtype, cudaStream_t stream) {
  if (n <= 0) return;
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int blocks = grid_for(n / 4 + 1, 256);
    if (aligned_to(x, 4 * sizeof(T))) scale_kernel<T, true><<<blocks, 256, 0, stream>>>(static_cast<T*>(x), n, factor);
    else scale_kernel<T, false><<<blocks, 256, 0, stream>>>(static_cast<T*>(x), n, factor);
  });
  note_launch();
}

void dsrun_column_sum(const float* partial, int64_t rows, int64_t cols, void* out, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    column_sum_kernel<T><<<static_cast<unsigned>((cols + 31) / 32), 1024, 0, stream>>>(partial, rows, cols, static_cast<T*>(out));
  });
  note_launch();
}

int dsrun_sum_of_squares_blocks(void) { return 1056; }

void dsrun_sum_of_squares(const void* x, int64_t n, int dtype, float* partial, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t wanted = n / (256 * 8) + 1;
    const int blocks = static_cast<int>(wanted < dsrun_sum_of_squares_blocks() ? wanted : dsrun_sum_of_squares_blocks());
    if (aligned_to(x, 16)) sum_of_squares_kernel<T, true><<<blocks, 256, 0, stream>>>(static_cast<const T*>(x), n, partial);
    else sum_of_squares_kernel<T, false><<<blocks, 256, 0, stream>>>(static_cast<const T*>(x), n, partial);
  });
  note_launch();
}
}
