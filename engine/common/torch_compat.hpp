// The one place where libtorch versions differ: Debian's 1.13 (CPU, Gloo) and PyTorch 2.x (CUDA, NCCL).
// Everything else includes this instead of testing TORCH_VERSION itself.
#pragma once

#include "engine/common/error.hpp"

#include <torch/torch.h>
#include <torch/version.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#define DSRUN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace dsrun::compat {

// torch's profiler (Kineto: CPU operators and, on CUDA, kernels), as torch.profiler uses it;
// stop_profiler writes a Chrome trace. PyTorch 2.x's libtorch has Kineto, Debian's 1.13 not.
constexpr bool kHasTraceProfiler = DSRUN_TORCH_AT_LEAST(2, 0);
inline void start_profiler(bool cuda) {
  using namespace torch::profiler::impl;
  const ProfilerConfig config(ProfilerState::KINETO);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}
inline void stop_profiler(const std::string& trace_path) { torch::autograd::profiler::disableProfiler()->save(trace_path); }

// Whether this libtorch's vectorised CPU optimizer expressions round exactly as the fused host step
// (engine/train/host_optimizer.cpp): 1.13's do; 2.x's addcdiv rounds its quotient differently.
constexpr bool kHostStepMatchesTorchBits = !DSRUN_TORCH_AT_LEAST(2, 0);

// Causal attention over [batch, heads, seq, head_dim]. 2.x has a fused kernel (flash on CUDA);
// 1.13 gets the plain softmax(QK^T/sqrt(d))V, which keeps the probabilities for backward.
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if DSRUN_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  // Scale q (s·d elements) rather than the scores (s·s), and add a cached -inf upper triangle in
  // place: the matmul's backward needs its inputs, not its output.
  const int64_t s = q.size(-2);
  static thread_local std::map<std::pair<int64_t, c10::ScalarType>, torch::Tensor> causal_bias;
  torch::Tensor& bias = causal_bias[{s, q.scalar_type()}];
  if (!bias.defined())
    bias = torch::full({s, s}, -std::numeric_limits<float>::infinity(), q.options()).triu(1);
  auto scores = torch::matmul(q * (1.0 / std::sqrt(static_cast<double>(q.size(-1)))), k.transpose(-2, -1));
  scores.add_(bias);
  return torch::matmul(torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type()), v);
#endif
}

// Attention with an additive bias [b, 1, s, s] in q's dtype (0 where a query may attend to a key,
// -inf where not): documents packed into one row. 2.x picks the memory-efficient kernel on CUDA
// (flash takes no mask) and the math kernel on the CPU; both touch all s·s scores (docs/data.md).
inline torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& bias) {
#if DSRUN_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, bias, /*dropout_p=*/0.0, /*is_causal=*/false);
#else
  auto scores = torch::matmul(q * (1.0 / std::sqrt(static_cast<double>(q.size(-1)))), k.transpose(-2, -1));
  scores.add_(bias);
  return torch::matmul(torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type()), v);
#endif
}

// Causal attention within documents packed one after another: q [tokens, heads, head_dim], k and v
// [tokens, kv_heads, head_dim] (heads a multiple of kv_heads), document d holding tokens
// cu_seqlens[d] .. cu_seqlens[d+1] ([documents + 1] int32 on q's device), none longer than
// `longest`. PyTorch >= 2.2 has FlashAttention-2's variable-length kernel (with autograd) for fp16
// and bf16 on CUDA; it computes only each document's own causal triangle. Where it does not apply
// (1.13, CPUs, fp32) callers take the masked path (engine/model/document_attention.cpp).
inline bool varlen_attention_applies(const torch::Tensor& q) {
#if DSRUN_TORCH_AT_LEAST(2, 2)
  const auto dtype = q.scalar_type();
  return q.is_cuda() && (dtype == torch::kBFloat16 || dtype == torch::kFloat16) && q.size(-1) % 8 == 0 && q.size(-1) <= 256;
#else
  (void)q;
  return false;
#endif
}
inline torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cu_seqlens, int64_t longest) {
#if DSRUN_TORCH_AT_LEAST(2, 2)
  return std::get<0>(at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, longest, longest, /*dropout_p=*/0.0, /*is_causal=*/true,
                                                  /*return_debug_mask=*/false));
