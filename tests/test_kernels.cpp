// The fused operations against their reference expressions: the MoE combine and rotary on the CPU,
// and the CUDA kernels (RMSNorm, rotary, SwiGLU, MoE combine) on GPU machines.
#include "engine/model/fused_ops.hpp"
#include "engine/model/model.hpp"
#include "engine_util.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <limits>

using namespace dsrun;

namespace {

// A MoE layer's combine as the layer wrote it before fused::combine_rows: the expert outputs copied
// into pair order (dropped pairs 0), weighted, summed over each token's choices.
torch::Tensor combine_by_pairs(const torch::Tensor& outputs, const torch::Tensor& pairs, const torch::Tensor& weights, int64_t k) {
  const int64_t tokens = weights.size(0);
  torch::Tensor per_pair = torch::zeros({tokens * k, outputs.size(1)}, outputs.options()).index_copy(0, pairs, outputs);
  return (per_pair.view({tokens, k, -1}) * weights.unsqueeze(-1)).sum(1);
}

// Routing of `tokens` tokens to k choices among `experts`, grouped by expert, with the pairs a
// capacity of `capacity` rows per expert keeps (0: all): {pairs, place}.
std::pair<torch::Tensor, torch::Tensor> routed_pairs(int64_t tokens, int64_t k, int64_t experts, int64_t capacity, const torch::Device& device) {
  const torch::Tensor chosen = torch::randint(experts, {tokens * k}, torch::kInt64);
  torch::Tensor order = std::get<1>(chosen.sort(/*stable=*/true, 0, false));
  if (capacity > 0) {
    const torch::Tensor within = torch::one_hot(chosen, experts).cumsum(0).gather(1, chosen.unsqueeze(1)).squeeze(1);
    const torch::Tensor kept = (within <= capacity).nonzero().squeeze(-1);
    order = kept.index_select(0, std::get<1>(chosen.index_select(0, kept).sort(true, 0, false)));
  }
  const torch::Tensor place = torch::full({tokens * k}, -1, torch::kInt64).scatter_(0, order, torch::arange(order.numel()));
  return {order.to(device), place.to(device)};
}

}  // namespace

TEST_CASE("MoE combine: fused::combine_rows gives the pair-order sum's values and gradients, dropped pairs included", "[engine][moe]") {
  torch::manual_seed(5);
  const int64_t tokens = 37, k = 3, experts = 5, hidden = 12;
  for (int64_t capacity : {0, 12}) {
    INFO("capacity " << capacity);
    auto [pairs, place] = routed_pairs(tokens, k, experts, capacity, torch::kCPU);
    if (capacity > 0) REQUIRE(pairs.numel() < tokens * k);  // some pairs dropped
    const torch::Tensor outputs = torch::randn({pairs.numel(), hidden}), weights = torch::rand({tokens, k});
    const torch::Tensor d_out = torch::randn({tokens, hidden});
    torch::Tensor o1 = outputs.clone().requires_grad_(true), w1 = weights.clone().requires_grad_(true);
    torch::Tensor o2 = outputs.clone().requires_grad_(true), w2 = weights.clone().requires_grad_(true);
    const torch::Tensor ours = fused::combine_rows(o1, place, w1, k), before = combine_by_pairs(o2, pairs, w2, k);
    CHECK(torch::allclose(ours, before, 1e-6, 1e-6));
    (ours * d_out).sum().backward();
    (before * d_out).sum().backward();
    CHECK(torch::allclose(o1.grad(), o2.grad(), 1e-6, 1e-6));
    CHECK(torch::allclose(w1.grad(), w2.grad(), 1e-5, 1e-6));
    // Without weights (a dispatch's backward): each token's rows summed.
    torch::NoGradGuard no_grad;
    CHECK(torch::allclose(fused::combine_rows(outputs, place, torch::Tensor(), k), combine_by_pairs(outputs, pairs, torch::ones({tokens, k}), k), 1e-6, 1e-6));
  }
}

