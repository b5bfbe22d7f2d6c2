// SwiGLU forward and backward over gate_up [rows, 2·inner]: the row-wise kernels, their width
// choice (8 columns a thread or 1) and dsrun_swiglu_forward/backward.
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

// Eight columns a thread where inner is a multiple of 8 and both arrays are aligned to 8 elements
// (then every row is), else one.
template <typename T, typename Fn>
void with_swiglu_width(int64_t inner, std::initializer_list<const void*> pointers, Fn&& fn) {
  bool eight = inner % 8 == 0;
  for (const void* p : pointers) eight = eight && aligned_to(p, 8 * sizeof(T));
  if (eight) fn(std::integral_constant<int, 8>());
  else fn(std::integral_constant<int, 1>());
}

}  // namespace

extern "C" {

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
}
