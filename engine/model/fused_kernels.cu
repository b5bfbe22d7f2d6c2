// CUDA kernels behind fused_kernels.h. Each op reads its inputs once and writes its outputs once;
// arithmetic in fp32. Compiled only for CUDA builds (CMakeLists.txt); no torch headers here.
#include "engine/model/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }
// Rounds through T and back: what storing in T and reading again gives.
template <typename T> __device__ __forceinline__ float round_via(float v) { return to_f32(from_f32<T>(v)); }

constexpr int kMaxPerThread = 16;  // columns per thread in the RMSNorm kernels (cols <= 16 · threads)

// 256 threads where they divide the row: twice the warps of 128 per row for the same registers
// per thread (an H100 profile of the 1B decoder: the backward at 128 threads, 2 blocks per SM, ran
// at a sixth of memory bandwidth).
int norm_threads(int64_t cols) {
  for (int t : {256, 512, 1024, 128})
    if (cols % t == 0 && cols / t <= kMaxPerThread) return t;
  return 0;
}

// Sum over the block; every thread gets the total. `shared` holds one float per warp.
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// One block per row; thread t owns columns t, t + blockDim, ... (per = cols / blockDim of them).
template <typename T>
__global__ void rms_norm_forward_kernel(const T* x, const T* w, T* y, float* rstd, int64_t cols, float eps) {
  __shared__ float shared[32];
  const int per = static_cast<int>(cols / blockDim.x);
  const T* xr = x + blockIdx.x * cols;
  float v[kMaxPerThread];
  float sq = 0;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j)
    if (j < per) {
      v[j] = to_f32(xr[threadIdx.x + j * blockDim.x]);
      sq += v[j] * v[j];
    }
  const float r = rsqrtf(block_sum(sq, shared) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  T* yr = y + blockIdx.x * cols;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j)
    if (j < per) {
      const int64_t c = threadIdx.x + j * blockDim.x;
      yr[c] = from_f32<T>(round_via<T>(v[j] * r) * to_f32(w[c]));
    }
}

// Each block walks rows blockIdx.x, blockIdx.x + gridDim.x, ...; dx per row, and its own partial
// sum of dw kept in registers and written once (no atomics).
template <typename T>
__global__ void rms_norm_backward_kernel(const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* dw_partial,
                                         int64_t rows, int64_t cols) {
  __shared__ float shared[32];
  const int per = static_cast<int>(cols / blockDim.x);
  float wv[kMaxPerThread], dw[kMaxPerThread];
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    dw[j] = 0;
    if (j < per) wv[j] = to_f32(w[threadIdx.x + j * blockDim.x]);
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const T* dyr = dy + row * cols;
    const float r = rstd[row];
    float xv[kMaxPerThread], g[kMaxPerThread];
    float dot = 0;  // Σ g·x, g = dy·w the gradient of the normalised value
#pragma unroll
    for (int j = 0; j < kMaxPerThread; ++j)
      if (j < per) {
        const int64_t c = threadIdx.x + j * blockDim.x;
        xv[j] = to_f32(xr[c]);
        const float d = to_f32(dyr[c]);
        g[j] = d * wv[j];
        dot += g[j] * xv[j];
        dw[j] += d * round_via<T>(xv[j] * r);
      }
    const float k = block_sum(dot, shared) * r * r * r / static_cast<float>(cols);
    T* dxr = dx + row * cols;
#pragma unroll
    for (int j = 0; j < kMaxPerThread; ++j)
      if (j < per) dxr[threadIdx.x + j * blockDim.x] = from_f32<T>(g[j] * r - xv[j] * k);
  }
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j)
    if (j < per) dw_partial[blockIdx.x * cols + threadIdx.x + j * blockDim.x] = dw[j];
}

// One thread per (token, head, VEC consecutive i < half): the pairs (i, i + half) of that head. A
// warp then reads and writes 32·VEC consecutive elements of each half (VEC = 4 where half allows:
// 4x fewer, wider accesses than one pair per thread, which an H100 profile showed at a sixth of
// memory bandwidth).
template <typename T, int VEC>
__global__ void rotary_kernel(const T* in, int64_t in_stride, T* out, const float* cos, const float* sin, const int64_t* positions,
                              int64_t tokens, int64_t heads, int64_t head_dim, int64_t seq, float direction) {
  const int64_t half = head_dim / 2, groups = half / VEC;
  const int64_t total = tokens * heads * groups;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i0 = (idx % groups) * VEC;
    const int64_t th = idx / groups;  // token · heads + head
    const int64_t head = th % heads, t = th / heads;
    const int64_t pos = positions ? positions[t] : t % seq;
    const T* src = in + t * in_stride + head * head_dim;
    T* dst = out + th * head_dim;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int64_t i = i0 + v;
      const float c = cos[pos * head_dim + i], s = direction * sin[pos * head_dim + i];
      const float x1 = to_f32(src[i]), x2 = to_f32(src[i + half]);
      dst[i] = from_f32<T>(x1 * c - x2 * s);
      dst[i + half] = from_f32<T>(x2 * c + x1 * s);
    }
  }
}

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + __expf(-g)); }

