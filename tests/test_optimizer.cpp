// The optimizers on flat master shards: AdamW, Adam and SGD against libtorch's, the fused host
// step bit for bit, bf16 states, and dsrun's Adam kernel on a GPU.
#include "engine/common/torch_compat.hpp"
#include "engine/train/host_optimizer.hpp"
#include "engine/train/optimizer.hpp"
#include "engine_util.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <limits>

using namespace dsrun;

TEST_CASE("AdamW on a flat shard matches libtorch's AdamW", "[engine][optimizer]") {
  torch::manual_seed(1);
  torch::Tensor start = torch::randn({64});
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < 5; ++i) grads.push_back(torch::randn({64}));

  OptimizerOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  std::vector<MasterShard> shards(1);
  shards[0].master = start.clone();
  shards[0].decay_ranges = {{0, 64}};
  ShardOptimizer ours(o, shards);

  torch::Tensor p = start.clone().requires_grad_(true);
  torch::optim::AdamW theirs({p}, torch::optim::AdamWOptions(0.01).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  for (const auto& g : grads) {
    shards[0].grad = g.clone();
    ours.step(0.01);
    p.mutable_grad() = g.clone();
    theirs.step();
  }
  CHECK(torch::allclose(shards[0].master, p.detach(), 1e-6, 1e-7));
  CHECK(ours.state_bytes() == 2 * 64 * 4);
}

namespace {

// Bit for bit where Debian's libtorch 1.13 runs its AVX2/AVX-512 kernels (they fuse multiply-adds
// exactly where the host step does); elsewhere (baseline kernels, PyTorch 2.x's addcdiv) within
// about an ulp.
bool same_step(const torch::Tensor& ours, const torch::Tensor& plain) {
  if (compat::kHostStepMatchesTorchBits && __builtin_cpu_supports("avx2")) return torch::equal(ours, plain);
  return torch::allclose(ours, plain, 2.4e-7, 1e-9);
}

}  // namespace

// The host step against ShardOptimizer's plain torch expressions, one step from the same states:
// bit for bit where torch runs its AVX2/AVX-512 kernels (this machine), within 1 ulp otherwise.
TEST_CASE("the fused host step gives the plain expressions' bits, on any thread count", "[engine][optimizer][host]") {
  torch::manual_seed(11);
  // A multiple of every vector width (torch's scalar tail loop may round differently), but not
  // of the host step's chunks.
  const int64_t n = 300032;
  torch::Tensor start = torch::randn({n}), m0 = torch::randn({n}) * 0.1, v0 = torch::rand({n}) * 0.01;
  torch::Tensor g = torch::randn({n}) * 0.5;
  for (OptimizerKind kind : {OptimizerKind::AdamW, OptimizerKind::Adam, OptimizerKind::Sgd}) {
    INFO("optimizer " << static_cast<int>(kind));
    OptimizerOptions o;
    o.kind = kind;
    o.weight_decay = 0.1;
    o.momentum = 0.9;
    o.nesterov = kind == OptimizerKind::Sgd;
    const double lr = 3e-3;
    // Ours, on 1 and on 4 threads, from the same states at step 7.
    std::vector<torch::Tensor> masters;
    for (int threads : {1, 4}) {
      std::vector<MasterShard> shards(1);
      shards[0].master = start.clone();
      shards[0].grad = g.clone();
      shards[0].decay_ranges = {{1000, 200000}};
      ShardOptimizer ours(o, shards, threads);
      ours.set_steps_taken(6);
      for (const auto& name : ours.state_names()) ours.state(name, 0).copy_(name == "exp_avg_sq" ? v0 : m0);
      ours.step(lr);
      masters.push_back(shards[0].master);
      if (threads == 4) {
        CHECK(torch::equal(masters[0], masters[1]));  // the same bits, whatever the thread count
        // The plain torch expressions of the same step.
        torch::Tensor p = start.clone(), gr = g.clone(), m = m0.clone(), v = v0.clone();
        torch::Tensor pd = p.narrow(0, 1000, 199000), gd = gr.narrow(0, 1000, 199000);
        if (kind == OptimizerKind::AdamW) pd.mul_(1 - lr * o.weight_decay);
        else gd.add_(pd, o.weight_decay);
        if (kind == OptimizerKind::Sgd) {
          m.mul_(o.momentum).add_(gr);
          p.add_(gr.add(m, o.momentum), -lr);
        } else {
          m.mul_(o.beta1).add_(gr, 1 - o.beta1);
          v.mul_(o.beta2).addcmul_(gr, gr, 1 - o.beta2);
          const double bias1 = 1 - std::pow(o.beta1, 7.0), bias2 = 1 - std::pow(o.beta2, 7.0);
          p.addcdiv_(m, (v / bias2).sqrt_().add_(o.eps), -lr / bias1);
          CHECK(same_step(ours.state("exp_avg_sq", 0), v));
        }
        CHECK(same_step(ours.state(kind == OptimizerKind::Sgd ? "momentum_buffer" : "exp_avg", 0), m));
        CHECK(same_step(shards[0].master, p));
      }
    }
  }
}

