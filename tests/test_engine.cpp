// Engine pieces in one process (and the communicator across real processes): collectives against
// a reference, the optimizer against libtorch's, MoE routing and balance loss, checkpointing.
#include "engine/checkpoint/export.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/data/dataset.hpp"
#include "engine/data/token_source.hpp"
#include "engine/dist/communicator.hpp"
#include "engine/model/fused_ops.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/train/checkpointing.hpp"
#include "engine/train/optimizer.hpp"
#include "engine_util.hpp"
#include "test_util.hpp"

#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace dsrun;

namespace {

using dsrun::test::in_processes;
using dsrun::test::one_rank_loss;
using dsrun::test::tiny_decoder;
using dsrun::test::tiny_moe_decoder;
using dsrun::test::token_batch;

// One micro-batch on `device` through ZeRO: forward, backward and the reduction; its task loss.
double reduced_micro_batch(Model& model, ZeroDataParallel& zero, Batch b, torch::Device device = torch::kCPU) {
  b.inputs = b.inputs.to(device);
  b.targets = b.targets.to(device);
  MicroBatchLoss out = one_rank_loss(model, b, zero);
  out.loss.backward();
  zero.after_backward();
  zero.reduce_gradients();
  return out.task_loss;
}

// The gradient norm of one process training `m` (weights from `model_seed`) on one batch.
double reference_grad_norm(const ModelSpec& m, uint64_t model_seed, uint64_t batch_seed) {
  torch::manual_seed(model_seed);
  auto reference = build_model(m, 16, {model_seed});
  UnitRunner plain;
  one_rank_loss(*reference, token_batch(2, 16, m.vocab, batch_seed), plain).loss.backward();
  double sq = 0;
  for (auto& p : reference->module().parameters())
    if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
  return std::sqrt(sq);
}

}  // namespace

TEST_CASE("Gloo collectives agree with a reference on 3 processes, uneven sizes included", "[engine][comm]") {
  CHECK(in_processes(3, [](int rank, Communicator& comm) {
    const int world = comm.world_size();
    // all-reduce: sum of (rank + 1) * [0, 1, ..., 6]
    torch::Tensor t = torch::arange(7, torch::kFloat32) * (rank + 1);
    comm.all_reduce_sum(t);
    bool ok = torch::allclose(t, torch::arange(7, torch::kFloat32) * 6);
    // reduce-scatter of 3 x 5 elements (Gloo has none: derived from all-reduce) in fp32 and bf16
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      torch::Tensor full = (torch::arange(15, torch::kFloat32) + 100 * rank).to(dtype);
      torch::Tensor shard = torch::empty({5}, dtype);
      comm.reduce_scatter_sum(full, shard);
      torch::Tensor expected = torch::zeros({15});
      for (int r = 0; r < world; ++r) expected += torch::arange(15, torch::kFloat32) + 100 * r;
      ok &= torch::allclose(shard.to(torch::kFloat32), expected.narrow(0, rank * 5, 5), 1e-2);
    }
    // all-gather and broadcast
    torch::Tensor mine = torch::full({4}, static_cast<float>(rank));
    torch::Tensor gathered = torch::empty({12});
    comm.all_gather(mine, gathered);
    for (int r = 0; r < world; ++r) ok &= gathered.narrow(0, r * 4, 4).eq(static_cast<float>(r)).all().item<bool>();
    torch::Tensor b = torch::full({3}, rank == 2 ? 42.0f : -1.0f);
    comm.broadcast(b, 2);
    ok &= b.eq(42.0f).all().item<bool>();
    comm.barrier();
    return ok;
  }));
}

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

TEST_CASE("MoE: top-k routing, balance loss near its uniform value, gradients to router and chosen experts", "[engine][moe]") {
  ModelSpec m = tiny_moe_decoder(8);
  m.moe.aux_loss_weight = 0.01;
  torch::manual_seed(3);
  auto model = build_model(m, 16, {3});
  UnitRunner plain;
  MicroBatchLoss out = one_rank_loss(*model, token_batch(4, 16, m.vocab, 4), plain);
  // With near-uniform router scores, Σ f_i P_i ≈ 1, so the loss is close to its weight.
  CHECK(out.aux_loss == Approx(0.01).epsilon(0.2));
  out.loss.backward();
  int router_grads = 0, expert_grads = 0, experts = 0;
  for (auto& p : model->module().named_parameters()) {
    const std::string& name = p.key();
    if (name.find("router") != std::string::npos) router_grads += p.value().grad().defined() && p.value().grad().abs().sum().item<double>() > 0;
    if (name.find(".expert") != std::string::npos && name.find("gate_up.weight") != std::string::npos) {
      ++experts;
      expert_grads += p.value().grad().defined();
    }
  }
  CHECK(router_grads == 1);                // one MoE layer (the first layer is dense)
  CHECK(experts == 8);
  CHECK(expert_grads >= 2);                // 64 tokens x top-2 reach several experts
}

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