#else
  (void)k, (void)v, (void)cu_seqlens, (void)longest;
  DSRUN_ASSERT(false, "this libtorch has no variable-length attention kernel");
  return q;
#endif
}

// acc = beta · acc + alpha · a · b with acc fp32 and a, b in a lower precision, products summed in
// fp32 and rounded once (cuBLAS's bf16 x bf16 -> fp32 on CUDA with PyTorch >= 2.9); elsewhere the
// product in a's dtype, then added. With beta 0 acc's old values are not read (it may be uninitialised).
inline void addmm_fp32(torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta = 1) {
#if DSRUN_TORCH_AT_LEAST(2, 9)
  if (a.is_cuda() && a.scalar_type() != torch::kFloat32) {
    at::addmm_out(acc, acc, a, b, torch::kFloat32, beta, alpha);
    return;
  }
#endif
  if (a.scalar_type() == torch::kFloat32) acc.addmm_(a, b, beta, alpha);
  else if (beta == 0) acc.copy_(torch::mm(a, b).to(torch::kFloat32).mul_(alpha));
  else {
    if (beta != 1) acc.mul_(beta);
    acc.add_(torch::mm(a, b).to(torch::kFloat32), alpha);
  }
}

// a · b in fp32 from lower-precision a and b (the same rounding as addmm_fp32).
inline torch::Tensor mm_fp32(const torch::Tensor& a, const torch::Tensor& b) {
#if DSRUN_TORCH_AT_LEAST(2, 9)
  if (a.is_cuda() && a.scalar_type() != torch::kFloat32) return at::mm(a, b, torch::kFloat32);
#endif
  return torch::mm(a, b).to(torch::kFloat32);
}

// One fused Adam (L2) or AdamW (decoupled) update over lists of fp32 tensors, every list on one
// device: PyTorch >= 2.4 has multi-tensor kernels for CUDA and CPU (the same update as the plain
// expressions in optimizer.cpp, in one pass over memory). False where this libtorch has none.
// `step` is the bias-correction step count, a scalar float tensor on the tensors' device;
// `grad_divisor`, if defined (a scalar float tensor there), divides every gradient as it is read.
// kHasFusedAdam says at compile time whether it does anything.
constexpr bool kHasFusedAdam = DSRUN_TORCH_AT_LEAST(2, 4);
inline bool fused_adam_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                            const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                            const torch::Tensor& step, double lr, double beta1, double beta2, double weight_decay, double eps,
                            bool decoupled, const torch::Tensor& grad_divisor = {}) {
#if DSRUN_TORCH_AT_LEAST(2, 4)
  std::vector<torch::Tensor> steps(params.size(), step);
  const c10::optional<torch::Tensor> divisor = grad_divisor.defined() ? c10::optional<torch::Tensor>(grad_divisor) : c10::nullopt;
  if (decoupled)
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false, divisor);
  else
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false, divisor);
  return true;
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)step, (void)lr, (void)beta1, (void)beta2;
  (void)weight_decay, (void)eps, (void)decoupled, (void)grad_divisor;
  return false;
#endif
}

// Σ over the tensors of Σ x², as an fp64 scalar where they are, each tensor's norm read in fp32:
// one multi-tensor kernel (at::_foreach_norm) from PyTorch 2.4, a norm per tensor before.
inline torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& tensors) {
#if DSRUN_TORCH_AT_LEAST(2, 4)
  const std::vector<torch::Tensor> norms = at::_foreach_norm(tensors, 2, torch::kFloat32);
#else
  std::vector<torch::Tensor> norms;
  for (const auto& t : tensors) norms.push_back(at::linalg_vector_norm(t, 2, c10::nullopt, false, torch::kFloat32));
#endif
  return torch::stack(norms).to(torch::kFloat64).pow(2).sum();
}

