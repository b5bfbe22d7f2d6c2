#include "engine/parallel/master_shards.hpp"

#include "engine/common/error.hpp"
#include "engine/model/fused_ops.hpp"

#include <cmath>

namespace dsrun {

using torch::Tensor;

namespace {

// A gradient in fp32 with its factors applied, with the same roundings as the fused host step:
// (g · grad_scale) · clip_scale, each in fp32.
Tensor scaled_fp32(const Tensor& grad, double grad_scale, double clip_scale) {
  Tensor g = grad.to(torch::kFloat32);
  if (grad_scale != 1) g = g * grad_scale;
  if (clip_scale != 1) g = g * clip_scale;
  return g;
}

}  // namespace

Tensor squared_norm(const Tensor& g, double scale) {
  if (g.is_cuda())
    return at::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kFloat32).to(torch::kFloat64).pow(2).mul(scale * scale);
  return scaled_fp32(g, scale, 1).pow(2).sum().to(torch::kFloat64);
}

Tensor MasterShard::scaled_grad() const {
  Tensor g = scaled_fp32(flat_grad(), grad_scale, clip_scale);
  if (clip_divisor.defined()) g = g / clip_divisor.to(g.device());
  return g;
}

Tensor MasterShard::flat_grad() const {
  if (grad.defined() || grad_pieces.empty()) return grad;
  Tensor flat = torch::zeros({master.numel()}, grad_pieces[0].second.options());
  for (const auto& [offset, piece] : grad_pieces) flat.narrow(0, offset, piece.numel()).copy_(piece);
  return flat;
}

void MasterShards::add(const FlatUnit& u, const Tensor& flat32, HostBuffers& host) {
  const FlatUnitLayout& l = u.layout;
  const auto compute = torch_dtype(options_.dtype);
  const bool mixed = compute != torch::kFloat32;
  Tensor region32 = flat32.narrow(0, l.shard_begin, l.shard);
  MasterShard m;
  if (mixed) m.master = region32.clone();
  else m.master = u.working_slice();  // fp32: updated in place
  if (options_.offload) m.master = host.copy("master weights", region32);
  // The host step writes the working parameters itself: into their slice where it is in host
  // memory too, else into a pinned buffer that goes up in one copy (also on the host with the
  // delayed update, whose parameters change only between steps). The gradient shard comes
  // down into a buffer of its own, which the host step reads while the next step computes.
  if (m.master.device().is_cpu() && (mixed || options_.offload)) {
    Tensor slot = u.working_slice();
    m.param_out = slot.device().is_cpu() && !options_.delayed_update ? slot : host.copy("upload buffers", torch::empty({l.shard}, slot.options().device(torch::kCPU)));
  } else if (mixed && options_.step_reads_working_gradient && !m.master.device().is_cpu()) {
    m.param_out = u.working_slice();  // the device step writes them
  }
  if (options_.offload) {
    const auto gradient = torch_dtype(options_.gradient_dtype());
    auto staging = [&](const std::string& purpose) { return host.copy(purpose, torch::zeros({l.shard}, torch::TensorOptions().dtype(gradient))); };
    m.grad_staging = staging("gradient staging");
    if (options_.delayed_update) m.grad_staging_spare = staging("gradient staging (delayed update)");
  }
  m.decay_ranges = l.decay_ranges;
  shards_.push_back(std::move(m));
}

void MasterShards::take_reduced(size_t k, const Tensor& reduced, bool came_down) {
  MasterShard& m = shards_.at(k);
  const double inv_world = 1.0 / data_group_.world_size();
  if (m.master.device().is_cpu()) {  // the fused host step reads it as it is
    if (came_down) {
      m.grad = m.grad_staging;
    } else {
      // The norm is taken where the gradient is (on the GPU: no fp32 copy on the host).
      m.grad_sq = squared_norm(reduced, inv_world);
      m.grad = m.grad_staging.defined() ? m.grad_staging.copy_(reduced) : reduced.to(torch::kCPU);
    }
    m.form = GradientForm::Reduced;
    m.grad_scale = inv_world;
    m.clip_scale = 1;
  } else if (options_.step_applies_scales && reduced.is_cuda()) {
    m.grad_sq = squared_norm(reduced, inv_world);
    m.grad = options_.step_reads_working_gradient ? reduced : reduced.to(m.master.device(), torch::kFloat32);
    m.form = GradientForm::Reduced;
    m.grad_scale = inv_world;
    m.clip_scale = 1;
  } else {
    m.grad = reduced.to(m.master.device(), torch::kFloat32).mul_(inv_world);
    m.form = GradientForm::Fp32;
  }
}

