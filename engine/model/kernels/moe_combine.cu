// A MoE layer's combine (out[t] = Σ_i w · src[place]) and its gradient: the kernels and
// dsrun_combine_rows / dsrun_combine_rows_backward.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernel_types.cuh"
#include "engine/model/kernels/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace {

using namespace dsrun_kernels;

// A MoE layer's combine: out[t] = Σ_i w[t·k+i] · src[place[t·k+i]] over token t's k choices, in
// fp32, rounded once (place < 0: a dropped pair, nothing; w null: weights of 1). Blocks walk
// tokens, threads four columns at a time (VEC: one access each; cols a multiple of 4 throughout).
template <typename T, bool VEC>
__global__ void combine_rows_kernel(const T* src, const int64_t* place, const float* w, T* out, int64_t tokens, int k, int64_t cols) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t c = threadIdx.x * 4; c < cols; c += static_cast<int64_t>(blockDim.x) * 4) {
      float acc[4] = {0, 0, 0, 0};
      for (int i = 0; i < k; ++i) {
        const int64_t r = place[t * k + i];
        if (r < 0) continue;
        const float wi = w ? w[t * k + i] : 1.0f;
        float x[4];
        const T* from = src + r * cols + c;
        if (VEC) load4(from, x);
        else
#pragma unroll
          for (int j = 0; j < 4; ++j) x[j] = to_f32(from[j]);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] += wi * x[j];
      }
      T* to = out + t * cols + c;
      if (VEC) store4(to, acc);
      else
#pragma unroll
        for (int j = 0; j < 4; ++j) to[j] = from_f32<T>(acc[j]);
    }
  }
}

// Its gradient: d_src[place[p]] = w[p] · d_out[t] and d_w[p] = Σ_c d_out[t, c] · src[place[p], c]
// for each pair p = t·k + i (d_w 0 for a dropped pair). Every row of src belongs to one pair, so
// each row of d_src is written once: no atomics, deterministic.
template <typename T, bool VEC>
__global__ void combine_rows_backward_kernel(const T* d_out, const T* src, const int64_t* place, const float* w, T* d_src, float* d_w,
                                             int64_t tokens, int k, int64_t cols) {
  __shared__ float shared[32];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int i = 0; i < k; ++i) {
      const int64_t p = t * k + i, r = place[p];
      if (r < 0) {  // (the same for the whole block)
        if (threadIdx.x == 0) d_w[p] = 0;
        continue;
      }
      const float wi = w[p];
      float dot = 0;
      for (int64_t c = threadIdx.x * 4; c < cols; c += static_cast<int64_t>(blockDim.x) * 4) {
        float g[4], x[4], d[4];
        const T* g_from = d_out + t * cols + c;
        const T* x_from = src + r * cols + c;
        if (VEC) {
          load4(g_from, g);
          load4(x_from, x);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) g[j] = to_f32(g_from[j]), x[j] = to_f32(x_from[j]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) dot += g[j] * x[j], d[j] = wi * g[j];
        T* to = d_src + r * cols + c;
        if (VEC) store4(to, d);
        else
#pragma unroll
          for (int j = 0; j < 4; ++j) to[j] = from_f32<T>(d[j]);
      }
      const float total = block_sum(dot, shared);
      if (threadIdx.x == 0) d_w[p] = total;
    }
  }
}

}  // namespace

extern "C" {

void dsrun_combine_rows(const void* src, const int64_t* place, const float* w, void* out, int64_t tokens, int k, int64_t cols, int dtype,
                        cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vec = aligned_to(src, 4 * sizeof(T)) && aligned_to(out, 4 * sizeof(T));
    auto launch = [&](auto kernel) {
      kernel<<<row_blocks(tokens), 256, 0, stream>>>(static_cast<const T*>(src), place, w, static_cast<T*>(out), tokens, k, cols);
    };
    if (vec) launch(combine_rows_kernel<T, true>);
    else launch(combine_rows_kernel<T, false>);
  });
  note_launch();
}

void dsrun_combine_rows_backward(const void* d_out, const void* src, const int64_t* place, const float* w, void* d_src, float* d_w,
                                 int64_t tokens, int k, int64_t cols, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vec = aligned_to(d_out, 4 * sizeof(T)) && aligned_to(src, 4 * sizeof(T)) && aligned_to(d_src, 4 * sizeof(T));
    auto launch = [&](auto kernel) {
      kernel<<<row_blocks(tokens), 256, 0, stream>>>(static_cast<const T*>(d_out), static_cast<const T*>(src), place, w, static_cast<T*>(d_src), d_w, tokens, k, cols);
    };
    if (vec) launch(combine_rows_backward_kernel<T, true>);
    else launch(combine_rows_backward_kernel<T, false>);
  });
  note_launch();
}
}