TEST_CASE("rotary embedding rotates each head's halves by its position's angle", "[engine][fused]") {
  // One head of dimension 4 (two angles: theta^0 and theta^-1/2), q and k side by side.
  const int64_t s = 3, d = 4;
  torch::Tensor qk = torch::randn({1, s, 2 * d});
  torch::Tensor inv = torch::tensor({1.0, 1.0 / std::sqrt(10000.0)}, torch::kFloat64);
  torch::Tensor angles = torch::outer(torch::arange(8, torch::kFloat64), inv);
  torch::Tensor full = torch::cat({angles, angles}, -1);
  torch::Tensor out = fused::rotary(qk, d, full.cos().to(torch::kFloat32), full.sin().to(torch::kFloat32));
  for (int64_t pos = 0; pos < s; ++pos)
    for (int64_t head = 0; head < 2; ++head)
      for (int64_t i = 0; i < d / 2; ++i) {
        const double a = angles[pos][i].item<double>();
        const double x1 = qk[0][pos][head * d + i].item<double>(), x2 = qk[0][pos][head * d + i + d / 2].item<double>();
        CHECK(out[0][pos][head * d + i].item<double>() == Approx(x1 * std::cos(a) - x2 * std::sin(a)).margin(1e-6));
        CHECK(out[0][pos][head * d + i + d / 2].item<double>() == Approx(x2 * std::cos(a) + x1 * std::sin(a)).margin(1e-6));
      }
}