TEST_CASE("checkpointed units give the same loss and gradients as stored activations", "[engine][checkpoint]") {
  ModelSpec m = tiny_decoder();
  m.moe.routed_experts = 4;
  m.moe.top_k = 2;
  m.moe.intermediate = 16;
  m.moe.first_dense_layers = 1;
  Batch batch = token_batch(2, 16, m.vocab, 5);
  auto grads_with = [&](bool checkpointing) {
    torch::manual_seed(6);
    auto model = build_model(m, 16, {6});
    auto comm = single_process_communicator();
    ZeroOptions zo;
    zo.stage = 0;
    zo.activation_checkpointing = checkpointing;
    ZeroDataParallel zero(*model, *comm, zo);
    MicroBatchLoss out = one_rank_loss(*model, batch, zero);
    out.loss.backward();
    zero.after_backward();
    zero.reduce_gradients();
    std::vector<torch::Tensor> g;
    for (auto& s : zero.shards()) g.push_back(s.scaled_grad());
    return std::make_pair(out.loss.item<double>(), g);
  };
  auto [loss_a, grads_a] = grads_with(false);
  auto [loss_b, grads_b] = grads_with(true);
  CHECK(loss_a == loss_b);
  REQUIRE(grads_a.size() == grads_b.size());
  for (size_t i = 0; i < grads_a.size(); ++i) CHECK(torch::allclose(grads_a[i], grads_b[i], 1e-5, 1e-7));
}

TEST_CASE("a deferred model built unit by unit has the eager model's weights on any layout", "[engine][init]") {
  // The same seed gives the same weights: eager (whole model in fp32), and deferred (parameters
  // without values, each unit built by ZeRO) at stages 0-3 on 1-3 ranks; each rank holds its shards.
  ModelSpec m = tiny_moe_decoder(4);
  auto eager = build_model(m, 16, {42});
  std::vector<torch::Tensor> flat_units;
  for (auto& unit : eager->parameter_units()) {
    std::vector<torch::Tensor> parts;
    for (auto& p : unit.params) parts.push_back(p.detach().flatten());
    flat_units.push_back(torch::cat(parts));
  }
  CHECK(build_model(m, 16, {42, true})->deferred());
  CHECK_FALSE(torch::equal(flat_units[1], [&] {  // another seed, other weights
    auto other = build_model(m, 16, {43});
    auto units = other->parameter_units();
    std::vector<torch::Tensor> parts;
    for (auto& p : units[1].params) parts.push_back(p.detach().flatten());
    return torch::cat(parts);
  }()));
  for (int world : {1, 2, 3})
    for (int stage : {0, 1, 3}) {
      INFO("world " << world << ", stage " << stage);
      CHECK(in_processes(world, [&](int rank, Communicator& comm) {
        auto deferred = build_model(m, 16, {42, true});
        ZeroOptions zo;
        zo.stage = stage;
        zo.dtype = DType::Bf16;
        ZeroDataParallel zero(*deferred, comm, zo);
        bool same = true;
        for (size_t k = 0; k < zero.unit_count(); ++k) {
          const torch::Tensor& master = zero.shards()[k].master;
          const int64_t begin = zero.master_begin(k), count = std::min<int64_t>(master.numel(), zero.unit_numel(k) - begin);
          if (count > 0) same &= torch::equal(master.narrow(0, 0, count), flat_units[k].narrow(0, begin, count));
        }
        return same;
      }));
    }
}

