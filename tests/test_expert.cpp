// Expert parallelism on real Gloo processes: the expert groups within the data dimension, uneven
// all-to-all, and a MoE decoder's loss, gradients and norm against one process's, routing as it
// comes, lopsided (every token to one expert, a rank with none) and with a capacity that drops.
#include "engine/dist/mesh.hpp"
#include "engine/model/model.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/model/grouped_experts.hpp"
#include "engine/parallel/parallelize.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/train/loss.hpp"
#include "engine_util.hpp"

#include <catch2/catch.hpp>

#include <cmath>

using namespace dsrun;
using dsrun::test::in_mesh;
using dsrun::test::Reference;
using dsrun::test::token_batch;

TEST_CASE("expert groups fold into the data dimension: shards are consecutive data ranks, replicas keep the same experts", "[engine][mesh][expert]") {
  MeshShape s{1, 4, 2, 2};  // data 4 (2 replicas of 2 expert shards) × tensor 2
  CHECK(s.size() == 8);
  // Rank 5 is data 2, tensor 1: shard 0 of replica 1.
  CHECK(s.expert_shard(5) == 0);
  CHECK(s.expert_replica(5) == 1);
  CHECK(s.expert_group_of(5, ExpertGroup::Shards) == std::vector<int>{5, 7});
  CHECK(s.expert_group_of(5, ExpertGroup::Replicas) == std::vector<int>{1, 5});
  CHECK(s.expert_group_name(7, ExpertGroup::Shards) == s.expert_group_name(5, ExpertGroup::Shards));
  CHECK(s.expert_group_name(3, ExpertGroup::Replicas) != s.expert_group_name(1, ExpertGroup::Replicas));
  MeshShape none{2, 2, 1};
  CHECK(none.expert_group_of(3, ExpertGroup::Shards) == std::vector<int>{3});
  CHECK(none.expert_group_of(3, ExpertGroup::Replicas) == std::vector<int>{2, 3});  // stage 1: data 0 and 1
}

TEST_CASE("all-to-all with uneven rows: each rank receives what every rank had for it, rows it was told of", "[engine][comm][expert]") {
  CHECK(dsrun::test::in_processes(3, [](int rank, Communicator& comm) {
    // Rank q sends q + r rows to rank r, each row [q, r, i]; nothing from rank 0 to rank 0.
    std::vector<int64_t> send, recv;
    std::vector<torch::Tensor> rows;
    for (int r = 0; r < 3; ++r) {
      send.push_back(rank + r);
      recv.push_back(r + rank);
      for (int i = 0; i < rank + r; ++i) rows.push_back(torch::tensor({static_cast<float>(rank), static_cast<float>(r), static_cast<float>(i)}));
    }
    torch::Tensor in = rows.empty() ? torch::empty({0, 3}) : torch::stack(rows);
    torch::Tensor out = torch::empty({3 * rank + 3, 3});
    comm.all_to_all(in, out, send, recv);
    int64_t at = 0;
    bool ok = true;
    for (int q = 0; q < 3; ++q)
      for (int i = 0; i < q + rank; ++i, ++at) ok &= torch::equal(out[at], torch::tensor({static_cast<float>(q), static_cast<float>(rank), static_cast<float>(i)}));
    return ok && at == out.size(0);
  }));
}

TEST_CASE("expert parallelism's started exchange keeps its gradient when the wire format differs: bf16 rows over Gloo, pairs' rows or tokens once per rank", "[engine][comm][expert]") {
  // Gloo carries bf16 as fp32, so finishing the dispatch copies into the exchange's result, and the
  // wait runs where autograd records; the rows' gradient must still come back through it.
  for (bool once : {false, true}) {
    INFO((once ? "tokens once per rank" : "every pair's row"));
    CHECK(in_mesh({1, 2, 1, 2}, [once](DeviceMesh& mesh) {
      ExpertParallel experts(mesh.experts(ExpertGroup::Shards), ExpertExchange{true, once});
      const int rank = mesh.rank();
      // 2 experts a rank, 4 in all: this rank's 6 pairs go 1, 2, 0, 3 to experts 0-3, each its own token.
      const torch::Tensor counts = torch::tensor({int64_t{1}, int64_t{2}, int64_t{0}, int64_t{3}});
      torch::Tensor rows = (torch::arange(12, torch::kFloat32).reshape({6, 2}) + 100 * rank).to(torch::kBFloat16).requires_grad_(true);
      const RoutedPairs pairs{rows, torch::arange(6, torch::kInt64), 1, [&] { return rows * 1; }};
      bool ran_meanwhile = false;
      // Expert e multiplies its rows by e + 1 (the counts say which rows are whose).
      const torch::Tensor out = experts.run(pairs, counts, [&](const torch::Tensor& r, const torch::Tensor& c) {
        const torch::Tensor factor = torch::repeat_interleave(torch::arange(1, c.numel() + 1, torch::kFloat32) + 2 * mesh.experts(ExpertGroup::Shards).rank(), c);
        return r * factor.unsqueeze(1).to(r.scalar_type());
      }, [&] { ran_meanwhile = true; });
      out.sum().backward();
      const torch::Tensor want = torch::tensor({1.f, 2.f, 2.f, 4.f, 4.f, 4.f}).unsqueeze(1).expand({6, 2});
      return ran_meanwhile && rows.grad().defined() && torch::equal(rows.grad().to(torch::kFloat32), want) &&
             torch::equal(out.to(torch::kFloat32), rows.detach().to(torch::kFloat32) * want);
    }));
  }
}

