// The token cross-entropy on fp32 logit chunks: the softmax gradient, the row log-sum-exp, the
// one-kernel loss and gradient (cross_entropy_rows), and their dsrun_ entry points.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernel_types.cuh"
#include "engine/model/kernels/common.cuh"

#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace {

using namespace dsrun_kernels;

// The cross-entropy's gradient on a chunk of fp32 logits z [rows, cols], a row per block at a time:
// (exp(z - lse[row]) - [col == target[row]]) · scale · (*scale_ptr if given), written in T.
template <typename T>
__global__ void softmax_gradient_kernel(const float* z, const float* lse, const int64_t* target, const bool* here, const float* scale_ptr,
                                        float scale, T* out, int64_t rows, int64_t cols) {
  const float s = scale_ptr ? scale * *scale_ptr : scale;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float l = lse[r];
    const int64_t hot = here[r] ? target[r] : -1;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      out[r * cols + c] = from_f32<T>((__expf(z[r * cols + c] - l) - (c == hot ? 1.0f : 0.0f)) * s);
  }
}

// log Σ exp over each row of z [rows, cols] fp32, in one read: each thread keeps a running maximum
// and the sum of exp(v - maximum) over its columns, rescaled when the maximum grows; the block then
// combines the pairs. (libtorch's logsumexp is a composite: maximum, subtraction, exp and sum, two
// of them writing the whole chunk.)
__device__ __forceinline__ void combine_max_sum(float& m, float& s, float m2, float s2) {
  const float top = fmaxf(m, m2);
  if (top == -INFINITY) return;  // both empty
  s = s * __expf(m - top) + s2 * __expf(m2 - top);
  m = top;
}

// log Σ exp over a block from each thread's running maximum m and sum s of exp(v - m), the value
// for thread 0 (the others' is partial); shared_m and shared_s hold 32 floats each and may still be
// read from a previous call until the first barrier.
__device__ float block_logsumexp(float m, float s, float* shared_m, float* shared_s) {
  for (int o = 16; o > 0; o >>= 1) combine_max_sum(m, s, __shfl_xor_sync(0xffffffff, m, o), __shfl_xor_sync(0xffffffff, s, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) {
    shared_m[warp] = m;
    shared_s[warp] = s;
  }
  __syncthreads();
  float bm = shared_m[0], bs = shared_s[0];
  if (threadIdx.x == 0)
    for (int w = 1; w < warps; ++w) combine_max_sum(bm, bs, shared_m[w], shared_s[w]);
  return bm + logf(bs);
}

__global__ void row_logsumexp_kernel(const float* z, float* lse, int64_t rows, int64_t cols) {
  __shared__ float shared_m[32], shared_s[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float m = -INFINITY, s = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = z[r * cols + c];
      if (v > m) {
        s = s * __expf(m - v) + 1.0f;
        m = v;
      } else if (v != -INFINITY) {  // (-inf - -inf would be NaN)
        s += __expf(v - m);
      }
    }
    const float l = block_logsumexp(m, s, shared_m, shared_s);
    if (threadIdx.x == 0) lse[r] = l;
  }
}

// The loss on a chunk of fp32 logits z [rows, cols] (cols a multiple of 4, z 16-byte aligned) in
// one kernel: each row's log-sum-exp and target logit, and the gradient (exp(z - lse) - one_hot) ·
// scale in T. A block takes a row at a time and reads it twice, four columns per access: once for
// the running maximum and sum, once for the gradient. One kernel where a log-sum-exp kernel and a
// gradient kernel took 336 us per 2,097-token chunk of the 1B on an H100; this one 215 us, at
// memory bandwidth with z read twice (the second read hoped for L2 and mostly missed it). Keeping
// the row in shared memory instead (one block of 1024 threads per SM) ran slower: 240 us.
template <typename T>
__global__ void __launch_bounds__(512) cross_entropy_rows_kernel(const float* z, const int64_t* target, const bool* here, float scale, T* grad,
                                                                 float* lse, float* target_logit, int64_t rows, int64_t cols) {
  __shared__ float shared_m[32], shared_s[32], row_lse;
  const int64_t quads = cols / 4;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float4* row = reinterpret_cast<const float4*>(z + r * cols);
    // Four loads in flight per thread before any is used (one each left the kernel at 1.6 TB/s).
    float m = -INFINITY, s = 0;
    for (int64_t q0 = threadIdx.x; q0 < quads; q0 += 4 * static_cast<int64_t>(blockDim.x)) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t q = q0 + u * static_cast<int64_t>(blockDim.x);
        v[u] = q < quads ? row[q] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float top = fmaxf(fmaxf(v[u].x, v[u].y), fmaxf(v[u].z, v[u].w));
        if (top > m) {
          s *= __expf(m - top);  // (0 while m is -inf: s is 0 then)
          m = top;
        }
        if (m != -INFINITY) s += __expf(v[u].x - m) + __expf(v[u].y - m) + __expf(v[u].z - m) + __expf(v[u].w - m);
      }
    }
    const float block_lse = block_logsumexp(m, s, shared_m, shared_s);
    if (threadIdx.x == 0) {
      row_lse = block_lse;
      lse[r] = block_lse;
      target_logit[r] = here[r] ? z[r * cols + target[r]] : 0.0f;
    }
    __syncthreads();
    const float l = row_lse;
    const int64_t hot = here[r] ? target[r] : -1;
    T* out = grad + r * cols;
    for (int64_t q0 = threadIdx.x; q0 < quads; q0 += 4 * static_cast<int64_t>(blockDim.x)) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t q = q0 + u * static_cast<int64_t>(blockDim.x);
        if (q < quads) v[u] = row[q];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t c = (q0 + u * static_cast<int64_t>(blockDim.x)) * 4;
        if (c >= cols) break;
        float g[4] = {__expf(v[u].x - l), __expf(v[u].y - l), __expf(v[u].z - l), __expf(v[u].w - l)};
#pragma unroll
        for (int j = 0; j < 4; ++j) g[j] = (g[j] - (c + j == hot ? 1.0f : 0.0f)) * scale;
        store4(out + c, g);
      }
    }
  }
}

}  // namespace

extern "C" {

void dsrun_softmax_gradient(const float* z, const float* lse, const int64_t* target, const bool* here, const float* scale_ptr, float scale,
                            void* out, int64_t rows, int64_t cols, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_gradient_kernel<T><<<row_blocks(rows), 256, 0, stream>>>(z, lse, target, here, scale_ptr, scale, static_cast<T*>(out), rows, cols);
  });
  note_launch();
}

void dsrun_row_logsumexp(const float* z, float* lse, int64_t rows, int64_t cols, cudaStream_t stream) {
  row_logsumexp_kernel<<<row_blocks(rows), 256, 0, stream>>>(z, lse, rows, cols);
  note_launch();
}

int dsrun_cross_entropy_rows_supported(const float* z, int64_t cols) { return cols % 4 == 0 && aligned_to(z, 16); }

void dsrun_cross_entropy_rows(const float* z, const int64_t* target, const bool* here, float scale, void* grad, float* lse, float* target_logit,
                              int64_t rows, int64_t cols, int dtype, cudaStream_t stream) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t blocks = rows < 2 * sms ? (rows > 0 ? rows : 1) : 2 * sms;
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_rows_kernel<T><<<static_cast<unsigned>(blocks), 512, 0, stream>>>(z, target, here, scale, static_cast<T*>(grad), lse, target_logit,
                                                                                   rows, cols);
  });
  note_launch();
}
}