TEST_CASE("CUDA: the fused RMSNorm, rotary and SwiGLU kernels match the reference ops, forward and backward", "[engine][cuda][fused]") {
  if (!torch::cuda::is_available()) {
    WARN("SKIPPED: no CUDA device visible (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  const torch::Device gpu(torch::kCUDA, 0);
  CHECK(fused::fused_kernels_active(torch::zeros({1}, torch::TensorOptions().device(gpu))));
  // The CPU runs the reference expressions; the GPU the kernels. Same inputs, compared in fp32.
  auto compare = [&](const std::string& what, auto&& op, std::vector<torch::Tensor> inputs, torch::ScalarType dtype, double tol) {
    std::vector<torch::Tensor> cpu_in, gpu_in;
    for (auto& t : inputs) {
      cpu_in.push_back(t.to(dtype).detach().requires_grad_(t.is_floating_point()));
      gpu_in.push_back(t.to(gpu, dtype).detach().requires_grad_(t.is_floating_point()));
    }
    torch::Tensor cpu_out = op(cpu_in), gpu_out = op(gpu_in);
    torch::Tensor upstream = torch::randn(cpu_out.sizes()).to(dtype);
    cpu_out.backward(upstream);
    gpu_out.backward(upstream.to(gpu));
    INFO(what << " in " << c10::toString(dtype));
    CHECK(torch::allclose(gpu_out.cpu().to(torch::kFloat32), cpu_out.to(torch::kFloat32), tol, tol));
    for (size_t i = 0; i < inputs.size(); ++i)
      CHECK(torch::allclose(gpu_in[i].grad().cpu().to(torch::kFloat32), cpu_in[i].grad().to(torch::kFloat32), 10 * tol, 10 * tol));
  };
  torch::manual_seed(31);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    const double tol = dtype == torch::kFloat32 ? 1e-4 : 3e-2;
    for (int64_t cols : {64, 2048}) {
      compare("rms_norm", [](std::vector<torch::Tensor>& in) { return fused::rms_norm(in[0], in[1], 1e-6); },
              {torch::randn({3, 5, cols}), 1 + 0.1 * torch::randn({cols})}, dtype, tol);
    }
    // q and k heads taken from a wider projection (v beside them): the kernel reads a strided input.
    // Head dim 16 from column 0 (four elements per access), from column 2 (misaligned: one at a
    // time), and 12 (half a head not a multiple of 4: the per-pair kernel).
    for (auto [d, first] : {std::pair<int64_t, int64_t>{16, 0}, {16, 2}, {12, 0}}) {
      torch::Tensor inv = 1.0 / torch::pow(10000.0, torch::arange(0, d, 2, torch::kFloat64) / static_cast<double>(d));
      torch::Tensor angles = torch::outer(torch::arange(32, torch::kFloat64), inv);
      torch::Tensor full = torch::cat({angles, angles}, -1);
      torch::Tensor cos = full.cos().to(torch::kFloat32), sin = full.sin().to(torch::kFloat32);
      compare("rotary, head dim " + std::to_string(d) + " from column " + std::to_string(first), [&](std::vector<torch::Tensor>& in) {
        torch::Tensor qk = in[0].narrow(-1, first, 3 * d);
        return fused::rotary(qk, d, in[0].is_cuda() ? cos.to(in[0].device()) : cos, in[0].is_cuda() ? sin.to(in[0].device()) : sin);
      }, {torch::randn({2, 20, 4 * d + 4})}, dtype, tol);
    }
    {  // the q/k/v projection: q (2 heads), k (1 head) rotated, v passed through; v's gradient arrives
       // strided (a slice of the concatenation's), x's and the weight's come from split products
      torch::Tensor inv = 1.0 / torch::pow(10000.0, torch::arange(0, 16, 2, torch::kFloat64) / 16.0);
      torch::Tensor angles = torch::outer(torch::arange(32, torch::kFloat64), inv);
      torch::Tensor full = torch::cat({angles, angles}, -1);
      torch::Tensor cos = full.cos().to(torch::kFloat32), sin = full.sin().to(torch::kFloat32);
      compare("project_qkv", [&](std::vector<torch::Tensor>& in) {
        const bool gpu_side = in[0].is_cuda();
        std::vector<torch::Tensor> qkv =
            fused::project_qkv(in[0], in[1], 32, 16, 16, gpu_side ? cos.to(in[0].device()) : cos, gpu_side ? sin.to(in[0].device()) : sin);
        return torch::cat({qkv[0], qkv[1], qkv[2] * 2}, -1);
      }, {torch::randn({2, 20, 48}), 0.2 * torch::randn({64, 48})}, dtype, tol);
    }
    // inner 96: eight columns a thread; 100: one at a time.
    for (int64_t inner : {96, 100})
      compare("swiglu, inner " + std::to_string(inner), [](std::vector<torch::Tensor>& in) { return fused::swiglu(in[0]); }, {torch::randn({4, 7, 2 * inner})},
              dtype, tol);
    // The norm that also writes the residual stream's copy: a projection adds into the copy in
    // place (as a decoder block does) and the copy's gradient reaches x through the norm's backward.
    compare("rms_norm_with_copy", [](std::vector<torch::Tensor>& in) {
      std::vector<torch::Tensor> r = fused::rms_norm_with_copy(in[0], in[1], 1e-6);
      torch::Tensor stream = r[0].addmm_(r[1].reshape({-1, r[1].size(-1)}), in[2].t());
      return torch::cat({stream.view_as(in[0]), r[1] * 2}, -1);
    }, {torch::randn({3, 5, 2048}), 1 + 0.1 * torch::randn({2048}), 0.02 * torch::randn({2048, 2048})}, dtype, dtype == torch::kFloat32 ? 1e-4 : 5e-2);
  }
  // The loss's one-pass kernel against the reference ops: rows of mixed scale, one of -inf but one
  // entry, targets outside this slice (here false), in fp32, bf16 and fp16 gradients; rows of 5,000 and of
  // 60,000 (more than a block's columns per pass); and the in-place scale.
  const auto on_gpu = torch::TensorOptions().device(gpu);
  for (int64_t cols : {5000, 60000}) {
    const int64_t rows = cols == 5000 ? 37 : 5;
    torch::Tensor z = torch::randn({rows, cols}, on_gpu) * torch::linspace(0.1, 30, rows, on_gpu).unsqueeze(1);
    z[3].fill_(-std::numeric_limits<float>::infinity());
    z[3][17] = 2.5;
    const torch::Tensor column = torch::randint(cols, {rows}, on_gpu.dtype(torch::kInt64)), here = torch::rand({rows}, on_gpu) > 0.2;
    column[3] = 17;
    here[3] = true;
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      INFO("cross_entropy_rows, rows of " << cols << ", gradient in " << c10::toString(dtype));
      torch::Tensor lse = torch::empty({rows}, on_gpu), target_logit = torch::empty({rows}, on_gpu);
      torch::Tensor zk = z.clone(), zr = z.cpu();
      const torch::Tensor g = fused::cross_entropy_rows(zk, column, here, 0.25, dtype, lse, target_logit);
      torch::Tensor lse_ref = torch::empty({rows}), target_ref = torch::empty({rows});
      const torch::Tensor g_ref = fused::cross_entropy_rows(zr, column.cpu(), here.cpu(), 0.25, dtype, lse_ref, target_ref);
      CHECK(torch::allclose(lse.cpu(), lse_ref, 1e-5, 1e-5));
      CHECK(torch::equal(target_logit.cpu(), target_ref));
      CHECK(torch::allclose(g.cpu().to(torch::kFloat32), g_ref.to(torch::kFloat32), dtype == torch::kFloat32 ? 1e-6 : 1e-2, 1e-6));
      torch::Tensor scaled = g.clone(), factor = torch::full({}, 3.0, on_gpu);
      fused::scale_(scaled, factor);
      CHECK(torch::equal(scaled.cpu(), (g.cpu().to(torch::kFloat32) * 3).to(dtype)));
    }
  }
  // The gradients' sum of squares: sizes not a multiple of 8, one starting off a 16-byte boundary, an empty one.
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    const torch::Tensor flat = torch::randn({3'000'003}, on_gpu).to(dtype);
    const std::vector<torch::Tensor> pieces{flat.narrow(0, 0, 1'000'000), flat.narrow(0, 1'000'001, 1'999'999), flat.narrow(0, 0, 0), flat.narrow(0, 3'000'000, 3)};
    const double want = flat.cpu().to(torch::kFloat64).pow(2).sum().item<double>() - std::pow(flat[1'000'000].item<double>(), 2);
    const torch::Tensor got = fused::sum_of_squares(pieces);
    CHECK(got.scalar_type() == torch::kFloat64);
    CHECK(std::fabs(got.item<double>() - want) <= 1e-5 * want);
  }
}

