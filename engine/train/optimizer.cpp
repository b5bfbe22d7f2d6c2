#include "engine/train/optimizer.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/parallel/copy_stream.hpp"

#ifdef DSRUN_WITH_FUSED_KERNELS
#include "engine/model/fused_kernels.h"
#include "engine/train/adam_kernel.h"

#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
#include <cmath>
#include <map>

namespace dsrun {

namespace {
// Calls fn(begin, end, decay) for the pieces of [from, to) that get weight decay and those that do
// not, in order, none empty (decay_ranges: ascending and disjoint, flat_layout.cpp).
void for_each_decay_piece(const MasterShard& s, int64_t from, int64_t to, const std::function<void(int64_t, int64_t, bool)>& fn) {
  int64_t at = from;
  for (auto [begin, end] : s.decay_ranges) {
    const int64_t b = std::max(begin, from), e = std::min(end, to);
    if (b >= e) continue;
    if (at < b) fn(at, b, false);
    fn(b, e, true);
    at = e;
  }
  if (at < to) fn(at, to, false);
}

HostDType host_dtype(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return HostDType::F32;
    case torch::kBFloat16: return HostDType::BF16;
    case torch::kFloat16: return HostDType::F16;
    default: fail_at(__FILE__, __LINE__, std::string("no host step for ") + c10::toString(t.scalar_type()));
  }
}
}  // namespace

ShardOptimizer::ShardOptimizer(const OptimizerOptions& options, std::vector<MasterShard>& shards, int host_threads, const std::vector<int>& host_cpus)
    : o_(options), shards_(shards), pool_(std::max(1, host_threads), host_cpus) {
  // States live beside their master weights (in pinned host memory when offloaded), each state in
  // one block sliced per shard (the pinned allocator would round per-shard blocks up to powers of
  // two), in optimizer.state_dtype.
  const bool sgd = o_.kind == OptimizerKind::Sgd;
  const torch::ScalarType state_type = o_.state_dtype == DType::Bf16 ? torch::kBFloat16 : torch::kFloat32;
  // Each shard's slot starts on a boundary of four elements, as its master does on a 16-byte one (its
  // own allocation): the device kernel reads four elements at a time where master and states are aligned alike.
  auto aligned = [](int64_t n) { return (n + 3) / 4 * 4; };
  int64_t total = 0;
  for (auto& s : shards_) total += aligned(s.master.numel());
  auto block = [&] {
    if (shards_.empty()) return torch::Tensor();
    const auto& first = shards_[0].master;
    if (!first.is_pinned()) return torch::zeros({total}, first.options().dtype(state_type));
    try {
      return pinned_host_tensor(total, state_type).zero_();
    } catch (const std::exception& e) {  // out of pinnable host memory: say which setting holds it
      ErrorContext c;
      c.key = "parallel.offload";
      c.hint = "the plan's host table counts what offload holds; check hardware.host_memory_gib against this machine, or offload less";
      throw Error("the offloaded optimizer states: " + std::string(e.what()), c);
    }
  };
  torch::Tensor m_block = !sgd || o_.momentum > 0 ? block() : torch::Tensor(), v_block = !sgd ? block() : torch::Tensor();
  int64_t at = 0;
  for (auto& s : shards_) {
    const int64_t n = s.master.numel();
    m_.push_back(m_block.defined() ? m_block.narrow(0, at, n) : torch::Tensor());
    v_.push_back(v_block.defined() ? v_block.narrow(0, at, n) : torch::Tensor());
    at += aligned(n);
  }
}