TEST_CASE("tokens once per rank: a token chosen by several experts of one rank travels there once, and outputs per pair and the summed gradient match every pair's row travelling", "[engine][comm][expert]") {
  CHECK(in_mesh({1, 2, 1, 2}, [](DeviceMesh& mesh) {
    const int rank = mesh.rank();
    // 3 experts a rank, 6 in all, top-3 choices of 4 tokens: token t chooses experts listed below,
    // so that some tokens go to one rank with two or three choices and others to both.
    const std::vector<std::vector<int64_t>> choices = {{0, 1, 2}, {0, 3, 4}, {5, 4, 3}, {1, 5, 2}};
    std::vector<int64_t> pair_expert, pair_token;
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t e : choices[t]) pair_expert.push_back((e + 3 * rank) % 6), pair_token.push_back(t);  // the ranks route differently
    const torch::Tensor experts_of = torch::tensor(pair_expert);
    const torch::Tensor by_expert = std::get<1>(experts_of.sort(/*stable=*/true, 0, false));
    const torch::Tensor token = torch::tensor(pair_token).index_select(0, by_expert);
    const torch::Tensor counts = torch::zeros({6}, torch::kInt64).scatter_add_(0, experts_of, torch::ones_like(experts_of));
    const torch::Tensor x = torch::randn({4, 8}, torch::TensorOptions().dtype(torch::kFloat64)).add(rank).to(torch::kFloat32);
    const torch::Tensor upstream = torch::arange(token.numel() * 8, torch::kFloat32).reshape({-1, 8}).sin();
    // Expert e: rows · (e + 1) + e, its local index from the counts.
    auto local = [&](const torch::Tensor& r, const torch::Tensor& c) {
      const torch::Tensor e = torch::repeat_interleave(torch::arange(c.numel(), torch::kFloat32) + 3 * mesh.experts(ExpertGroup::Shards).rank(), c).unsqueeze(1);
      return r * (e + 1) + e;
    };
    std::vector<torch::Tensor> outs, grads;
    std::vector<int64_t> dispatched;
    for (bool once : {false, true}) {
      ExpertParallel experts(mesh.experts(ExpertGroup::Shards), ExpertExchange{true, once});
      torch::Tensor tokens = x.clone().requires_grad_(true);
      const RoutedPairs pairs{tokens, token, 3, [&] { return tokens.index_select(0, token); }};
      torch::Tensor out = experts.run(pairs, counts, local, [] {});
      (out * upstream).sum().backward();
      outs.push_back(out.detach());
      grads.push_back(tokens.grad());
      dispatched.push_back(experts.rows_sent());
    }
    // This rank's 12 pairs: 6 to the other rank as rows; as tokens, only the distinct ones.
    // (On both ranks tokens 1, 2 and 3 have choices on the other rank: 2 + 3 + 1 pairs.)
    return torch::allclose(outs[0], outs[1]) && torch::allclose(grads[0], grads[1], 1e-6, 1e-6) && dispatched[0] == 6 && dispatched[1] == 3;
  }));
}

