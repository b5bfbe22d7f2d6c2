#include "engine/train/optimizer.hpp"

#include "engine/common/error.hpp"

#include <cmath>

namespace dsrun {

ShardOptimizer::ShardOptimizer(const OptimizerOptions& options, std::vector<MasterShard>& shards) : o_(options), shards_(shards) {
  for (auto& s : shards_) {
    const bool sgd = o_.kind == OptimizerKind::Sgd;
    // States live beside their master weights (in pinned host memory when offloaded).
    auto like_master = [&] { return torch::zeros(s.master.sizes(), s.master.options().pinned_memory(s.master.is_pinned())); };
    m_.push_back(!sgd || o_.momentum > 0 ? like_master() : torch::Tensor());
    v_.push_back(!sgd ? like_master() : torch::Tensor());
  }
}

void ShardOptimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++t_;
  for (size_t k = 0; k < shards_.size(); ++k) {
    torch::Tensor& p = shards_[k].master;
    torch::Tensor g = shards_[k].grad;
    // Weight decay only where decay_ranges say (matrices), as a mask-free loop over ranges.
    auto decay = [&](double factor_per_param, bool into_grad) {
      for (auto [begin, end] : shards_[k].decay_ranges) {
        torch::Tensor pr = p.narrow(0, begin, end - begin);
        if (into_grad) g.narrow(0, begin, end - begin).add_(pr, factor_per_param);
        else pr.mul_(1 - factor_per_param);
      }
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
        torch::Tensor& m = m_[k];
        torch::Tensor& v = v_[k];
        m.mul_(o_.beta1).add_(g, 1 - o_.beta1);             // m = β1 m + (1-β1) g
        v.mul_(o_.beta2).addcmul_(g, g, 1 - o_.beta2);      // v = β2 v + (1-β2) g²
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
          torch::Tensor& buf = m_[k];
          buf.mul_(o_.momentum).add_(g);                     // b = μ b + g
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
