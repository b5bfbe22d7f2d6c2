// CUDA kernels behind fused_kernels.h. Each op reads its inputs once and writes its outputs once;
// arithmetic in fp32. Compiled only for CUDA builds (CMakeLists.txt); no torch headers here.
#include "engine/model/fused_kernels.h"
#include "engine/model/kernel_types.cuh"

#include <cmath>

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

// The general form: one thread per (token, head, i < half), the pair (i, i + half) of that head.
template <typename T>
__global__ void rotary_pairs_kernel(const T* in, int64_t in_stride, T* out, int64_t out_stride, const float* cos, const float* sin,
                                    const int64_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, int64_t seq, float direction) {
  const int64_t half = head_dim / 2, total = tokens * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half, th = idx / half;  // th: token · heads + head
    const int64_t head = th % heads, t = th / heads;
    const int64_t pos = positions ? positions[t] : t % seq;
    const T* src = in + t * in_stride + head * head_dim;
    T* dst = out + t * out_stride + head * head_dim;
    const float c = cos[pos * head_dim + i], s = direction * sin[pos * head_dim + i];
    const float x1 = to_f32(src[i]), x2 = to_f32(src[i + half]);
    dst[i] = from_f32<T>(x1 * c - x2 * s);
    dst[i + half] = from_f32<T>(x2 * c + x1 * s);
  }
}

// Half a head a multiple of 4 (every DeepSeek and Llama shape): blocks walk tokens, a token's
// threads its (head, 4 consecutive i) groups with 32-bit index arithmetic, each reading 4 elements
// of each half, and 4 of the cos and sin rows, in one access where aligned (VEC). (An H100 profile
// of the 1B decoder had the one-thread-per-4-pairs form, with four 64-bit divisions per thread, at
// 45% of memory bandwidth. Eight pairs a thread ran 2.5 times slower, 137 us a call against 55; two
// tokens a step, loaded before either is written, 12% slower.)
template <typename T, bool VEC>
__global__ void rotary_kernel(const T* in, int64_t in_stride, T* out, int64_t out_stride, const float* cos, const float* sin,
                              const int64_t* positions, int64_t tokens, int heads, int head_dim, int64_t seq, float direction) {
  const int half = head_dim / 2, groups = half / 4, per_token = heads * groups;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t pos = positions ? positions[t] : t % seq;
    const T* row_in = in + t * in_stride;
    T* row_out = out + t * out_stride;
    const float* c_row = cos + pos * head_dim;
    const float* s_row = sin + pos * head_dim;
    for (int j = threadIdx.x; j < per_token; j += blockDim.x) {
      const int head = j / groups, i = (j - head * groups) * 4;
      const T* src = row_in + head * head_dim + i;
      T* dst = row_out + head * head_dim + i;
      float x1[4], x2[4], c[4], s[4], o1[4], o2[4];
      if (VEC) {
        load4(src, x1);
        load4(src + half, x2);
        load4(c_row + i, c);
        load4(s_row + i, s);
      } else {
#pragma unroll
        for (int v = 0; v < 4; ++v) x1[v] = to_f32(src[v]), x2[v] = to_f32(src[half + v]), c[v] = c_row[i + v], s[v] = s_row[i + v];
      }
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float sv = direction * s[v];
        o1[v] = x1[v] * c[v] - x2[v] * sv;
        o2[v] = x2[v] * c[v] + x1[v] * sv;
      }
      if (VEC) {
        store4(dst, o1);
        store4(dst + half, o2);
      } else {
#pragma unroll
        for (int v = 0; v < 4; ++v) dst[v] = from_f32<T>(o1[v]), dst[half + v] = from_f32<T>(o2[v]);
      }
    }
  }
}

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + __expf(-g)); }

// The row-wise kernels below: blocks walk rows, threads walk a row's columns (no 64-bit division
// per element, which an H100 profile showed costing the one-element-per-thread forms half their speed).
// SwiGLU takes E = 8 consecutive columns per thread and step where inner is a multiple of 8 (one
// 16-byte access each in bf16; an H100 profile of the 1B decoder had the one-element form at 61%
// (forward) and 71% (backward) of memory bandwidth), else E = 1.
template <typename T, int E>
__global__ void swiglu_forward_kernel(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gate = gate_up + r * 2 * inner;
    const T* up = gate + inner;
    T* row_out = out + r * inner;
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * E; j < inner; j += static_cast<int64_t>(blockDim.x) * E) {
      float g[E], u[E], o[E];
      load_n<E>(gate + j, g);
      load_n<E>(up + j, u);
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] = g[e] * sigmoid(g[e]) * u[e];
      store_n<E>(row_out + j, o);
    }
  }
}

template <typename T, int E>
__global__ void swiglu_backward_kernel(const T* d_out, const T* gate_up, T* d_gate_up, int64_t rows, int64_t inner) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gate = gate_up + r * 2 * inner;
    const T* up = gate + inner;
    const T* d_row = d_out + r * inner;
    T* d_gate = d_gate_up + r * 2 * inner;
    T* d_up = d_gate + inner;
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * E; j < inner; j += static_cast<int64_t>(blockDim.x) * E) {
      float g[E], u[E], d[E], dg[E], du[E];
      load_n<E>(gate + j, g);
      load_n<E>(up + j, u);
      load_n<E>(d_row + j, d);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float sg = sigmoid(g[e]);
        dg[e] = d[e] * u[e] * sg * (1.0f + g[e] * (1.0f - sg));  // d silu/dg = σ(1 + g(1-σ))
        du[e] = d[e] * g[e] * sg;
      }
      store_n<E>(d_gate + j, dg);
      store_n<E>(d_up + j, du);
    }
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