// Grouped matrix products over rows grouped by expert; `offs` holds the groups' cumulative row
// ends ([G] int32 on a's device, the last equal to the rows). Two forms, as at::_grouped_mm has:
//   a [M, K], b [G, K, N] -> [M, N]: rows offs[g-1]..offs[g] of a times b[g];
//   a [K, M], b [M, N]    -> [G, K, N]: the groups split the shared dimension M (weight gradients).
// grouped_mm_loop is the reference: one mm per group, reading the offsets on the host. grouped_mm
// runs PyTorch >= 2.8's kernel (CUTLASS for bf16 on Hopper) on CUDA with no host synchronisation,
// for bf16 and fp32 where its layout rules hold (K and N multiples of 16 bytes), and the loop
// elsewhere (1.13, CPUs).
inline torch::Tensor grouped_mm_loop(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs) {
  const torch::Tensor ends_host = offs.to(torch::kCPU, torch::kInt64);
  const int64_t* ends = ends_host.data_ptr<int64_t>();
  const int64_t groups = offs.size(0);
  torch::Tensor out = b.dim() == 3 ? torch::zeros({a.size(0), b.size(2)}, a.options()) : torch::zeros({groups, a.size(0), b.size(1)}, a.options());
  int64_t begin = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = ends[g] - begin;
    if (rows > 0) {
      if (b.dim() == 3) {
        torch::Tensor dst = out.narrow(0, begin, rows);
        at::mm_out(dst, a.narrow(0, begin, rows), b[g]);
      } else {
        torch::Tensor dst = out[g];
        at::mm_out(dst, a.narrow(1, begin, rows), b.narrow(0, begin, rows));
      }
    }
    begin = ends[g];
  }
  return out;
}

inline bool grouped_mm_kernel_applies(const torch::Tensor& a, const torch::Tensor& b) {
#if DSRUN_TORCH_AT_LEAST(2, 8)
  const auto dtype = a.scalar_type();  // (2.11 on an H100 takes both; fp16 is left to the loop)
  if (!a.is_cuda() || a.numel() == 0 || dtype != b.scalar_type() || (dtype != torch::kBFloat16 && dtype != torch::kFloat32)) return false;
  const int64_t align = 16 / a.element_size();  // the rows of every operand start 16-byte aligned
  const int64_t k = b.dim() == 3 ? a.size(1) : a.size(0), n = b.size(-1);
  auto aligned = [](const torch::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };  // (a view into a flat buffer may not be)
  return k % align == 0 && n % align == 0 && aligned(a) && aligned(b);
#else
  (void)a, (void)b;
  return false;
#endif
}

inline torch::Tensor grouped_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs) {
#if DSRUN_TORCH_AT_LEAST(2, 8)
  if (grouped_mm_kernel_applies(a, b)) return at::_grouped_mm(a, b, offs);
#endif
  return grouped_mm_loop(a, b, offs);
}

}  // namespace dsrun::compat

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace dsrun::compat {

// The class that ProcessGroupGloo/NCCL derive from: ProcessGroup in 1.13, Backend in 2.x.
#if DSRUN_TORCH_AT_LEAST(2, 0)
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif

// Operations that `issue(works)` starts on `group`, issued as one NCCL group (ncclGroupStart/End),
// as torch.distributed.batch_isend_irecv issues them; returns every work to wait for. c10d's
// coalescing API differs: 1.13's ProcessGroup ends a group with endCoalescing(works), finishing the
// operations' own works; 2.11's Backend returns the group's work from endCoalescing() (null when
// nothing was issued), and an operation's own may be null. The switch is taken at 2.1, whose
// coalescing manager waits on the work endCoalescing returns (2.0 is assumed to keep 1.13's form).
// Only NCCL implements it: 1.13's Gloo ignores it, 2.x's refuses it.
template <class Issue>
std::vector<c10::intrusive_ptr<c10d::Work>> coalesced(CollectiveBackend& group, Issue&& issue) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  group.startCoalescing();
  try {
    issue(works);
  } catch (...) {
    try {  // leave the group usable; the first error is the one to report
#if DSRUN_TORCH_AT_LEAST(2, 1)
      group.endCoalescing();
#else
      group.endCoalescing(works);
#endif
    } catch (...) {
    }
    throw;
  }
#if DSRUN_TORCH_AT_LEAST(2, 1)
  works.push_back(group.endCoalescing());
#else
  group.endCoalescing(works);
#endif
  works.erase(std::remove_if(works.begin(), works.end(), [](const c10::intrusive_ptr<c10d::Work>& w) { return !w; }), works.end());
  return works;
}