void MasterShards::take_autograd_gradients(size_t k) {
  const FlatUnit& u = units_[k];
  MasterShard& m = shards_.at(k);
  m.grad = Tensor();
  m.grad_pieces.clear();
  std::vector<Tensor> pieces;
  for (size_t i = 0; i < u.params.size(); ++i) {
    Tensor g = u.params[i].grad();
    // A parameter this step did not reach gets a zero gradient, as the flat buffer would hold.
    g = g.defined() ? g.contiguous().view({-1}) : torch::zeros({u.layout.numels[i]}, u.params[i].options());
    m.grad_pieces.push_back({u.layout.offsets[i], g});
    pieces.push_back(g);
  }
  m.grad_sq = fused::sum_of_squares(pieces);
  m.form = GradientForm::Pieces;
  m.grad_scale = 1;
  m.clip_scale = 1;
}

Tensor MasterShards::gradient_squares() {
  // Summed in fp64, shard by shard, where the squares are. Only units laid out with
  // separate_replicated_norm have replicated ranges; otherwise that part is 0.
  Tensor total, replicated, experts;
  auto add = [](Tensor& sum, const Tensor& term) {
    if (!sum.defined()) sum = torch::zeros({}, term.options());
    sum += term;
  };
  for (size_t k = 0; k < shards_.size(); ++k) {
    const MasterShard& s = shards_[k];
    // (grad_sq leaves out clip_scale, which by now holds fp16's unscaling alone, if anything)
    Tensor squares = !s.grad_sq.defined() ? s.scaled_grad().pow(2).sum().to(torch::kFloat64) : s.clip_scale == 1 ? s.grad_sq : s.grad_sq * (s.clip_scale * s.clip_scale);
    add(units_[k].routed_experts ? experts : total, squares);
    if (units_[k].replicated_ranges.empty()) continue;
    Tensor g = s.scaled_grad();
    for (const auto& [begin, end] : units_[k].replicated_ranges) add(replicated, g.narrow(0, begin, end - begin).pow(2).sum().to(torch::kFloat64));
  }
  const Tensor& any = total.defined() ? total : replicated.defined() ? replicated : experts;
  const auto options = any.defined() ? any.options() : torch::TensorOptions().dtype(torch::kFloat64);
  for (Tensor* t : {&total, &replicated, &experts})
    if (!t->defined()) *t = torch::zeros({}, options);
  // Shards are disjoint over the data ranks (stage 1-3), and so are the expert shards; at stage 0
  // every rank holds whole gradients, the same as the ranks keeping the same experts.
  Tensor sums = torch::stack({total - replicated, replicated, experts});
  if (options_.stage == 0) sums.narrow(0, 0, 2).zero_();
  if (options_.stage == 0 && options_.expert_replicas) sums.narrow(0, 2, 1).div_(options_.expert_replicas->world_size());
  if (options_.stage >= 1 || options_.expert_replicas) data_group_.all_reduce_sum(sums);
  if (options_.stage == 0) return torch::stack({total - replicated + sums[2], replicated});
  return torch::stack({sums[0] + sums[2], sums[1]});
}

double MasterShards::global_norm() {
  const Tensor sums = gradient_squares().to(torch::kCPU);
  return std::sqrt(sums[0].item<double>() + sums[1].item<double>());
}

void MasterShards::clip_on_device(const Tensor& norm, double max_norm) {
  torch::NoGradGuard no_grad;
  const Tensor divisor = torch::where(norm > max_norm, (norm + 1e-6) / max_norm, torch::ones_like(norm)).to(torch::kFloat32);
  for (auto& s : shards_) s.clip_divisor = divisor.to(s.master.device());
}

void MasterShards::scale_gradients(double factor) {
  for (auto& s : shards_) {
    if (s.form == GradientForm::Fp32) s.grad.mul_(factor);
    else s.clip_scale *= factor;  // applied by the step
  }
}

Tensor MasterShards::nonfinite_flag() const {
  Tensor flag;
  for (const auto& s : shards_) {
    const Tensor bad = s.flat_grad().isfinite().logical_not().any();
    flag = flag.defined() ? flag.logical_or(bad.to(flag.device())) : bad;
  }
  return flag.defined() ? flag.to(torch::kFloat64) : torch::zeros({}, torch::kFloat64);
}

void MasterShards::clear_gradients() {
  for (auto& m : shards_) {
    m.form = GradientForm::None;
    m.grad = Tensor();
    m.grad_pieces.clear();
    m.grad_scale = m.clip_scale = 1;
    m.clip_divisor = Tensor();
    m.grad_sq = Tensor();
    if (options_.offload) m.params_written = false;
  }
}

double MasterShards::master_bytes() const {
  if (options_.dtype == DType::Fp32 && !options_.offload) return 0;  // the master weights are the working parameters
  double bytes = 0;
  for (const auto& s : shards_) bytes += static_cast<double>(s.master.numel() * s.master.element_size());
  return bytes;
}

}  // namespace dsrun
