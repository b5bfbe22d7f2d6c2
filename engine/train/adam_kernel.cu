// The kernel behind adam_kernel.h: one pass over the master weights, both states, the gradient and
// the working parameters (28 bytes per bf16 parameter, 20 with bf16 states, against 40 for a gradient
// conversion to fp32, PyTorch's fused Adam and a copy back to bf16 one after another). Compiled only
// for CUDA builds.
#include "engine/train/adam_kernel.h"

#include "engine/model/kernel_types.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace {

using namespace dsrun_kernels;

struct AdamScalars {
  float grad_factor, lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt;
  int decoupled;
};

// One element's update; g already in fp32, averaged and clipped.
__device__ __forceinline__ void adam_update(float& w, float& m, float& v, float g, const AdamScalars& s) {
  if (s.decoupled) w -= s.lr * s.weight_decay * w;
  else g += s.weight_decay * w;
  m = s.beta1 * m + (1 - s.beta1) * g;
  v = s.beta2 * v + (1 - s.beta2) * g * g;
  w -= s.step_size * m / (sqrtf(v) / s.bias_correction2_sqrt + s.eps);
}

// The range from `head` on, four consecutive elements per thread and iteration: one access per
// array where every pointer is then aligned to four elements (VEC), otherwise four single ones; the
// grid walks the range. The first `head` elements (fewer than four: up to the master's 16-byte
// boundary) go one each to the first block's first threads. (Eight elements a thread, 16-byte bf16
// accesses at 60 registers, ran the 1B's update 7% slower on an H100: half the blocks per SM.)
// S: the states' element type (fp32, or bf16 rounded to nearest after each update).
template <typename S, typename G, typename P, bool VEC>
__global__ void adam_kernel(float* __restrict__ master, S* __restrict__ exp_avg, S* __restrict__ exp_avg_sq,
                            const G* __restrict__ grad, P* __restrict__ out, int64_t n, int64_t head,
                            const float* __restrict__ divisor, AdamScalars s) {
  const float factor = divisor ? s.grad_factor / *divisor : s.grad_factor;
  auto one = [&](int64_t i) {
    float w = master[i], m = to_f32(exp_avg[i]), v = to_f32(exp_avg_sq[i]);
    adam_update(w, m, v, to_f32(grad[i]) * factor, s);
    master[i] = w;
    exp_avg[i] = from_f32<S>(m);
    exp_avg_sq[i] = from_f32<S>(v);
    if (out) out[i] = from_f32<P>(w);
  };
  if (blockIdx.x == 0 && threadIdx.x < head) one(threadIdx.x);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  for (int64_t base = head + (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; base < n; base += stride) {
    if (VEC && base + 4 <= n) {
      float w[4], m[4], v[4], g[4];
      load4(master + base, w);
      load4(exp_avg + base, m);
      load4(exp_avg_sq + base, v);
      load4(grad + base, g);
#pragma unroll
      for (int j = 0; j < 4; ++j) adam_update(w[j], m[j], v[j], g[j] * factor, s);
      store4(master + base, w);
      store4(exp_avg + base, m);
      store4(exp_avg_sq + base, v);
      if (out) store4(out + base, w);
    } else {
      for (int64_t i = base; i < base + 4 && i < n; ++i) one(i);
    }
  }
}

thread_local const char* last_error = nullptr;

}  // namespace

extern "C" {

void dsrun_adam_step(float* master, void* exp_avg, void* exp_avg_sq, int state_dtype, const void* grad, int grad_dtype, void* param_out,
                     int param_dtype, int64_t n, float grad_factor, const float* grad_divisor, float lr, float beta1, float beta2,
                     float eps, float weight_decay, int decoupled, float bias_correction1, float bias_correction2_sqrt,
                     cudaStream_t stream) {
  last_error = nullptr;
  if (n <= 0) return;
  const AdamScalars s{grad_factor, lr, beta1, beta2, eps, weight_decay, lr / bias_correction1, bias_correction2_sqrt, decoupled};
  // Enough blocks of 256 threads to fill an H100 several times over (132 SMs, 8 blocks each), each
  // thread four elements per iteration; small ranges get what they need.
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads * 4 - 1) / (kThreads * 4);
  const int blocks = static_cast<int>(wanted < 132 * 8 ? wanted : 132 * 8);
  dispatch(state_dtype, [&](auto* state_tag) {
    using S = std::remove_pointer_t<decltype(state_tag)>;
    dispatch(grad_dtype, [&](auto* grad_tag) {
      using G = std::remove_pointer_t<decltype(grad_tag)>;
      dispatch(param_dtype, [&](auto* param_tag) {
        using P = std::remove_pointer_t<decltype(param_tag)>;
        // Up to the master's 16-byte boundary one at a time; from there four at a time where the
        // others are aligned there too (the optimizer aligns its states to the masters' ranges).
        const int64_t to_boundary = static_cast<int64_t>((16 - reinterpret_cast<uintptr_t>(master) % 16) % 16 / 4);
        const int64_t head = to_boundary < n ? to_boundary : n;
        // Whether p's elements from `head` on may be read four at a time.
        auto four_from_head = [&](const void* p, size_t bytes) { return aligned_to(static_cast<const char*>(p) + head * bytes, 4 * bytes); };
        const bool vec = four_from_head(exp_avg, sizeof(S)) && four_from_head(exp_avg_sq, sizeof(S)) && four_from_head(grad, sizeof(G)) &&
                         (param_out == nullptr || four_from_head(param_out, sizeof(P)));
        S* m = static_cast<S*>(exp_avg);
        S* v = static_cast<S*>(exp_avg_sq);
        const G* g = static_cast<const G*>(grad);
        P* out = static_cast<P*>(param_out);
        if (vec) adam_kernel<S, G, P, true><<<blocks, kThreads, 0, stream>>>(master, m, v, g, out, n, head, grad_divisor, s);
        else adam_kernel<S, G, P, false><<<blocks, kThreads, 0, stream>>>(master, m, v, g, out, n, head, grad_divisor, s);
      });
    });
  });
  const cudaError_t e = cudaGetLastError();
  last_error = e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

const char* dsrun_adam_last_error(void) { return last_error; }
}