// torch's scaled FP8 matrix product (PyTorch >= 2.5, CUDA: row scales need 2.5): a [M, K] row-major,
// b [K, N] column-major, FP8; scale_a and scale_b fp32, one element each (tensorwise) or [M, 1] and
// [1, N] (rowwise): out = (a · scale_a) (b · scale_b) in bf16, accumulated in fp32.
constexpr bool kHasScaledMm = DSRUN_TORCH_AT_LEAST(2, 5);
// DeepSeek-V3's block scales (a's [M, K/128], b's per 128 x 128 or 1 x 128; cuBLASLt, CUDA 12.9 and
// Hopper) through the same entry point: PyTorch 2.9.
constexpr bool kHasBlockwiseScaledMm = DSRUN_TORCH_AT_LEAST(2, 9);
inline torch::Tensor scaled_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& scale_a, const torch::Tensor& scale_b) {
#if DSRUN_TORCH_AT_LEAST(2, 5)
  return at::_scaled_mm(a, b, scale_a, scale_b, std::nullopt, std::nullopt, torch::kBFloat16, false);
#else
  (void)a, (void)b, (void)scale_a, (void)scale_b;
  fail_at(__FILE__, __LINE__, "FP8 products need PyTorch 2.5 or later (precision.fp8)");
#endif
}

// torch's grouped scaled FP8 product with row scales (CUTLASS on Hopper; PyTorch 2.8 has it, 2.9 is
// the first dsrun relies on, 2.11 the one measured): a [M, K] row-major E4M3 with rows grouped as
// grouped_mm's `offs` says, b [G, K, N] column-major in each group (the transpose of a contiguous
// [G, N, K]) E4M3; scale_a [M] and scale_b [G, N] fp32: out [M, N] in bf16, accumulated in fp32.
// K and N multiples of 16. fast_accum: CUTLASS's FP8 schedule that adds the tensor cores' partial
// sums without promoting them to fp32 every few steps (faster, less exact; torchao takes it for
// forward's products and not for gradients').
constexpr bool kHasScaledGroupedMm = DSRUN_TORCH_AT_LEAST(2, 9);
inline torch::Tensor scaled_grouped_mm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& scale_a, const torch::Tensor& scale_b,
                                       const torch::Tensor& offs, bool fast_accum = false) {
#if DSRUN_TORCH_AT_LEAST(2, 9)
  return at::_scaled_grouped_mm(a, b, scale_a, scale_b, offs, std::nullopt, std::nullopt, torch::kBFloat16, fast_accum);
#else
  (void)a, (void)b, (void)scale_a, (void)scale_b, (void)offs, (void)fast_accum;
  fail_at(__FILE__, __LINE__, "grouped FP8 products need PyTorch 2.9 or later (execution.fp8_routed_experts)");
#endif
}

// The two FP8 kinds of torch (PyTorch >= 2.1): E4M3 ("fn": finite, max 448) for weights and
// activations, E5M2 (max 57344) for gradients.
inline torch::ScalarType fp8_dtype(bool e5m2) {
#if DSRUN_TORCH_AT_LEAST(2, 1)
  return e5m2 ? torch::kFloat8_e5m2 : torch::kFloat8_e4m3fn;
#else
  (void)e5m2;
  fail_at(__FILE__, __LINE__, "FP8 tensors need PyTorch 2.1 or later (precision.fp8)");
#endif
}

}  // namespace dsrun::compat