// optimizer.state_dtype = "bf16": the host step widens each state, updates it in fp32 as before,
// moves the weights with the fp32 values and stores the states rounded to nearest.
TEST_CASE("bf16 optimizer states: updated in fp32, the weights moved by the unrounded values, stored rounded once", "[engine][optimizer][host]") {
  torch::manual_seed(12);
  const int64_t n = 70001;  // more than one host chunk, not a multiple of a block
  const torch::Tensor start = torch::randn({n}), g = torch::randn({n}) * 0.5;
  const torch::Tensor m0 = (torch::randn({n}) * 0.1).to(torch::kBFloat16), v0 = (torch::rand({n}) * 0.01).to(torch::kBFloat16);
  for (OptimizerKind kind : {OptimizerKind::AdamW, OptimizerKind::Sgd}) {
    INFO(to_string(kind));
    OptimizerOptions o;
    o.kind = kind;
    o.weight_decay = 0.1;
    o.momentum = 0.9;
    o.state_dtype = DType::Bf16;
    const double lr = 3e-3;
    std::vector<MasterShard> shards(1);
    shards[0].master = start.clone();
    shards[0].grad = g.clone();
    shards[0].decay_ranges = {{0, n}};
    ShardOptimizer ours(o, shards);
    ours.set_steps_taken(4);
    for (const auto& name : ours.state_names()) {
      REQUIRE(ours.state(name, 0).scalar_type() == torch::kBFloat16);
      ours.state(name, 0).copy_(name == "exp_avg_sq" ? v0 : m0);
    }
    CHECK(ours.state_bytes() == static_cast<double>(ours.state_names().size() * n * 2));
    ours.step(lr);
    // The plain expressions in fp32 from the widened states.
    torch::Tensor p = start.clone(), m = m0.to(torch::kFloat32), v = v0.to(torch::kFloat32);
    if (kind == OptimizerKind::AdamW) {
      p.mul_(1 - lr * o.weight_decay);
      m.mul_(o.beta1).add_(g, 1 - o.beta1);
      v.mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
      const double bias1 = 1 - std::pow(o.beta1, 5.0), bias2 = 1 - std::pow(o.beta2, 5.0);
      p.addcdiv_(m, (v / bias2).sqrt_().add_(o.eps), -lr / bias1);
      CHECK(same_step(ours.state("exp_avg_sq", 0).to(torch::kFloat32), v.to(torch::kBFloat16).to(torch::kFloat32)));
      CHECK(same_step(ours.state("exp_avg", 0).to(torch::kFloat32), m.to(torch::kBFloat16).to(torch::kFloat32)));
    } else {
      const torch::Tensor gd = g.clone().add_(start, o.weight_decay);
      m.mul_(o.momentum).add_(gd);
      p.add_(m, -lr);
      CHECK(same_step(ours.state("momentum_buffer", 0).to(torch::kFloat32), m.to(torch::kBFloat16).to(torch::kFloat32)));
    }
    CHECK(same_step(shards[0].master, p));
    // The same states as fp32 values would have moved the weights the same way: only their storage rounds.
    CHECK_FALSE(torch::equal(m.to(torch::kBFloat16).to(torch::kFloat32), m));
  }
}

