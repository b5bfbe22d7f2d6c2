#include "engine/train/host_optimizer.hpp"

#include "engine/common/error.hpp"
#include "engine/common/host_cores.hpp"

#include <pthread.h>
#include <sched.h>

#include <cmath>
#include <cstring>

// Each loop below is compiled for AVX-512, AVX2 (with F16C and FMA) and baseline x86-64, and the
// loader picks the best the CPU has. The clones name ISA levels (x86-64-v4, -v3), which dispatch on
// the CPU's features: named CPUs ("arch=haswell") dispatch on the CPU's model, so an AMD EPYC or
// any Intel newer than the one named got the baseline loop, where every fma is a library call. The file is built with -ffp-contract=off: a multiply-add is
// fused exactly where torch's vectorised kernels fuse it (add with alpha, addcmul), written as
// std::fma, and nowhere else, so every clone gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DSRUN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSRUN_CLONES
#endif

namespace dsrun {

namespace {

constexpr int64_t kBlock = 2048;  // elements per pass: the gradient's fp32 copy stays in L1

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The gradient block in fp32, scaled as the unfused path does: (g · grad_scale) · clip_scale.
DSRUN_CLONES void widen_f32(const float* in, float* out, int64_t n, float scale, float clip) {
  for (int64_t i = 0; i < n; ++i) out[i] = (in[i] * scale) * clip;
}
DSRUN_CLONES void widen_bf16(const uint16_t* in, float* out, int64_t n, float scale, float clip) {
  for (int64_t i = 0; i < n; ++i) out[i] = (float_of(static_cast<uint32_t>(in[i]) << 16) * scale) * clip;
}
DSRUN_CLONES void widen_f16(const _Float16* in, float* out, int64_t n, float scale, float clip) {
  for (int64_t i = 0; i < n; ++i) out[i] = (static_cast<float>(in[i]) * scale) * clip;
}

DSRUN_CLONES void narrow_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = bits_of(in[i]);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}
DSRUN_CLONES void narrow_f16(const float* in, _Float16* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<_Float16>(in[i]);
}

// fp32 scalars, each rounded from double once, as torch casts a Python-style scalar.
struct Scalars {
  float decay_factor, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias2, eps, step_size, momentum, neg_lr;
};

DSRUN_CLONES void adamw_block(float* p, float* m, float* v, const float* g, int64_t n, Scalars s, bool decay) {
  if (decay)
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] * s.decay_factor;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = std::fma(s.one_minus_beta1, g[i], m[i] * s.beta1);  // m.mul_(β1).add_(g, 1-β1)
    v[i] = std::fma(s.one_minus_beta2 * g[i], g[i], v[i] * s.beta2);  // v.mul_(β2).addcmul_(g, g, 1-β2)
    const float denom = std::sqrt(v[i] / s.bias2) + s.eps;
    p[i] = p[i] + s.step_size * m[i] / denom;                  // p.addcdiv_(m, denom, step): (step·m)/denom
  }
}

// Adam with L2 regularisation: the decay goes into the gradient (a copy: g is the block scratch).
DSRUN_CLONES void l2_into_gradient(const float* p, float* g, int64_t n, float weight_decay) {
  for (int64_t i = 0; i < n; ++i) g[i] = std::fma(weight_decay, p[i], g[i]);  // g.add_(p, wd)
}

DSRUN_CLONES void sgd_block(float* p, float* buf, float* g, int64_t n, Scalars s, bool nesterov) {
  if (buf) {
    for (int64_t i = 0; i < n; ++i) {
      buf[i] = buf[i] * s.momentum + g[i];                           // buf.mul_(μ).add_(g)
      g[i] = nesterov ? std::fma(s.momentum, buf[i], g[i]) : buf[i];  // g.add(buf, μ)
    }
  }
  for (int64_t i = 0; i < n; ++i) p[i] = std::fma(s.neg_lr, g[i], p[i]);  // p.add_(g, -lr)
}

}  // namespace