// Whether the RMSNorm kernels may move `per` elements per thread 16 bytes at a time: whole pieces,
// and every row of every pointer 16-byte aligned (rows of per · threads elements follow each other).
template <typename T>
bool vectorised(int per, std::initializer_list<const void*> pointers) {
  if ((per * sizeof(T)) % 16 != 0) return false;
  for (const void* p : pointers)
    if (!aligned_to(p, 16)) return false;
  return true;
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

// Blocks for the row-wise kernels: a row each, up to 16 per SM of an H100; beyond, blocks walk rows.
int row_blocks(int64_t rows) { return static_cast<int>(rows < 132 * 16 ? (rows > 0 ? rows : 1) : 132 * 16); }

// Calls fn with the per-thread array size the RMSNorm kernels take for `per` columns a thread: 8
// where it suffices (hidden 2048 at 256 threads), else 16. (An H100 profile of the 1B decoder had the
// backward at 46% of memory bandwidth with arrays of 16: its 118 registers allowed 2 of its 8 blocks per SM.)
template <typename Fn>
void with_row_array(int per, Fn&& fn) {
  if (per <= 8) fn(std::integral_constant<int, 8>());
  else fn(std::integral_constant<int, 16>());
}

// Eight columns a thread where inner is a multiple of 8 and both arrays are aligned to 8 elements
// (then every row is), else one.
template <typename T, typename Fn>
void with_swiglu_width(int64_t inner, std::initializer_list<const void*> pointers, Fn&& fn) {
  bool eight = inner % 8 == 0;
  for (const void* p : pointers) eight = eight && aligned_to(p, 8 * sizeof(T));
  if (eight) fn(std::integral_constant<int, 8>());
  else fn(std::integral_constant<int, 1>());
}

thread_local const char* last_error = nullptr;
void note_launch() {
  cudaError_t e = cudaGetLastError();
  last_error = e == cudaSuccess ? nullptr : cudaGetErrorString(e);
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

void dsrun_rotary(const void* in, int64_t in_stride, void* out, int64_t out_stride, const float* cos, const float* sin,
                  const int64_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, int64_t seq, int inverse, int dtype,
                  cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const float direction = inverse ? -1.0f : 1.0f;
    const T* x = static_cast<const T*>(in);
    T* y = static_cast<T*>(out);
    if (head_dim % 8 == 0) {
      const bool vec = aligned_to(in, 4 * sizeof(T)) && aligned_to(out, 4 * sizeof(T)) && in_stride % 4 == 0 && out_stride % 4 == 0 &&
                       aligned_to(cos, 16) && aligned_to(sin, 16);
      const int blocks = static_cast<int>(tokens < 132 * 16 ? (tokens > 0 ? tokens : 1) : 132 * 16);
      if (vec)
        rotary_kernel<T, true><<<blocks, 256, 0, stream>>>(x, in_stride, y, out_stride, cos, sin, positions, tokens, static_cast<int>(heads), static_cast<int>(head_dim), seq, direction);
      else
        rotary_kernel<T, false><<<blocks, 256, 0, stream>>>(x, in_stride, y, out_stride, cos, sin, positions, tokens, static_cast<int>(heads), static_cast<int>(head_dim), seq, direction);
    } else {
      rotary_pairs_kernel<T><<<grid_for(tokens * heads * head_dim / 2, 256), 256, 0, stream>>>(x, in_stride, y, out_stride, cos, sin, positions, tokens, heads, head_dim, seq, direction);
    }
  });
  note_launch();
}

void dsrun_swiglu_forward(const void* gate_up, void* out, int64_t rows, int64_t inner, int dtype, cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_swiglu_width<T>(inner, {gate_up, out}, [&](auto e) {
      swiglu_forward_kernel<T, decltype(e)::value><<<row_blocks(rows), 256, 0, stream>>>(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, inner);
    });
  });
  note_launch();
}

void dsrun_swiglu_backward(const void* d_out, const void* gate_up, void* d_gate_up, int64_t rows, int64_t inner, int dtype,
                           cudaStream_t stream) {
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_swiglu_width<T>(inner, {d_out, gate_up, d_gate_up}, [&](auto e) {
      swiglu_backward_kernel<T, decltype(e)::value><<<row_blocks(rows), 256, 0, stream>>>(
          static_cast<const T*>(d_out), static_cast<const T*>(gate_up), static_cast<T*>(d_gate_up), rows, inner);
    });
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

void dsrun_row_logsumexp(const float* z, float* lse, int64_t rows, int64_t cols, cudaStream_t stream) {
  row_logsumexp_kernel<<<row_blocks(rows), 256, 0, stream>>>(z, lse, rows, cols);
  note_launch();
}

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

const char* dsrun_fused_last_error(void) { return last_error; }
}