TEST_CASE("gradient reductions start during backward, as soon as a unit's gradients are complete", "[engine][overlap]") {
  // 2 Gloo ranks, one micro-batch: every unit starts its reduction from autograd's hooks, MoE
  // blocks too (the grouped experts give an expert no token chose a zero gradient). Gradients
  // stay right: the same batch on both ranks averages to the one-process gradient.
  CHECK(in_processes(2, [](int rank, Communicator& comm) {
    bool ok = true;
    for (bool moe : {false, true}) {
      for (int stage : {0, 1, 2, 3}) {
        ModelSpec m = moe ? tiny_moe_decoder(4) : tiny_decoder();
        torch::manual_seed(21);
        auto model = build_model(m, 16, {21});
        ZeroOptions zo;
        zo.stage = stage;
        ZeroDataParallel zero(*model, comm, zo);
        one_rank_loss(*model, token_batch(2, 16, m.vocab, 22), zero).loss.backward();
        const int64_t during_backward = zero.overlapped_reductions();
        zero.after_backward();
        zero.reduce_gradients();
        const int64_t units = static_cast<int64_t>(zero.unit_count());
        if (during_backward != units) {
          std::fprintf(stderr, "rank %d stage %d moe %d: %lld of %lld units overlapped\n", rank, stage, moe ? 1 : 0,
                       static_cast<long long>(during_backward), static_cast<long long>(units));
          ok = false;
        }
        const double ref = reference_grad_norm(m, 21, 22);
        ok &= std::abs(zero.global_grad_norm() - ref) <= 1e-5 * ref;
      }
    }
    return ok;
  }));
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

TEST_CASE("global-norm clipping sees every shard", "[engine][clip]") {
  CHECK(in_processes(2, [](int rank, Communicator& comm) {
    ModelSpec m = tiny_decoder();
    torch::manual_seed(7);
    auto model = build_model(m, 16, {7});
    ZeroOptions zo;
    zo.stage = 2;
    ZeroDataParallel zero(*model, comm, zo);
    // Same batch on both ranks: the averaged gradient is the one-process gradient.
    reduced_micro_batch(*model, zero, token_batch(2, 16, m.vocab, 8));
    const double sharded = zero.global_grad_norm();

    const double ref = reference_grad_norm(m, 7, 8);
    return std::fabs(sharded - ref) < 1e-4 * ref && rank >= 0;
  }));
}

TEST_CASE("token shards: written, read back, windows cut, bad shards refused", "[engine][data]") {
  char pattern[] = "/tmp/dsrun-data-XXXXXX";
  std::string dir = ::mkdtemp(pattern);
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 1000; ++i) tokens.push_back(i % 300);
  write_file_atomic(dir + "/a.tokens", token_shard_bytes(tokens, 2));
  DataOptions data;
  data.kind = DataKind::Tokens;
  data.path = dir;
  data.val_fraction = 0.1;
  data.shuffle = false;
  ModelSpec m = tiny_decoder();
  m.vocab = 300;
  auto set = open_dataset(data, m, 8, 1);
  Batch b = set->train_batch(0, 2);
  CHECK(b.inputs.sizes() == std::vector<int64_t>({2, 8}));
  CHECK(b.inputs[1][0].item<int64_t>() == 8);        // window 1 starts at token 8
  CHECK(b.targets[0][0].item<int64_t>() == 1);       // targets are the next tokens
  // Shuffled order is a permutation, the same for the same seed.
  data.shuffle = true;
  auto a1 = open_dataset(data, m, 8, 5), a2 = open_dataset(data, m, 8, 5);
  CHECK(torch::equal(a1->train_batch(3, 4).inputs, a2->train_batch(3, 4).inputs));
  // A token outside the vocabulary, and a truncated shard, are errors naming the file.
  m.vocab = 100;
  CHECK_THROWS_WITH(open_dataset(data, m, 8, 1)->train_batch(0, 4), Catch::Contains("outside the vocabulary"));  // checked per batch: shards are mapped
  std::string bytes = read_file(dir + "/a.tokens");
  write_file_atomic(dir + "/a.tokens", bytes.substr(0, bytes.size() - 3));
  m.vocab = 300;
  CHECK_THROWS_WITH(open_dataset(data, m, 8, 1), Catch::Contains("does not match its size"));
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST_CASE("CIFAR-10 binary batches are read as normalised images with labels", "[engine][data]") {
  char pattern[] = "/tmp/dsrun-cifar-XXXXXX";
  std::string dir = ::mkdtemp(pattern);
  for (const char* name : {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin", "test_batch.bin"}) {
    std::string records;
    for (int i = 0; i < 4; ++i) {
      records.push_back(static_cast<char>(i % 10));  // label
      records.append(3072, static_cast<char>(i * 40));
    }
    write_file_atomic(dir + "/" + name, records);
  }
  DataOptions data;
  data.kind = DataKind::Cifar10;
  data.path = dir;
  data.shuffle = false;
  ModelSpec m;
  m.arch = ModelArch::ResNet;
  auto set = open_dataset(data, m, 0, 1);
  Batch b = set->train_batch(0, 4);
  CHECK(b.inputs.sizes() == std::vector<int64_t>({4, 3, 32, 32}));
  CHECK(b.targets[3].item<int64_t>() == 3);
  CHECK(b.inputs[0][0][0][0].item<float>() == Approx((0.0 - 0.4914) / 0.2470).epsilon(1e-4));
  CHECK(set->val_batch(0, 2).targets.size(0) == 2);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST_CASE("ResNet-18 trains a step on synthetic images and counts correct predictions", "[engine][resnet]") {
  ModelSpec m;
  m.arch = ModelArch::ResNet;
  m.resnet.depth = 18;
  m.resnet.width = 8;
  m.resnet.image_size = 16;
  DataOptions data;
  auto set = open_dataset(data, m, 0, 1);
  torch::manual_seed(1);
  auto model = build_model(m, 0, {1});
  UnitRunner plain;
  Batch images = set->train_batch(0, 8);
  MicroBatchLoss out = one_rank_loss(*model, images, plain);
  CHECK(std::isfinite(out.task_loss));
  CHECK(out.correct >= 0);
  CHECK(out.correct <= 8);
  out.loss.backward();
  CHECK(model->parameter_units().size() == 1 + 8 + 1);  // stem, 8 basic blocks, head
}

// ---- CUDA: these run only where a GPU is visible; elsewhere they say they were skipped.

TEST_CASE("CUDA: ZeRO-0 and ZeRO-3 on one GPU give the CPU's loss and gradients", "[engine][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("SKIPPED: no CUDA device visible (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  ModelSpec m = tiny_decoder();
  Batch batch = token_batch(2, 16, m.vocab, 9);
  auto run_on = [&](torch::Device device, int stage) {
    torch::manual_seed(10);
    auto model = build_model(m, 16, {10});
    model->module().to(device);
    auto comm = single_process_communicator();
    ZeroOptions zo;
    zo.stage = stage;
    ZeroDataParallel zero(*model, *comm, zo);
    const double loss = reduced_micro_batch(*model, zero, batch, device);
    return std::make_pair(loss, zero.global_grad_norm());
  };
  auto cpu = run_on(torch::kCPU, 0);
  for (int stage : {0, 3}) {
    auto gpu = run_on(torch::Device(torch::kCUDA, 0), stage);
    CHECK(gpu.first == Approx(cpu.first).epsilon(1e-4));
    CHECK(gpu.second == Approx(cpu.second).epsilon(1e-3));
  }
}

TEST_CASE("CUDA: the offload pipeline (gradients down in backward, host update beside the next forward) follows the device optimizer", "[engine][cuda][offload]") {
  if (!torch::cuda::is_available()) {
    WARN("SKIPPED: no CUDA device visible (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  // Four steps of bf16 training, ZeRO-2 and ZeRO-3 on one GPU: the offloaded pipeline (pinned
  // staging, copy streams, the worker's uploads awaited unit by unit) against the same step on the
  // device; the delayed update's first two losses are the device run's first and the loss at w0.
  ModelSpec m = tiny_decoder();
  const torch::Device gpu(torch::kCUDA, 0);
  auto train = [&](int stage, bool offload, bool offload_params, bool delayed, bool working_gradient = false) {
    auto model = build_model(m, 16, {10, /*deferred=*/true});
    auto comm = single_process_communicator();
    ZeroOptions zo;
    zo.stage = stage;
    zo.dtype = DType::Bf16;
    zo.offload = offload;
    zo.offload_params = offload_params;
    zo.delayed_update = delayed;
    zo.device = gpu;
    zo.step_applies_scales = zo.step_reads_working_gradient = working_gradient;  // the trainer's setting with dsrun's Adam kernel
    ZeroDataParallel zero(*model, *comm, zo);
    OptimizerOptions oo;
    oo.lr = 1e-2;
    ShardOptimizer opt(oo, zero.shards(), 4);
    std::vector<double> losses;
    for (int step = 0; step < 4; ++step) {
      const double loss = reduced_micro_batch(*model, zero, token_batch(2, 16, m.vocab, 20 + step), gpu);
      const double norm = zero.global_grad_norm();
      CHECK(std::isfinite(norm));
      if (zero.host_update_pipelined()) zero.start_host_update(opt.host_update(1e-2));
      else opt.step(1e-2);
      zero.after_step();
      losses.push_back(loss);
    }
    zero.wait_host_update();
    return losses;
  };
  for (int stage : {2, 3}) {
    INFO("ZeRO-" << stage);
    std::vector<double> device = train(stage, false, false, false);
    if (kHasDeviceAdamKernel) {  // bf16 gradients read by the step, parameters written by it: the same training
      std::vector<double> working = train(stage, false, false, false, true);
      for (size_t i = 0; i < device.size(); ++i) CHECK(working[i] == Approx(device[i]).epsilon(2e-3));
    }
    std::vector<double> offloaded = train(stage, true, false, false);
    for (size_t i = 0; i < device.size(); ++i) CHECK(offloaded[i] == Approx(device[i]).epsilon(2e-2));
    if (stage == 3) {
      std::vector<double> params_too = train(3, true, true, false);
      for (size_t i = 0; i < device.size(); ++i) CHECK(params_too[i] == Approx(offloaded[i]).epsilon(1e-6));
      std::vector<double> params_delayed = train(3, true, true, true);
      std::vector<double> delayed = train(3, true, false, true);
      for (size_t i = 0; i < device.size(); ++i) CHECK(params_delayed[i] == Approx(delayed[i]).epsilon(1e-6));
    }
    std::vector<double> delayed = train(stage, true, false, true);
    CHECK(delayed[0] == Approx(offloaded[0]).epsilon(1e-6));
    CHECK(delayed[1] != Approx(offloaded[1]).epsilon(1e-6));  // still at w0
  }
}

TEST_CASE("gradients left to autograd (one rank, ZeRO-0) train as the flat gradient buffer does, and are dropped after the step", "[engine][optimizer]") {
  // The trainer sets it with dsrun's Adam kernel on one GPU; the mode itself (gradients read where
  // autograd put them, dropped rather than zeroed) runs on the CPU as well.
  ModelSpec m = tiny_decoder();
  auto train = [&](bool left) {
    auto model = build_model(m, 16, {10});
    auto comm = single_process_communicator();
    ZeroOptions zo;
    zo.gradients_left_to_autograd = left;
    ZeroDataParallel zero(*model, *comm, zo);
    OptimizerOptions oo;
    oo.lr = 1e-2;
    oo.weight_decay = 0.1;
    ShardOptimizer opt(oo, zero.shards());
    std::vector<double> seen;
    for (int step = 0; step < 3; ++step) {
      seen.push_back(reduced_micro_batch(*model, zero, token_batch(2, 16, m.vocab, 30 + step)));
      seen.push_back(zero.global_grad_norm());
      if (left) CHECK(!zero.shards()[0].grad_pieces.empty());
      zero.scale_gradients(0.5);  // as a clip would
      opt.step(1e-2);
      zero.after_step();
      for (size_t k = 0; k < zero.unit_count(); ++k)
        for (const auto& p : zero.unit_params(k)) CHECK(p.grad().defined() != left);  // dropped, or a zeroed view of the bucket
    }
    return std::make_pair(seen, zero.parameter_and_gradient_bytes());
  };
  const auto bucketed = train(false), left = train(true);
  REQUIRE(bucketed.first.size() == left.first.size());
  for (size_t i = 0; i < left.first.size(); ++i) CHECK(left.first[i] == Approx(bucketed.first[i]).epsilon(1e-6));
  CHECK(left.second == bucketed.second);  // the memory tally counts the gradients autograd holds
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
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
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
  // entry, targets outside this slice (here false), in fp32 and bf16 gradients; rows of 5,000 and of
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
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
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
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor flat = torch::randn({3'000'003}, on_gpu).to(dtype);
    const std::vector<torch::Tensor> pieces{flat.narrow(0, 0, 1'000'000), flat.narrow(0, 1'000'001, 1'999'999), flat.narrow(0, 0, 0), flat.narrow(0, 3'000'000, 3)};
    const double want = flat.cpu().to(torch::kFloat64).pow(2).sum().item<double>() - std::pow(flat[1'000'000].item<double>(), 2);
    const torch::Tensor got = fused::sum_of_squares(pieces);
    CHECK(got.scalar_type() == torch::kFloat64);
    CHECK(std::fabs(got.item<double>() - want) <= 1e-5 * want);
  }
}

TEST_CASE("CUDA: the MoE combine kernels equal the reference ops (fp32 within 1e-5, bf16 within its rounding), dropped pairs included", "[engine][cuda][fused][moe]") {
  if (!torch::cuda::is_available() || !fused::fused_kernels_active(torch::zeros({1}, torch::kCUDA))) {
    WARN("SKIPPED: no CUDA device visible, or a build without the fused kernels (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(6);
  const int64_t tokens = 301, k = 6, experts = 16, hidden = 2052;  // (2052: rows 8-byte aligned in bf16, not 16)
  for (int64_t capacity : {0, 100}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
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

TEST_CASE("CUDA: NCCL collectives agree with a reference on 2 GPUs", "[engine][cuda]") {
  // Counted from the driver's /proc entries: initialising CUDA here would break it in the forked ranks.
  if (read_host_facts().cuda_devices < 2) {
    WARN("SKIPPED: needs 2 CUDA devices");
    return;
  }
  const int port = dsrun::test::free_port();
  std::vector<pid_t> children;
  for (int r = 0; r < 2; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      bool ok = false;
      try {
        RendezvousOptions o;
        o.master_port = port;
        o.rank = r;
        o.world_size = 2;
        o.use_nccl = true;
        o.cuda_device = r;
        o.timeout_s = 60;
        auto comm = connect_communicator(o);
        torch::Device dev(torch::kCUDA, static_cast<c10::DeviceIndex>(r));
        torch::Tensor full = torch::arange(10, torch::TensorOptions().dtype(torch::kFloat32).device(dev)) * (r + 1);
        torch::Tensor shard = torch::empty({5}, full.options());
        comm->reduce_scatter_sum(full, shard);
        ok = torch::allclose(shard.cpu(), (torch::arange(10, torch::kFloat32) * 3).narrow(0, r * 5, 5));
        torch::Tensor gathered = torch::empty({10}, full.options());
        comm->all_gather(shard, gathered);
        ok &= torch::allclose(gathered.cpu(), torch::arange(10, torch::kFloat32) * 3);
        torch::Tensor scalar = torch::tensor({1.0 + r}, torch::kFloat64);  // a CPU scalar goes through the GPU
        comm->all_reduce_sum(scalar);
        ok &= scalar.item<double>() == 3.0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      _exit(ok ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
}

TEST_CASE("weights written under Hugging Face names load back into the model exactly (MoE, GQA)", "[engine][import]") {
  ModelSpec m = tiny_moe_decoder(4);
  m.kv_heads = m.heads / 2;
  torch::manual_seed(11);
  auto source = build_model(m, 16, {11});
  torch::manual_seed(12);
  auto target = build_model(m, 16, {12});

  // Source's parameters as Hugging Face tensors (fused q/k/v and gate/up split by rows).
  std::vector<torch::Tensor> keep;
  SafetensorsWriter writer;
  for (const auto& p : source->module().named_parameters())
    for (const auto& piece : hf_pieces(p.key(), p.value().sizes().vec(), m)) {
      torch::Tensor rows = p.value().detach().narrow(0, piece.row_begin, piece.rows).contiguous();
      keep.push_back(rows);
      writer.add(piece.name, "F32", rows.sizes().vec(), rows.data_ptr());
    }
  dsrun::test::TempDir dir;
  writer.write_atomic(dir.file("model.safetensors"));
  load_pretrained_weights(*target, m, dir.path());
  auto want = source->module().named_parameters();
  for (const auto& p : target->module().named_parameters()) CHECK(torch::equal(p.value(), want[p.key()]));

  ModelSpec other = m;
  other.hidden = m.hidden * 2;
  torch::manual_seed(13);
  auto wrong = build_model(other, 16, {13});
  try {
    load_pretrained_weights(*wrong, other, dir.path());
    FAIL("a model of another width accepted the weights");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("model.embed_tokens.weight has shape") != std::string::npos);
    auto* error = dynamic_cast<const dsrun::Error*>(&e);
    REQUIRE(error != nullptr);
    CHECK(error->context().key == "model.init_from");
  }
}

TEST_CASE("separate documents: a packed row trains as its documents would alone", "[engine][data][documents]") {
  // Row = document A (5 tokens) then B (3). With positions restarting and attention kept inside
  // each document, the row's summed loss is A's alone plus B's alone; crossing, it is not.
  ModelSpec m = tiny_decoder();
  auto model = build_model(m, 8, {9});
  UnitRunner plain;
  torch::manual_seed(3);
  const torch::Tensor x = torch::randint(m.vocab, {1, 8}, torch::kInt64), y = torch::randint(m.vocab, {1, 8}, torch::kInt64);
  const auto loss = [&](const torch::Tensor& in, const torch::Tensor& target, bool separate) {
    Batch b;
    b.inputs = in;
    b.targets = target;
    b.items = in.numel();
    if (separate) {
      b.positions = torch::tensor({0, 1, 2, 3, 4, 0, 1, 2}, torch::kInt64).view({1, 8});
      b.documents = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1}, torch::kInt32).view({1, 8});
    }
    torch::NoGradGuard no_grad;
    return one_rank_loss(*model, b, plain).task_loss * static_cast<double>(in.numel());
  };
  const double alone = loss(x.narrow(1, 0, 5), y.narrow(1, 0, 5), false) + loss(x.narrow(1, 5, 3), y.narrow(1, 5, 3), false);
  CHECK(loss(x, y, true) == Approx(alone).epsilon(1e-5));
  CHECK(std::fabs(loss(x, y, false) - alone) > 1e-4);  // without separation, B sees A
}

TEST_CASE("separate documents: batches carry positions and document numbers from the corpus", "[engine][data][documents]") {
  char pattern[] = "/tmp/dsrun-docs-XXXXXX";
  std::string dir = ::mkdtemp(pattern);
  // nanoGPT layout: token 0 closes a document every 5 tokens.
  std::string bytes;
  for (uint16_t k = 0; k < 400; ++k) {
    const uint16_t t = k % 5 == 4 ? 0 : static_cast<uint16_t>(1 + k % 50);
    bytes.append(reinterpret_cast<const char*>(&t), 2);
  }
  write_file_atomic(dir + "/c.bin", bytes);
  DataOptions data;
  data.kind = DataKind::Tokens;
  data.path = dir + "/c.bin";
  data.format = TokenFormat::Nanogpt;
  data.token_width = 2;
  data.document_token = 0;
  data.separate_documents = true;
  data.shuffle = false;
  ModelSpec m = tiny_decoder();
  Batch b = open_dataset(data, m, 8, 1)->train_batch(1, 1);  // window 1: tokens 8..16
  // The document in progress counts from the window's start, as Megatron-LM's reset_position_ids.
  CHECK(b.positions[0].equal(torch::tensor({0, 1, 0, 1, 2, 3, 4, 0}, torch::kInt64)));
  CHECK(b.documents[0].to(torch::kInt64).equal(torch::tensor({0, 0, 1, 1, 1, 1, 1, 2})));
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST_CASE("flat layout: 3 ranks get equal padded shards, weight decay on matrices clipped to each shard", "[engine][flat]") {
  // 15 + 4 = 19 elements pad to 21: 7 per rank. The matrix covers [0, 15), the bias [15, 19).
  const std::vector<std::vector<int64_t>> shapes{{5, 3}, {4}};
  FlatUnitLayout r1 = lay_out_flat_unit(shapes, 3, 1, /*sharded=*/true);
  CHECK(r1.offsets == std::vector<int64_t>{0, 15});
  CHECK(r1.numels == std::vector<int64_t>{15, 4});
  CHECK(r1.numel == 19);
  CHECK(r1.padded == 21);
  CHECK(r1.shard == 7);
  CHECK(r1.shard_begin == 7);
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  CHECK(r1.decay_ranges == Ranges{{0, 7}});  // [7, 14): all matrix
  FlatUnitLayout r2 = lay_out_flat_unit(shapes, 3, 2, /*sharded=*/true);
  CHECK(r2.shard_begin == 14);
  CHECK(r2.decay_ranges == Ranges{{0, 1}});  // [14, 21): the matrix's last element, then bias and padding
  // Unsharded (stage 0): one rank's shard is the whole unpadded buffer.
  FlatUnitLayout whole = lay_out_flat_unit(shapes, 3, 2, /*sharded=*/false);
  CHECK((whole.padded == 19 && whole.shard == 19 && whole.shard_begin == 0));
  CHECK(whole.decay_ranges == Ranges{{0, 15}});
}