namespace {

constexpr int64_t kRowsPerRank = 2, kSeq = 16;

// One process, no parallelism, on the data ranks' slices as micro-batches (the trainer's
// accumulation: each slice's mean loss / D), so that the balance loss sees the same tokens.
Reference one_process_micro_batches(const ModelSpec& m, const Batch& batch, int slices) {
  auto model = build_model(m, kSeq, {7});
  UnitRunner plain;
  Reference r;
  for (int d = 0; d < slices; ++d) {
    Batch part = batch;
    part.inputs = batch.inputs.narrow(0, d * kRowsPerRank, kRowsPerRank);
    part.targets = batch.targets.narrow(0, d * kRowsPerRank, kRowsPerRank);
    part.items = kRowsPerRank * kSeq;
    MicroBatchLoss l = dsrun::test::one_rank_loss(*model, part, plain);
    (l.loss / slices).backward();
    r.loss += l.task_loss / slices;
  }
  dsrun::test::collect_gradients(*model, r);
  return r;
}

struct ExpertCase {
  MeshShape shape;
  int stage = 0;
  bool recompute = false;
  bool shared_beside_dispatch = true;  // ExecutionModes::shared_experts_beside_dispatch
  bool once = true;                    // ExecutionModes::tokens_once_per_rank
};

// Data rank d trains on rows [2d, 2d + 2) of one batch: the mean loss over the data ranks, the
// global norm, and (ZeRO-0) every gradient this rank keeps within 1e-5 of one process's.
bool expert_parallel_matches(const ModelSpec& m, const ExpertCase& c) {
  return in_mesh(c.shape, [&](DeviceMesh& mesh) {
    const int D = mesh.shape().data, d = mesh.coordinates().data;
    const Batch batch = token_batch(kRowsPerRank * D, kSeq, m.vocab, 3);
    const Reference ref = one_process_micro_batches(m, batch, D);  // (before any collective: autograd must not run before a fork)
    ModelBuild build;
    build.seed = 7;
    build.deferred = true;
    auto model = build_model(m, kSeq, build);
    ParallelizeOptions options;
    options.zero.stage = c.stage;
    options.recomputation = c.recompute;
    options.shared_experts_beside_dispatch = c.shared_beside_dispatch;
    options.tokens_once_per_rank = c.once;
    auto parallel = parallelize(*model, mesh, options);
    Batch mine = batch;
    mine.inputs = batch.inputs.narrow(0, d * kRowsPerRank, kRowsPerRank);
    mine.targets = batch.targets.narrow(0, d * kRowsPerRank, kRowsPerRank);
    mine.items = kRowsPerRank * kSeq;
    MicroBatchLoss l = micro_batch_loss(model->forward(mine, *parallel), mine, parallel->tensor());
    l.loss.backward();
    parallel->zero().after_backward();
    parallel->zero().reduce_gradients();
    torch::Tensor loss = torch::tensor({l.task_loss / D}, torch::kFloat64);
    mesh.along(MeshDim::Data).all_reduce_sum(loss);
    return dsrun::test::matches_reference(mesh, *model, loss.item<double>(), parallel->global_grad_norm(), ref, c.stage);
  });
}

}  // namespace

TEST_CASE("expert parallelism: ep2 and ep2 × dp2 give one process's loss, gradients and norm, shared experts beside the dispatch or before", "[engine][expert]") {
  const ModelSpec m = dsrun::test::tiny_moe_decoder(4);
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 0}));
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 0, false, false}));
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 0, false, true, false}));  // every pair's row travels
  CHECK(expert_parallel_matches(m, {{1, 4, 1, 2}, 1}));
}

TEST_CASE("expert parallelism with tensor parallelism, ZeRO-3 and recomputation", "[engine][expert][tensor]") {
  const ModelSpec m = dsrun::test::tiny_moe_decoder(4);
  CHECK(expert_parallel_matches(m, {{1, 2, 2, 2}, 0}));
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 3, true}));
}

TEST_CASE("expert parallelism when routing is lopsided: every token to one expert (the other rank gets none), and a capacity that drops", "[engine][expert]") {
  ModelSpec m = dsrun::test::tiny_moe_decoder(4);
  m.moe.top_k = 1;
  m.moe.route_bias = {100, 0, 0, 0};  // expert 0 (rank 0's) always wins
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 0}));
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 2}));
  ModelSpec dropping = dsrun::test::tiny_moe_decoder(4);
  dropping.moe.capacity_factor = 0.5;  // half the mean: about half the pairs dropped
  CHECK(expert_parallel_matches(dropping, {{1, 2, 1, 2}, 0}));
}