TEST_CASE("CUDA: the MoE combine kernels equal the reference ops (fp32 within 1e-5, bf16 and fp16 within bf16's rounding), dropped pairs included", "[engine][cuda][fused][moe]") {
  if (!torch::cuda::is_available() || !fused::fused_kernels_active(torch::zeros({1}, torch::kCUDA))) {
    WARN("SKIPPED: no CUDA device visible, or a build without the fused kernels (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(6);
  const int64_t tokens = 301, k = 6, experts = 16, hidden = 2052;  // (2052: rows 8-byte aligned in bf16, not 16)
  for (int64_t capacity : {0, 100}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      INFO("capacity " << capacity << ", " << c10::toString(dtype));
      auto [pairs, place] = routed_pairs(tokens, k, experts, capacity, gpu);
      const torch::Tensor outputs = torch::randn({pairs.numel(), hidden}, gpu).to(dtype), weights = torch::rand({tokens, k}, gpu);
      const torch::Tensor d_out = torch::randn({tokens, hidden}, gpu).to(dtype);
      torch::Tensor o1 = outputs.clone().requires_grad_(true), w1 = weights.clone().requires_grad_(true);
      const torch::Tensor ours = fused::combine_rows(o1, place, w1, k);
      ours.backward(d_out);
      // The reference in fp32 on the CPU (the kernels accumulate in fp32 and round once).
      torch::Tensor o2 = outputs.cpu().to(torch::kFloat32).requires_grad_(true), w2 = weights.cpu().requires_grad_(true);
      const torch::Tensor reference = combine_by_pairs(o2, pairs.cpu(), w2, k);
      reference.backward(d_out.cpu().to(torch::kFloat32));
      const double tolerance = dtype == torch::kFloat32 ? 1e-5 : 8e-3;
      CHECK(ours.scalar_type() == dtype);
      CHECK(torch::allclose(ours.cpu().to(torch::kFloat32), reference, tolerance, 1e-5));
      CHECK(torch::allclose(o1.grad().cpu().to(torch::kFloat32), o2.grad(), tolerance, 1e-5));
      CHECK(torch::allclose(w1.grad().cpu(), w2.grad(), 1e-4, 1e-3));
      torch::NoGradGuard no_grad;
      CHECK(torch::allclose(fused::combine_rows(outputs, place, torch::Tensor(), k).cpu().to(torch::kFloat32),
                            combine_by_pairs(outputs.cpu().to(torch::kFloat32), pairs.cpu(), torch::ones({tokens, k}), k), tolerance, 1e-5));
    }
  }
}