TEST_CASE("the host step reads bf16/fp16 gradients and writes bf16/fp16 parameters as torch rounds them", "[engine][optimizer][host]") {
  torch::manual_seed(12);
  torch::Tensor x = torch::randn({4096}) * 1000;
  x[0] = 3.0f;  // (NaN is checked apart: torch's vector and scalar paths give different NaN bits)
  x[1] = std::numeric_limits<float>::infinity();
  x[2] = 1.00390625f;  // halfway between two bf16 values: ties to even
  x[3] = 65520.0f;     // rounds to infinity in fp16
  x[4] = 1e-8f;        // an fp16 subnormal
  torch::Tensor bf = x.to(torch::kBFloat16), hf = x.to(torch::kFloat16);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float f = x[i].item<float>();
    CHECK(dsrun::host_to_bf16(f) == reinterpret_cast<const uint16_t*>(bf.data_ptr())[i]);
    CHECK(dsrun::host_to_f16(f) == reinterpret_cast<const uint16_t*>(hf.data_ptr())[i]);
  }
  CHECK(std::isnan(dsrun::host_from_bf16(dsrun::host_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(dsrun::host_from_f16(dsrun::host_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  // A step from bf16 gradients into bf16 parameters: the master as from the widened gradient,
  // and the parameters its bf16 rounding.
  const int64_t n = 10000;
  torch::Tensor master = torch::randn({n}), grad16 = (torch::randn({n}) * 0.01).to(torch::kBFloat16);
  torch::Tensor m = torch::zeros({n}), v = torch::zeros({n}), out = torch::empty({n}, torch::kBFloat16);
  torch::Tensor master2 = master.clone(), m2 = m.clone(), v2 = v.clone(), grad32 = grad16.to(torch::kFloat32);
  dsrun::HostStep st;
  st.lr = 1e-3;
  dsrun::host_optimizer_step({master.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), grad16.data_ptr(), dsrun::HostDType::BF16,
                              out.data_ptr(), dsrun::HostDType::BF16, 0.5, 0.25, n, false},
                             st);
  dsrun::host_optimizer_step({master2.data_ptr<float>(), m2.data_ptr<float>(), v2.data_ptr<float>(), grad32.data_ptr(), dsrun::HostDType::F32, nullptr,
                              dsrun::HostDType::F32, 0.5, 0.25, n, false},
                             st);
  CHECK(torch::equal(master, master2));
  CHECK(torch::equal(out, master.to(torch::kBFloat16)));
}

TEST_CASE("SGD with Nesterov momentum matches libtorch's SGD", "[engine][optimizer]") {
  torch::manual_seed(2);
  torch::Tensor start = torch::randn({16});
  OptimizerOptions o;
  o.kind = OptimizerKind::Sgd;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.01;
  std::vector<MasterShard> shards(1);
  shards[0].master = start.clone();
  shards[0].decay_ranges = {{0, 16}};
  ShardOptimizer ours(o, shards);
  torch::Tensor p = start.clone().requires_grad_(true);
  torch::optim::SGD theirs({p}, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01));
  for (int i = 0; i < 4; ++i) {
    torch::Tensor g = torch::randn({16});
    shards[0].grad = g.clone();
    ours.step(0.1);
    p.mutable_grad() = g.clone();
    theirs.step();
  }
  CHECK(torch::allclose(shards[0].master, p.detach(), 1e-6, 1e-7));
}

TEST_CASE("CUDA: dsrun's Adam kernel (bf16 gradients, a clip decided on the device, parameters written, fp32 or bf16 states) follows the host step", "[engine][cuda][optimizer]") {
  if (!torch::cuda::is_available() || !kHasDeviceAdamKernel) {
    WARN("SKIPPED: no CUDA device visible, or a build without the kernel (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  // Odd lengths and a master that starts 1 element past a 16-byte boundary: the kernel's scalar
  // head, its four-at-a-time body and its tail all run. The reference is the fused host step on the
  // same bf16 gradients with the same factors (it follows the plain expressions, test above).
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(3);
  for (auto [kind, states] : {std::pair{OptimizerKind::AdamW, DType::Fp32}, std::pair{OptimizerKind::Adam, DType::Fp32}, std::pair{OptimizerKind::AdamW, DType::Bf16}}) {
    OptimizerOptions o;
    o.kind = kind;
    o.state_dtype = states;
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    const int64_t n = 4099;
    torch::Tensor start = torch::randn({n});
    std::vector<MasterShard> host(1), device(1);
    host[0].master = start.clone();
    host[0].decay_ranges = device[0].decay_ranges = {{101, 2999}};
    torch::Tensor backing = torch::zeros({n + 1}, torch::TensorOptions().device(gpu));
    device[0].master = backing.narrow(0, 1, n).copy_(start);
    device[0].param_out = torch::zeros({n}, torch::TensorOptions().dtype(torch::kBFloat16).device(gpu));
    ShardOptimizer ours_host(o, host), ours_device(o, device);
    // bf16 states: one step from the same random states. (Over several steps the two would part:
    // nvcc contracts m and v into fused multiply-adds, the fp32 values differ in the last bit, and
    // where one sits at a bf16 rounding midpoint the stored states differ by one bf16 ulp, which
    // moves the next update by up to 0.8%.)
    const bool bf16 = states == DType::Bf16;
    if (bf16) {
      const torch::Tensor m0 = (torch::randn({n}) * 0.1).to(torch::kBFloat16), v0 = (torch::rand({n}) * 0.01).to(torch::kBFloat16);
      for (ShardOptimizer* opt : {&ours_host, &ours_device}) {
        opt->set_steps_taken(6);
        opt->state("exp_avg", 0).copy_(m0);
        opt->state("exp_avg_sq", 0).copy_(v0);
      }
    }
    for (int step = 0; step < (bf16 ? 1 : 3); ++step) {
      const torch::Tensor g = (torch::randn({n}) * 3).to(torch::kBFloat16);
      host[0].grad = g.clone();
      host[0].grad_scale = 0.5;
      host[0].clip_scale = 0.25;  // the device run divides by 4 as its clip
      ours_host.step(1e-2);
      device[0].grad = g.to(gpu);
      device[0].grad_scale = 0.5;
      device[0].clip_divisor = torch::full({}, 4.0f, torch::TensorOptions().device(gpu));
      ours_device.step(1e-2);
      CHECK(device[0].params_written);
    }
    const torch::Tensor master = device[0].master.cpu();
    INFO(to_string(kind) << (bf16 ? ", bf16 states" : ""));
    CHECK(torch::allclose(master, host[0].master, 1e-5, 1e-6));
    CHECK(torch::equal(device[0].param_out.cpu(), master.to(torch::kBFloat16)));
    for (const std::string& name : ours_host.state_names()) {
      const torch::Tensor d = ours_device.state(name, 0).cpu().to(torch::kFloat32), h = ours_host.state(name, 0).to(torch::kFloat32);
      CHECK(ours_device.state(name, 0).scalar_type() == (bf16 ? torch::kBFloat16 : torch::kFloat32));
      if (!bf16) {
        CHECK(torch::allclose(d, h, 1e-5, 1e-7));  // (the same contraction, in the last bits)
        continue;
      }
      // At most one bf16 ulp apart (2^-7 of the value), and that only at rounding midpoints: a few
      // percent of the elements (more than the last bit alone would flip: m = β1·m + (1-β1)·g cancels).
      const double differing = (d != h).sum().item<double>() / static_cast<double>(n);
      INFO(name << ": " << differing * 100 << "% differ, the largest by " << ((d - h).abs() / h.abs().clamp_min(1e-30)).max().item<double>() << " of the value");
      CHECK(torch::allclose(d, h, 1.0 / 128, 0));
      CHECK(differing < 0.05);
    }
  }
}