void ShardOptimizer::device_adam_step(double lr) {
#ifdef DSRUN_WITH_FUSED_KERNELS
  const double t = static_cast<double>(t_);
  const float bias1 = static_cast<float>(1 - std::pow(o_.beta1, t)), bias2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(o_.beta2, t)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  auto dtype = [](const torch::Tensor& x) { return x.scalar_type() == torch::kBFloat16 ? DSRUN_BF16 : x.scalar_type() == torch::kFloat16 ? DSRUN_F16 : DSRUN_F32; };
  for (size_t k = 0; k < shards_.size(); ++k) {
    MasterShard& s = shards_[k];
    const torch::Tensor& out = s.param_out;
    const float factor = static_cast<float>(s.grad_scale * s.clip_scale);
    const float* divisor = s.clip_divisor.defined() ? s.clip_divisor.data_ptr<float>() : nullptr;
    // Elements [begin, end) of the shard, whose gradient starts at `grad`.
    auto launch = [&](int64_t begin, int64_t end, bool decay, const torch::Tensor& g, int64_t g_begin) {
      dsrun_adam_step(s.master.data_ptr<float>() + begin, static_cast<char*>(m_[k].data_ptr()) + begin * m_[k].element_size(),
                      static_cast<char*>(v_[k].data_ptr()) + begin * v_[k].element_size(), dtype(m_[k]), static_cast<const char*>(g.data_ptr()) + g_begin * g.element_size(), dtype(g),
                      out.defined() ? static_cast<char*>(out.data_ptr()) + begin * out.element_size() : nullptr,
                      out.defined() ? dtype(out) : DSRUN_F32, end - begin, factor, divisor, static_cast<float>(lr),
                      static_cast<float>(o_.beta1), static_cast<float>(o_.beta2), static_cast<float>(o_.eps),
                      decay ? static_cast<float>(o_.weight_decay) : 0.0f, o_.kind == OptimizerKind::AdamW ? 1 : 0, bias1, bias2_sqrt, stream);
      if (const char* e = dsrun_adam_last_error()) fail_at(__FILE__, __LINE__, std::string("the Adam kernel's launch failed: ") + e);
    };
    DSRUN_ASSERT(s.master.is_contiguous(), "device step: a contiguous master");
    if (s.grad_pieces.empty()) {
      DSRUN_ASSERT(s.grad.is_contiguous() && s.grad.numel() == s.master.numel(), "device step: a contiguous gradient as long as the master");
      for_each_decay_piece(s, 0, s.master.numel(), [&](int64_t b, int64_t e, bool decay) { launch(b, e, decay, s.grad, b); });
    } else {
      for (const auto& [offset, piece] : s.grad_pieces) {
        DSRUN_ASSERT(piece.is_contiguous() && offset + piece.numel() <= s.master.numel(), "device step: contiguous gradient pieces within the master");
        for_each_decay_piece(s, offset, offset + piece.numel(), [&, offset = offset, &piece = piece](int64_t b, int64_t e, bool decay) { launch(b, e, decay, piece, b - offset); });
      }
    }
    s.params_written = out.defined();
  }
#else
  (void)lr;
  fail_at(__FILE__, __LINE__, "this build has no device Adam kernel (kHasDeviceAdamKernel)");
#endif
}

// Adam/AdamW through libtorch's fused multi-tensor kernel, where it has one: the shards cut into
// the ranges that get weight decay and those that do not, one call for each group.
void ShardOptimizer::fused_adam_step(double lr) {
  if (shards_.empty()) return;
  // Per factor (grad_scale · clip_scale, which the kernel divides out as it reads the gradient:
  // expert shards average over fewer ranks than the others) and weight decay: [0] none, [1] decay.
  struct Lists {
    std::vector<torch::Tensor> p[2], g[2], m[2], v[2];
  };
  std::map<double, Lists> by_factor;
  for (size_t k = 0; k < shards_.size(); ++k) {
    MasterShard& s = shards_[k];
    DSRUN_ASSERT(!s.clip_divisor.defined(), "libtorch's fused Adam applies no clipping decided on the device");
    const torch::Tensor grad = s.flat_grad();
    Lists& l = by_factor[s.grad_scale * s.clip_scale];
    for_each_decay_piece(s, 0, s.master.numel(), [&](int64_t begin, int64_t end, bool decay) {
      const int group = decay ? 1 : 0;
      l.p[group].push_back(s.master.narrow(0, begin, end - begin));
      l.g[group].push_back(grad.narrow(0, begin, end - begin));
      l.m[group].push_back(m_[k].narrow(0, begin, end - begin));
      l.v[group].push_back(v_[k].narrow(0, begin, end - begin));
    });
  }
  const auto options = shards_[0].master.options();
  torch::Tensor step = torch::full({}, static_cast<double>(t_), options);
  const bool decoupled = o_.kind == OptimizerKind::AdamW;
  for (auto& [factor, l] : by_factor) {
    const torch::Tensor divisor = factor == 1 ? torch::Tensor() : torch::full({}, 1.0 / factor, options);
    for (int group : {0, 1}) {
      if (l.p[group].empty()) continue;
      const double wd = group == 1 ? o_.weight_decay : 0.0;
      compat::fused_adam_step(l.p[group], l.g[group], l.m[group], l.v[group], step, lr, o_.beta1, o_.beta2, wd, o_.eps, decoupled, divisor);
    }
  }
}