// The grouped experts against the loop through autograd's own ops: outputs and every gradient,
// with uneven groups and an expert that gets no row (its weights' gradient is zero).
TEST_CASE("grouped experts equal the expert-by-expert loop: outputs and gradients, an empty expert, weights stacked as views", "[engine][expert][grouped]") {
  torch::manual_seed(11);
  const int64_t hidden = 16, inner = 8;
  const std::vector<int64_t> sizes = {5, 0, 9, 2};
  const int64_t experts = static_cast<int64_t>(sizes.size()), rows = 16;
  // Every gate/up weight in one buffer, then every down weight, as ZeRO's flat buffer holds them.
  torch::Tensor flat = torch::randn({experts * 2 * inner * hidden + experts * hidden * inner}) * 0.3;
  auto make = [&](bool views) {
    std::vector<torch::Tensor> gate_up, down;
    for (int64_t e = 0; e < experts; ++e) {
      torch::Tensor g = flat.narrow(0, e * 2 * inner * hidden, 2 * inner * hidden).view({2 * inner, hidden});
      torch::Tensor d = flat.narrow(0, experts * 2 * inner * hidden + e * hidden * inner, hidden * inner).view({hidden, inner});
      gate_up.push_back(views ? g.detach().requires_grad_(true) : g.detach().clone().requires_grad_(true));
      down.push_back(views ? d.detach().requires_grad_(true) : d.detach().clone().requires_grad_(true));
    }
    return std::make_pair(gate_up, down);
  };
  auto [gate_up, down] = make(true);
  auto [gate_up_ref, down_ref] = make(false);
  bool viewed = false;
  torch::Tensor stacked = stack_weights(gate_up, &viewed);
  CHECK(viewed);
  CHECK(stacked.data_ptr() == gate_up[0].data_ptr());
  CHECK(stacked.sizes() == torch::IntArrayRef({experts, 2 * inner, hidden}));
  stack_weights(gate_up_ref, &viewed);
  CHECK_FALSE(viewed);  // separate tensors: copied
  CHECK(torch::equal(stack_weights(gate_up_ref), stacked));

  torch::Tensor x = torch::randn({rows, hidden}).requires_grad_(true);
  torch::Tensor x_ref = x.detach().clone().requires_grad_(true);
  torch::Tensor counts = torch::tensor(sizes, torch::kInt64);
  torch::Tensor upstream = torch::randn({rows, hidden});
  torch::Tensor y = grouped_swiglu_experts(x, counts, gate_up, down);
  torch::Tensor y_ref = looped_swiglu_experts(x_ref, counts, gate_up_ref, down_ref);
  CHECK(torch::allclose(y, y_ref, 1e-5, 1e-6));
  (y * upstream).sum().backward();
  (y_ref * upstream).sum().backward();
  CHECK(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));
  for (int64_t e = 0; e < experts; ++e) {
    INFO("expert " << e);
    REQUIRE(gate_up[e].grad().defined());
    if (sizes[e] == 0) {
      CHECK(gate_up[e].grad().abs().max().item<double>() == 0);
      CHECK(down[e].grad().abs().max().item<double>() == 0);
      continue;
    }
    CHECK(torch::allclose(gate_up[e].grad(), gate_up_ref[e].grad(), 1e-5, 1e-6));
    CHECK(torch::allclose(down[e].grad(), down_ref[e].grad(), 1e-5, 1e-6));
  }
}

TEST_CASE("in ZeRO's flat buffers a MoE layer's routed expert weights lie kind after kind: the grouped product reads them without a copy", "[engine][expert][grouped]") {
  ModelSpec m = dsrun::test::tiny_moe_decoder(4);
  for (int stage : {0, 3}) {
    INFO("ZeRO " << stage);
    auto model = build_model(m, 16, {5});
    auto comm = single_process_communicator();
    ZeroOptions zo;
    zo.stage = stage;
    ZeroDataParallel zero(*model, *comm, zo);
    // Stage 3 holds the weights only while gathered: inside the unit's computation.
    std::vector<ParameterUnit> units = model->parameter_units();
    int moe_unit = -1;
    for (size_t u = 0; u < units.size(); ++u)
      for (const auto& n : units[u].names)
        if (n.find("moe.expert") != std::string::npos) moe_unit = static_cast<int>(u);
    REQUIRE(moe_unit >= 0);
    bool gate_up_viewed = false, down_viewed = false;
    zero.run(moe_unit, [&](const Tensors& in) {
      std::vector<torch::Tensor> gate_up, down;
      for (auto& p : model->module().named_parameters()) {
        if (p.key().find("moe.expert") == std::string::npos) continue;
        (p.key().find("gate_up") != std::string::npos ? gate_up : down).push_back(p.value());
      }
      REQUIRE(gate_up.size() == 4);
      stack_weights(gate_up, &gate_up_viewed);
      stack_weights(down, &down_viewed);
      return in;
    }, {torch::zeros({1})});
    CHECK(gate_up_viewed);
    CHECK(down_viewed);
  }
}

