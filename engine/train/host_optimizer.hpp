// The optimizer step on the host as one fused pass per chunk: read the gradient in its working
// dtype, update the fp32 master weights and optimizer states, write the working-dtype parameters.
// Torch-free plain loops that the compiler vectorises (AVX-512, AVX2 or SSE2, chosen at run time).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dsrun {

enum class HostDType { F32, BF16, F16 };

// One contiguous range of a shard. The states it does not use may be null (SGD without momentum
// has none; SGD uses `m` as its momentum buffer).
struct HostChunk {
  float* master = nullptr;
  void* m = nullptr;           // `n` elements of state_dtype each (F32 or BF16)
  void* v = nullptr;
  const void* grad = nullptr;  // `n` elements of grad_dtype
  HostDType grad_dtype = HostDType::F32;
  void* param_out = nullptr;   // the working parameters to write (n elements of param_dtype), or null
  HostDType param_dtype = HostDType::F32;
  double grad_scale = 1;       // averaging over ranks (1/world), applied first
  double clip_scale = 1;       // global-norm clipping (1: none), applied second
  int64_t n = 0;
  bool decay = false;          // weight decay applies here (matrices, not norms or biases)
  HostDType state_dtype = HostDType::F32;  // m's and v's
};

enum class HostRule { AdamW, Adam, Sgd };

// The step's scalars. States in bf16 are widened, updated as below and rounded to nearest as
// stored; the update of the weights uses their fp32 values. The arithmetic follows the plain expressions of ShardOptimizer as torch's
// vectorised CPU kernels round them (one rounding per op; add-with-alpha and addcmul fused multiply-adds),
// in fp32: g = (g·grad_scale)·clip_scale (the chunk's factors);
// AdamW: p·(1-lr·wd), m = m·β1 + (1-β1)·g, v = v·β2 + (1-β2)·g·g, p += (-lr/(1-β1^t) · m) / (sqrt(v/(1-β2^t)) + ε);
// Adam: g += wd·p first; SGD: g += wd·p, b = b·μ + g, g = nesterov ? g + μ·b : b, p += -lr·g.
struct HostStep {
  HostRule rule = HostRule::AdamW;
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  double momentum = 0;
  bool nesterov = false;
  int64_t t = 1;            // Adam's step count, from 1
};

void host_optimizer_step(const HostChunk& chunk, const HostStep& step);

// bf16 and fp16 as torch rounds them (to nearest, ties to even; NaN stays NaN).
uint16_t host_to_bf16(float f);
float host_from_bf16(uint16_t h);
uint16_t host_to_f16(float f);
float host_from_f16(uint16_t h);

// A fixed set of worker threads for the host step. With one thread the caller does the work.
// `cpus` (non-empty): the workers run only there (the cores near the rank's GPU); the caller's
// thread is left where it is.
class HostThreadPool {
 public:
  explicit HostThreadPool(int threads, const std::vector<int>& cpus = {});
  ~HostThreadPool();
  HostThreadPool(const HostThreadPool&) = delete;
  HostThreadPool& operator=(const HostThreadPool&) = delete;
  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs task(i) for i in [0, tasks) on the pool and the calling thread; returns when all are done.
  void run(int64_t tasks, const std::function<void(int64_t)>& task);

 private:
  void work();
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t tasks_ = 0, next_ = 0, finished_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace dsrun