// The row-wise kernels below: blocks walk rows, threads walk a row's columns (no 64-bit division
// per element, which an H100 profile showed costing the one-element-per-thread forms half their speed).
template <typename T>
__global__ void swiglu_forward_kernel(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t j = threadIdx.x; j < inner; j += blockDim.x) {
      const float g = to_f32(gate_up[r * 2 * inner + j]), u = to_f32(gate_up[r * 2 * inner + inner + j]);
      out[r * inner + j] = from_f32<T>(g * sigmoid(g) * u);
    }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* d_out, const T* gate_up, T* d_gate_up, int64_t rows, int64_t inner) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t j = threadIdx.x; j < inner; j += blockDim.x) {
      const float g = to_f32(gate_up[r * 2 * inner + j]), u = to_f32(gate_up[r * 2 * inner + inner + j]);
      const float d = to_f32(d_out[r * inner + j]);
      const float sg = sigmoid(g);
      const float silu = g * sg;
      d_gate_up[r * 2 * inner + j] = from_f32<T>(d * u * sg * (1.0f + g * (1.0f - sg)));  // d silu/dg = σ(1 + g(1-σ))
      d_gate_up[r * 2 * inner + inner + j] = from_f32<T>(d * silu);
    }
}

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

int grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1) : 132 * 32);  // grid-stride beyond 32 blocks/SM
}

// Blocks for the row-wise kernels: a row each, up to 16 per SM of an H100; beyond, blocks walk rows.
int row_blocks(int64_t rows) { return static_cast<int>(rows < 132 * 16 ? (rows > 0 ? rows : 1) : 132 * 16); }

thread_local const char* last_error = nullptr;
void note_launch() {
  cudaError_t e = cudaGetLastError();
  last_error = e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Calls fn with a null pointer of the element type `dtype` names (for template dispatch).
template <typename Fn>
void dispatch(int dtype, Fn&& fn) {
  if (dtype == DSRUN_BF16) fn(static_cast<__nv_bfloat16*>(nullptr));
  else if (dtype == DSRUN_F16) fn(static_cast<__half*>(nullptr));
  else fn(static_cast<float*>(nullptr));
}

}  // namespace

extern "C" {

int dsrun_rms_norm_supported(int64_t cols) { return norm_threads(cols) > 0; }
// Blocks of the backward, each with its own partial sum of dw: 8 per SM of an H100 (132 SMs), enough
// warps in flight to hide each row's load-reduce-store latency; the partials' sum is [1056, cols].
int dsrun_rms_norm_partials(int64_t rows) { return static_cast<int>(rows < 1056 ? rows : 1056); }

void dsrun_rms_norm_forward(const void* x, const void* w, void* y, float* rstd, int64_t rows, int64_t cols, float eps,
                            int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_forward_kernel<T><<<static_cast<unsigned>(rows), norm_threads(cols), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, cols, eps);
  });
  note_launch();
}

void dsrun_rms_norm_backward(const void* dy, const void* x, const void* w, const float* rstd, void* dx, float* dw_partial,
                             int64_t rows, int64_t cols, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_backward_kernel<T><<<dsrun_rms_norm_partials(rows), norm_threads(cols), 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd, static_cast<T*>(dx), dw_partial,
        rows, cols);
  });
  note_launch();
}

void dsrun_rotary(const void* in, int64_t in_stride, void* out, const float* cos, const float* sin, const int64_t* positions,
                  int64_t tokens, int64_t heads, int64_t head_dim, int64_t seq, int inverse, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const float direction = inverse ? -1.0f : 1.0f;
    if ((head_dim / 2) % 4 == 0)
      rotary_kernel<T, 4><<<grid_for(tokens * heads * head_dim / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(in), in_stride, static_cast<T*>(out), cos, sin, positions, tokens, heads, head_dim, seq, direction);
    else
      rotary_kernel<T, 1><<<grid_for(tokens * heads * head_dim / 2, 256), 256, 0, stream>>>(
          static_cast<const T*>(in), in_stride, static_cast<T*>(out), cos, sin, positions, tokens, heads, head_dim, seq, direction);
  });
  note_launch();
}

void dsrun_swiglu_forward(const void* gate_up, void* out, int64_t rows, int64_t inner, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_kernel<T><<<row_blocks(rows), 256, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, inner);
  });
  note_launch();
}

void dsrun_swiglu_backward(const void* d_out, const void* gate_up, void* d_gate_up, int64_t rows, int64_t inner, int dtype,
                           cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_kernel<T><<<row_blocks(rows), 256, 0, stream>>>(
        static_cast<const T*>(d_out), static_cast<const T*>(gate_up), static_cast<T*>(d_gate_up), rows, inner);
  });
  note_launch();
}

void dsrun_softmax_gradient(const float* z, const float* lse, const int64_t* target, const bool* here, const float* scale_ptr, float scale,
                            void* out, int64_t rows, int64_t cols, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softmax_gradient_kernel<T><<<row_blocks(rows), 256, 0, stream>>>(z, lse, target, here, scale_ptr, scale, static_cast<T*>(out), rows, cols);
  });
  note_launch();
}

const char* dsrun_fused_last_error(void) { return last_error; }
}