// On a GPU: PyTorch's grouped kernel (compat::grouped_mm) against one mm per group, both forms,
// and the experts' outputs and gradients against the loop; bf16 within its rounding, fp32 within
// 1e-5 where this libtorch runs fp32 grouped products on the device.
TEST_CASE("CUDA: the grouped matrix product kernel equals the loop, and the grouped experts the expert-by-expert loop", "[engine][cuda][expert][grouped]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: the grouped kernel is compared on a GPU machine (bench/gpu_moe.sh runs this test)");
    return;
  }
  torch::manual_seed(12);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const std::vector<int64_t> sizes = {40, 0, 72, 8, 136};  // one empty group, uneven rows
  const int64_t groups = static_cast<int64_t>(sizes.size()), rows = 256, k = 64, n = 96;
  torch::Tensor offs = torch::tensor(sizes, torch::kInt64).cumsum(0).to(torch::kInt32).to(torch::kCUDA);
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    INFO("dtype " << c10::toString(dtype));
    const double tolerance = dtype == torch::kBFloat16 ? 2e-2 : 1e-5;
    torch::Tensor a = torch::randn({rows, k}, cuda).to(dtype), b = torch::randn({groups, n, k}, cuda).to(dtype).transpose(1, 2);
    INFO("kernel applies: " << compat::grouped_mm_kernel_applies(a, b));
    torch::Tensor got = compat::grouped_mm(a, b, offs), want = compat::grouped_mm_loop(a, b, offs);
    CHECK(torch::allclose(got.to(torch::kFloat32), want.to(torch::kFloat32), tolerance, tolerance * std::sqrt(double(k))));
    torch::Tensor g = torch::randn({rows, n}, cuda).to(dtype);
    got = compat::grouped_mm(a.t(), g, offs);
    want = compat::grouped_mm_loop(a.t(), g, offs);
    CHECK(torch::allclose(got.to(torch::kFloat32), want.to(torch::kFloat32), tolerance, tolerance * std::sqrt(double(rows))));
  }
  // The experts, bf16: the grouped function against the loop through autograd's ops.
  const int64_t hidden = 64, inner = 32, experts = groups;
  torch::Tensor counts = torch::tensor(sizes, torch::kInt64).to(torch::kCUDA);
  torch::Tensor flat = (torch::randn({experts * 3 * inner * hidden}, cuda) * 0.2).to(torch::kBFloat16);
  std::vector<torch::Tensor> gate_up, down, gate_up_ref, down_ref;
  for (int64_t e = 0; e < experts; ++e) {
    gate_up.push_back(flat.narrow(0, e * 2 * inner * hidden, 2 * inner * hidden).view({2 * inner, hidden}).detach().requires_grad_(true));
    down.push_back(flat.narrow(0, experts * 2 * inner * hidden + e * hidden * inner, hidden * inner).view({hidden, inner}).detach().requires_grad_(true));
    gate_up_ref.push_back(gate_up.back().detach().clone().requires_grad_(true));
    down_ref.push_back(down.back().detach().clone().requires_grad_(true));
  }
  torch::Tensor x = torch::randn({rows, hidden}, cuda).to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor x_ref = x.detach().clone().requires_grad_(true);
  torch::Tensor upstream = torch::randn({rows, hidden}, cuda).to(torch::kBFloat16);
  torch::Tensor y = grouped_swiglu_experts(x, counts, gate_up, down), y_ref = looped_swiglu_experts(x_ref, counts, gate_up_ref, down_ref);
  auto close = [](const torch::Tensor& p, const torch::Tensor& q) {
    const double scale = q.to(torch::kFloat32).abs().max().item<double>();
    return (p.to(torch::kFloat32) - q.to(torch::kFloat32)).abs().max().item<double>() <= 2e-2 * std::max(scale, 1e-3);
  };
  CHECK(close(y, y_ref));
  (y.to(torch::kFloat32) * upstream.to(torch::kFloat32)).sum().backward();
  (y_ref.to(torch::kFloat32) * upstream.to(torch::kFloat32)).sum().backward();
  CHECK(close(x.grad(), x_ref.grad()));
  for (int64_t e = 0; e < experts; ++e) {
    INFO("expert " << e);
    if (sizes[e] == 0) {
      CHECK(gate_up[e].grad().abs().max().item<double>() == 0);
      continue;
    }
    CHECK(close(gate_up[e].grad(), gate_up_ref[e].grad()));
    CHECK(close(down[e].grad(), down_ref[e].grad()));
  }
}

TEST_CASE("expert parallelism with V3's group-limited sigmoid routing, latent attention and MTP, recomputed under ZeRO-3", "[engine][expert][latent]") {
  const ModelSpec m = dsrun::test::tiny_v3_decoder();  // the MTP module's MoE block's experts sharded too
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 0}));
  CHECK(expert_parallel_matches(m, {{1, 2, 1, 2}, 3, true}));
}