HostStep ShardOptimizer::host_step_scalars(double lr) const {
  HostStep st;
  st.rule = o_.kind == OptimizerKind::AdamW ? HostRule::AdamW : o_.kind == OptimizerKind::Adam ? HostRule::Adam : HostRule::Sgd;
  st.lr = lr;
  st.beta1 = o_.beta1;
  st.beta2 = o_.beta2;
  st.eps = o_.eps;
  st.weight_decay = o_.weight_decay;
  st.momentum = o_.momentum;
  st.nesterov = o_.nesterov;
  st.t = t_;
  return st;
}

std::vector<std::vector<HostChunk>> ShardOptimizer::host_chunks() const {
  constexpr int64_t kHostChunk = 1 << 16;
  std::vector<std::vector<HostChunk>> all(shards_.size());
  for (size_t k = 0; k < shards_.size(); ++k) {
    const MasterShard& s = shards_[k];
    DSRUN_ASSERT(s.grad.device().is_cpu() && s.grad.is_contiguous() && s.master.is_contiguous(), "host gradient and shard, contiguous");
    const HostDType grad_dtype = host_dtype(s.grad);
    const auto* grad = static_cast<const char*>(s.grad.data_ptr());
    auto* out = s.param_out.defined() ? static_cast<char*>(s.param_out.data_ptr()) : nullptr;
    auto add = [&](int64_t begin, int64_t end, bool decay) {
      for (int64_t at = begin; at < end; at += kHostChunk) {
        HostChunk c;
        c.master = s.master.data_ptr<float>() + at;
        c.m = m_[k].defined() ? static_cast<char*>(m_[k].data_ptr()) + at * m_[k].element_size() : nullptr;
        c.v = v_[k].defined() ? static_cast<char*>(v_[k].data_ptr()) + at * v_[k].element_size() : nullptr;
        c.state_dtype = o_.state_dtype == DType::Bf16 ? HostDType::BF16 : HostDType::F32;
        c.grad = grad + at * s.grad.element_size();
        c.grad_dtype = grad_dtype;
        c.grad_scale = s.grad_scale;
        c.clip_scale = s.clip_scale;
        if (out) {
          c.param_out = out + at * s.param_out.element_size();
          c.param_dtype = host_dtype(s.param_out);
        }
        c.n = std::min(kHostChunk, end - at);
        c.decay = decay;
        all[k].push_back(c);
      }
    };
    for_each_decay_piece(s, 0, s.master.numel(), add);
  }
  return all;
}

// The chunks are disjoint: the pool runs them in any order.
void ShardOptimizer::host_step(double lr) {
  const HostStep st = host_step_scalars(lr);
  std::vector<HostChunk> chunks;
  for (auto& shard : host_chunks()) chunks.insert(chunks.end(), shard.begin(), shard.end());
  pool_.run(static_cast<int64_t>(chunks.size()), [&](int64_t i) { host_optimizer_step(chunks[static_cast<size_t>(i)], st); });
  for (auto& s : shards_) s.params_written = s.param_out.defined();
}

std::function<void(size_t)> ShardOptimizer::host_update(double lr) {
  DSRUN_ASSERT(!shards_.empty() && shards_[0].master.device().is_cpu(), "host_update is for master weights in host memory");
  ++t_;
  auto chunks = std::make_shared<std::vector<std::vector<HostChunk>>>(host_chunks());
  const HostStep st = host_step_scalars(lr);
  for (auto& s : shards_) s.params_written = s.param_out.defined();
  return [this, chunks, st](size_t k) {
    const std::vector<HostChunk>& mine = chunks->at(k);
    pool_.run(static_cast<int64_t>(mine.size()), [&](int64_t i) { host_optimizer_step(mine[static_cast<size_t>(i)], st); });
  };
}

void ShardOptimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++t_;
  if (!shards_.empty() && shards_[0].master.device().is_cpu()) {
    for (auto& s : shards_)
      if (!s.grad.defined()) s.grad = s.flat_grad();  // (the host step reads one flat gradient)
    host_step(lr);
    return;
  }
  if (o_.kind != OptimizerKind::Sgd && kHasDeviceAdamKernel && !shards_.empty() && shards_[0].master.is_cuda()) {
    device_adam_step(lr);
    return;
  }
  if (o_.kind != OptimizerKind::Sgd && compat::kHasFusedAdam && o_.state_dtype == DType::Fp32) {
    fused_adam_step(lr);
    return;
  }
  for (size_t k = 0; k < shards_.size(); ++k) {
    torch::Tensor& p = shards_[k].master;
    torch::Tensor g = shards_[k].flat_grad();
    if (const double factor = shards_[k].grad_scale * shards_[k].clip_scale; factor != 1) g.mul_(factor);  // (left to the step: ZeroOptions::step_applies_scales)
    // Weight decay only where decay_ranges say (matrices), as a mask-free loop over ranges.
    // One multi-tensor call for all ranges: a ResNet's shard has one range per convolution, and a
    // call each cost the host more than the GPU's work.
    auto decay = [&](double factor_per_param, bool into_grad) {
      std::vector<torch::Tensor> ps, gs;
      for (auto [begin, end] : shards_[k].decay_ranges) {
        ps.push_back(p.narrow(0, begin, end - begin));
        if (into_grad) gs.push_back(g.narrow(0, begin, end - begin));
      }
      if (ps.empty()) return;
      if (into_grad) torch::_foreach_add_(gs, ps, factor_per_param);
      else torch::_foreach_mul_(ps, 1 - factor_per_param);
    };
    switch (o_.kind) {
      case OptimizerKind::AdamW:
      case OptimizerKind::Adam: {
        if (o_.weight_decay > 0) {
          if (o_.kind == OptimizerKind::AdamW) decay(lr * o_.weight_decay, false);  // decoupled: p -= lr·wd·p
          else {
            g = g.clone();
            decay(o_.weight_decay, true);  // L2: g += wd·p
          }
        }
        // (states in bf16: updated in fp32, as the kernels do, and rounded once as stored)
        torch::Tensor m = m_[k].to(torch::kFloat32), v = v_[k].to(torch::kFloat32);
        m.mul_(o_.beta1).add_(g, 1 - o_.beta1);             // m = β1 m + (1-β1) g
        v.mul_(o_.beta2).addcmul_(g, g, 1 - o_.beta2);      // v = β2 v + (1-β2) g²
        if (!m.is_same(m_[k])) m_[k].copy_(m), v_[k].copy_(v);
        const double bias1 = 1 - std::pow(o_.beta1, static_cast<double>(t_));
        const double bias2 = 1 - std::pow(o_.beta2, static_cast<double>(t_));
        torch::Tensor denom = (v / bias2).sqrt_().add_(o_.eps);  // sqrt(v̂) + ε
        p.addcdiv_(m, denom, -lr / bias1);                   // p -= lr · m̂ / (sqrt(v̂) + ε)
        break;
      }
      case OptimizerKind::Sgd: {
        if (o_.weight_decay > 0) {
          g = g.clone();
          decay(o_.weight_decay, true);
        }
        if (o_.momentum > 0) {
          torch::Tensor buf = m_[k].to(torch::kFloat32);
          buf.mul_(o_.momentum).add_(g);                     // b = μ b + g
          if (!buf.is_same(m_[k])) m_[k].copy_(buf);
          if (o_.nesterov) g = g.add(buf, o_.momentum);      // g + μ b
          else g = buf;
        }
        p.add_(g, -lr);
        break;
      }
    }
  }
}

std::vector<std::string> ShardOptimizer::state_names() const {
  if (o_.kind != OptimizerKind::Sgd) return {"exp_avg", "exp_avg_sq"};
  if (o_.momentum > 0) return {"momentum_buffer"};
  return {};
}

torch::Tensor& ShardOptimizer::state(const std::string& name, size_t k) {
  if (name == "exp_avg" || name == "momentum_buffer") return m_.at(k);
  DSRUN_ASSERT(name == "exp_avg_sq", "known optimizer state " + name);
  return v_.at(k);
}

double ShardOptimizer::state_bytes() const {
  double bytes = 0;
  for (const auto& t : m_)
    if (t.defined()) bytes += static_cast<double>(t.numel() * t.element_size());
  for (const auto& t : v_)
    if (t.defined()) bytes += static_cast<double>(t.numel() * t.element_size());
  return bytes;
}

}  // namespace dsrun
