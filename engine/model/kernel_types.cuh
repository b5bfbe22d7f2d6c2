// The element types dsrun's CUDA kernels read and write (fp32, bf16, fp16): conversions to and from
// fp32, and the dispatch from a DsrunFusedDType to a template argument. Included by .cu files only.
#pragma once

#include "engine/model/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

namespace dsrun_kernels {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }
// Rounds through T and back: what storing in T and reading again gives.
template <typename T> __device__ __forceinline__ float round_via(float v) { return to_f32(from_f32<T>(v)); }

// E consecutive elements (1, 4 or 8) from or to an address aligned to E of them: one access for
// 16 bytes or less (two for eight fp32), each element converted to or from fp32.
template <typename T, int E> struct alignas(E * sizeof(T)) Elements { T v[E]; };
template <int E, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&f)[E]) {
  const Elements<T, E> x = *reinterpret_cast<const Elements<T, E>*>(p);
#pragma unroll
  for (int j = 0; j < E; ++j) f[j] = to_f32(x.v[j]);
}
template <int E, typename T>
__device__ __forceinline__ void store_n(T* p, const float (&f)[E]) {
  Elements<T, E> x;
#pragma unroll
  for (int j = 0; j < E; ++j) x.v[j] = from_f32<T>(f[j]);
  *reinterpret_cast<Elements<T, E>*>(p) = x;
}

// Four of them (16 bytes of fp32, 8 of bf16 or fp16).
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&f)[4]) { load_n<4>(p, f); }
template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&f)[4]) { store_n<4>(p, f); }

// Whether p may be read or written `bytes` at a time (host side, before a launch).
inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls fn with a null pointer of the element type `dtype` names (for template dispatch).
template <typename Fn>
void dispatch(int dtype, Fn&& fn) {
  if (dtype == DSRUN_BF16) fn(static_cast<__nv_bfloat16*>(nullptr));
  else if (dtype == DSRUN_F16) fn(static_cast<__half*>(nullptr));
  else fn(static_cast<float*>(nullptr));
}

}  // namespace dsrun_kernels