uint16_t host_to_bf16(float f) {
  uint16_t h;
  narrow_bf16(&f, &h, 1);
  return h;
}
float host_from_bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }
uint16_t host_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}
float host_from_f16(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

void host_optimizer_step(const HostChunk& c, const HostStep& st) {
  Scalars s{};
  s.decay_factor = static_cast<float>(1 - st.lr * st.weight_decay);
  s.weight_decay = static_cast<float>(st.weight_decay);
  s.beta1 = static_cast<float>(st.beta1);
  s.one_minus_beta1 = static_cast<float>(1 - st.beta1);
  s.beta2 = static_cast<float>(st.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - st.beta2);
  s.bias2 = static_cast<float>(1 - std::pow(st.beta2, static_cast<double>(st.t)));
  s.eps = static_cast<float>(st.eps);
  s.step_size = static_cast<float>(-st.lr / (1 - std::pow(st.beta1, static_cast<double>(st.t))));
  s.momentum = static_cast<float>(st.momentum);
  s.neg_lr = static_cast<float>(-st.lr);
  const float scale = static_cast<float>(c.grad_scale), clip = static_cast<float>(c.clip_scale);
  const bool adam = st.rule != HostRule::Sgd;
  const bool decay = c.decay && st.weight_decay > 0;
  alignas(64) float g[kBlock];
  alignas(64) float m_wide[kBlock], v_wide[kBlock];  // bf16 states, widened for the block
  const bool wide_states = c.state_dtype == HostDType::BF16;
  DSRUN_ASSERT(c.state_dtype == HostDType::F32 || wide_states, "optimizer states in fp32 or bf16");
  for (int64_t at = 0; at < c.n; at += kBlock) {
    const int64_t n = std::min(kBlock, c.n - at);
    switch (c.grad_dtype) {
      case HostDType::F32: widen_f32(static_cast<const float*>(c.grad) + at, g, n, scale, clip); break;
      case HostDType::BF16: widen_bf16(static_cast<const uint16_t*>(c.grad) + at, g, n, scale, clip); break;
      case HostDType::F16: widen_f16(static_cast<const _Float16*>(c.grad) + at, g, n, scale, clip); break;
    }
    float* p = c.master + at;
    if (decay && st.rule != HostRule::AdamW) l2_into_gradient(p, g, n, s.weight_decay);
    // A state's block as fp32: where it lies, or widened into `wide` (bf16), null where unused.
    auto block_of = [&](void* state, float* wide) -> float* {
      if (!state || !wide_states) return state ? static_cast<float*>(state) + at : nullptr;
      widen_bf16(static_cast<const uint16_t*>(state) + at, wide, n, 1, 1);
      return wide;
    };
    auto store_block = [&](void* state, const float* wide) {
      if (state && wide_states) narrow_bf16(wide, static_cast<uint16_t*>(state) + at, n);
    };
    float* m = block_of(c.m, m_wide);
    float* v = block_of(c.v, v_wide);
    if (adam) adamw_block(p, m, v, g, n, s, decay && st.rule == HostRule::AdamW);
    else sgd_block(p, m, g, n, s, st.nesterov);
    store_block(c.m, m_wide);
    store_block(c.v, v_wide);
    if (!c.param_out) continue;
    switch (c.param_dtype) {
      case HostDType::F32: std::memcpy(static_cast<float*>(c.param_out) + at, p, static_cast<size_t>(n) * 4); break;
      case HostDType::BF16: narrow_bf16(p, static_cast<uint16_t*>(c.param_out) + at, n); break;
      case HostDType::F16: narrow_f16(p, static_cast<_Float16*>(c.param_out) + at, n); break;
    }
  }
}

HostThreadPool::HostThreadPool(int threads, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this] { work(); });
    if (cpus.empty()) continue;
    const int err = ::pthread_setaffinity_np(workers_.back().native_handle(), sizeof set, &set);
    if (err != 0) fail_at(__FILE__, __LINE__, "pthread_setaffinity_np to cores " + format_cpu_list(cpus) + ": " + std::strerror(err));
  }
}

HostThreadPool::~HostThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void HostThreadPool::run(int64_t tasks, const std::function<void(int64_t)>& task) {
  if (workers_.empty() || tasks <= 1) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  task_ = &task;
  tasks_ = tasks;
  next_ = finished_ = 0;
  ++generation_;
  wake_.notify_all();
  while (next_ < tasks_) {  // the caller works too
    const int64_t i = next_++;
    lock.unlock();
    task(i);
    lock.lock();
    ++finished_;
  }
  done_.wait(lock, [&] { return finished_ == tasks_; });
  task_ = nullptr;
}

void HostThreadPool::work() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || (generation_ != seen && task_ && next_ < tasks_); });
    if (stopping_) return;
    seen = generation_;
    while (task_ && next_ < tasks_) {
      const int64_t i = next_++;
      const auto* task = task_;
      lock.unlock();
      (*task)(i);
      lock.lock();
      if (++finished_ == tasks_) done_.notify_all();
    }
  }
}

}  // namespace dsrun
