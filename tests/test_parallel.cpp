// The device mesh and tensor parallelism on real Gloo processes: each dimension's group, and a
// tensor-parallel decoder's loss, gradients and norm against the one-process model's.
#include "engine/dist/mesh.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/parallelize.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/train/loss.hpp"
#include "engine_util.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <map>

using namespace dsrun;
using dsrun::test::in_mesh;
using dsrun::test::Reference;
using dsrun::test::token_batch;

TEST_CASE("the mesh puts tensor innermost and names each group the same on its members", "[engine][mesh]") {
  MeshShape s{2, 3, 2};  // pipeline × data × tensor
  CHECK(s.size() == 12);
  CHECK(s.rank_of({1, 2, 1}) == 11);
  MeshCoordinates c = s.coordinates_of(7);  // (1, 0, 1)
  CHECK((c.pipeline == 1 && c.data == 0 && c.tensor == 1));
  CHECK(s.group_of(7, MeshDim::Tensor) == std::vector<int>{6, 7});
  CHECK(s.group_of(7, MeshDim::Data) == std::vector<int>{7, 9, 11});
  CHECK(s.group_of(7, MeshDim::Pipeline) == std::vector<int>{1, 7});
  for (int r : s.group_of(7, MeshDim::Data)) CHECK(s.group_name(r, MeshDim::Data) == s.group_name(7, MeshDim::Data));
  CHECK(s.group_name(7, MeshDim::Data) != s.group_name(6, MeshDim::Data));
}

TEST_CASE("each mesh dimension's communicator reaches only its group, and send, recv and all-to-all work", "[engine][mesh][comm]") {
  CHECK(in_mesh({1, 2, 2}, [](DeviceMesh& mesh) {
    const int rank = mesh.rank();
    bool ok = true;
    // Tensor groups {0,1} {2,3}; data groups {0,2} {1,3}.
    torch::Tensor t = torch::tensor({static_cast<double>(rank)}, torch::kFloat64);
    mesh.along(MeshDim::Tensor).all_reduce_sum(t);
    ok &= t.item<double>() == (rank < 2 ? 1.0 : 5.0);
    torch::Tensor d = torch::tensor({static_cast<double>(rank)}, torch::kFloat64);
    mesh.along(MeshDim::Data).all_reduce_sum(d);
    ok &= d.item<double>() == (rank % 2 == 0 ? 2.0 : 4.0);
    ok &= mesh.along(MeshDim::Pipeline).world_size() == 1;
    // A ring of sends in the world: even ranks send first, so that nobody waits on a cycle.
    Communicator& world = mesh.world();
    torch::Tensor mine = torch::full({3}, static_cast<float>(rank)), got = torch::empty({3});
    const int next = (rank + 1) % 4, previous = (rank + 3) % 4;
    if (rank % 2 == 0) {
      world.send(mine, next);
      world.recv(got, previous);
    } else {
      world.recv(got, previous);
      world.send(mine, next);
    }
    ok &= got.eq(static_cast<float>(previous)).all().item<bool>();
    // all-to-all: slice r of rank q's input is 10q + r; rank r receives 10q + r from every q.
    torch::Tensor in = torch::arange(4, torch::kFloat32) + 10.0f * rank, out = torch::empty({4});
    world.all_to_all(in, out);
    ok &= torch::equal(out, torch::arange(4, torch::kFloat32) * 10 + rank);
    return ok;
  }));
}

TEST_CASE("a tensor-parallel slice of the fused q/k/v weight holds whole heads of q, k and v", "[engine][tensor]") {
  // 4 q heads, 2 kv heads, head_dim 1: rows q0 q1 q2 q3 k0 k1 v0 v1.
  torch::Tensor w = torch::arange(8, torch::kFloat32).unsqueeze(1);
  TensorSplit split{TensorSplit::Rows, {4, 2, 2}};
  CHECK(torch::equal(tensor_slice(w, split, 0, 2).squeeze(1), torch::tensor({0.f, 1.f, 4.f, 6.f})));
  CHECK(torch::equal(tensor_slice(w, split, 1, 2).squeeze(1), torch::tensor({2.f, 3.f, 5.f, 7.f})));
  CHECK(tensor_split_problem({8, 1}, split, 4) == "2 rows");
  TensorSplit columns{TensorSplit::Columns, {}};
  CHECK(tensor_slice(torch::ones({3, 6}), columns, 1, 3).sizes() == std::vector<int64_t>{3, 2});
  // A model build copies the slice straight into the rank's parameter: the same values either way.
  for (int rank = 0; rank < 2; ++rank) {
    torch::Tensor rows = torch::empty({4, 1});
    copy_tensor_slice(rows, w, split, rank, 2);
    CHECK(torch::equal(rows, tensor_slice(w, split, rank, 2)));
    const torch::Tensor wide = torch::arange(24, torch::kFloat32).reshape({4, 6});
    torch::Tensor cols = torch::empty({4, 3});
    copy_tensor_slice(cols, wide, columns, rank, 2);
    CHECK(torch::equal(cols, tensor_slice(wide, columns, rank, 2)));
  }
}

namespace {

// One process, no parallelism: the loss, gradients and their norm for one batch.
Reference one_process(const ModelSpec& m, const Batch& batch) {
  auto model = build_model(m, 16, {7});
  UnitRunner plain;
  auto single = single_process_communicator();
  TensorParallel none(*single);
  MicroBatchLoss l = micro_batch_loss(model->forward(batch, plain), batch, none);
  l.loss.backward();
  Reference r;
  r.loss = l.task_loss;
  dsrun::test::collect_gradients(*model, r);
  return r;
}

// The same batch on `shape` (tensor-parallel, ZeRO `stage` over data ranks that all see it):
// every rank's loss, gradient slices and global norm within 1e-5 of one process's.
// loss_chunk > 0: the parallel model fuses its head with the vocabulary-parallel loss, that many
// tokens at a time (the reference keeps whole logits).
bool tensor_parallel_matches(const ModelSpec& m, const MeshShape& shape, int stage, bool sequence_parallel = false, int64_t loss_chunk = 0) {
  return in_mesh(shape, [&](DeviceMesh& mesh) {
    // The reference is computed in each rank's process: autograd must not run before a fork.
    const Batch batch = token_batch(2, 16, m.vocab, 3);
    const Reference ref = one_process(m, batch);
    ModelBuild build;
    build.seed = 7;
    build.deferred = true;
    build.loss_chunk_tokens = loss_chunk;
    auto model = build_model(m, 16, build);
    ParallelizeOptions options;
    options.zero.stage = stage;
    options.sequence_parallel = sequence_parallel;
    auto parallel = parallelize(*model, mesh, options);
    MicroBatchLoss l = micro_batch_loss(model->forward(batch, *parallel), batch, parallel->tensor());
    l.loss.backward();
    parallel->zero().after_backward();
    parallel->zero().reduce_gradients();
    return dsrun::test::matches_reference(mesh, *model, l.task_loss, parallel->global_grad_norm(), ref, stage);
  });
}

}  // namespace

TEST_CASE("tensor parallelism on 2 ranks gives one process's loss, gradients and norm (GQA, untied and tied)", "[engine][tensor]") {
  ModelSpec m = dsrun::test::tiny_decoder();  // 4 heads, 2 KV heads
  CHECK(tensor_parallel_matches(m, {1, 1, 2}, 0));
  m.tie_embeddings = true;
  CHECK(tensor_parallel_matches(m, {1, 1, 2}, 0));
}

TEST_CASE("tensor parallelism with MoE layers: router replicated, experts split", "[engine][tensor][moe]") {
  CHECK(tensor_parallel_matches(dsrun::test::tiny_moe_decoder(4), {1, 1, 2}, 0));
}

TEST_CASE("data × tensor parallelism: ZeRO-1 and ZeRO-3 over the data dimension, the norm over the mesh", "[engine][tensor][zero]") {
  CHECK(tensor_parallel_matches(dsrun::test::tiny_decoder(), {1, 2, 2}, 1));
  CHECK(tensor_parallel_matches(dsrun::test::tiny_decoder(), {1, 2, 2}, 3));
}

TEST_CASE("tensor parallelism with the fused projection and loss: one process's loss, gradients and norm", "[engine][tensor][loss]") {
  CHECK(tensor_parallel_matches(dsrun::test::tiny_decoder(), {1, 1, 2}, 0, false, 5));
  CHECK(tensor_parallel_matches(dsrun::test::tiny_decoder(), {1, 2, 2}, 3, true, 7));  // ZeRO-3 gathers the head; sequence parallel
}

TEST_CASE("sequence parallelism: norms on a part of the sequence, the same loss, gradients and norm", "[engine][tensor][sequence]") {
  ModelSpec m = dsrun::test::tiny_decoder();
  CHECK(tensor_parallel_matches(m, {1, 1, 2}, 0, true));
  m.tie_embeddings = true;
  CHECK(tensor_parallel_matches(m, {1, 2, 2}, 1, true));
}

TEST_CASE("tensor parallelism with latent attention, V3 routing and MTP: heads split, latents replicated, ZeRO-3 over the data dimension", "[engine][tensor][latent]") {
  const ModelSpec m = dsrun::test::tiny_v3_decoder();
  CHECK(tensor_parallel_matches(m, {1, 1, 2}, 0));
  CHECK(tensor_parallel_matches(m, {1, 2, 2}, 3, false, 5));  // and the fused projection and loss
}

TEST_CASE("fp32 gradients under data 2 x tensor 2 with sequence parallelism: 4 bf16 micro-batches accumulate to the sum of each one's reduced gradient, at ZeRO 0-3", "[engine][tensor][grad_dtype]") {
  // The reference runs the same layout one micro-batch at a time (each reduced alone) and sums the
  // four reduced gradients in fp64: each micro-batch's bf16 gradients are bitwise the same in both
  // (the norms' partial gradients summed over the tensor ranks in fp32 and rounded once), so
  // accumulating in fp32 leaves only fp32 rounding between them.
  const ModelSpec m = dsrun::test::tiny_decoder();
  for (int stage = 0; stage <= 3; ++stage)
    CHECK(in_mesh({1, 2, 2}, [&](DeviceMesh& mesh) {
      const int micro_batches = 4;
      auto batch = [&](int mb) { return token_batch(2, 16, m.vocab, 500 + 10 * mesh.coordinates().data + mb); };
      auto build = [&](int zero_stage) {
        ModelBuild b;
        b.seed = 7;
        b.deferred = true;
        auto model = build_model(m, 16, b);
        ParallelizeOptions options;
        options.zero.stage = zero_stage;
        options.zero.dtype = DType::Bf16;
        options.zero.grad_dtype = DType::Fp32;
        options.sequence_parallel = true;
        auto parallel = parallelize(*model, mesh, options);
        return std::make_pair(std::move(model), std::move(parallel));
      };
      auto step = [&](Model& model, ParallelModel& parallel, int mb, bool last) {
        parallel.zero().begin_micro_batch(last);
        const Batch b = batch(mb);
        micro_batch_loss(model.forward(b, parallel), b, parallel.tensor()).loss.backward();
        parallel.zero().after_backward();
      };
      // Reference: stage 0 (whole units on every rank), one micro-batch a step.
      auto [ref_model, ref_parallel] = build(0);
      std::vector<torch::Tensor> sums;
      for (int mb = 0; mb < micro_batches; ++mb) {
        step(*ref_model, *ref_parallel, mb, true);
        ref_parallel->zero().reduce_gradients();
        auto& shards = ref_parallel->zero().shards();
        for (size_t k = 0; k < shards.size(); ++k) {
          const torch::Tensor g = shards[k].flat_grad().to(torch::kFloat64);
          if (sums.size() <= k) sums.push_back(torch::zeros_like(g));
          sums[k] += g;
        }
        ref_parallel->zero().after_step();
      }
      auto [model, parallel] = build(stage);
      for (int mb = 0; mb < micro_batches; ++mb) step(*model, *parallel, mb, mb == micro_batches - 1);
      parallel->zero().reduce_gradients();
      double worst = 0, largest = 0;
      for (size_t k = 0; k < sums.size(); ++k) {
        const FlatUnitLayout& l = parallel->zero().units()[k].layout;
        torch::Tensor padded = torch::zeros({l.padded}, torch::kFloat64);  // (stage 0's units are not padded)
        padded.narrow(0, 0, l.numel).copy_(sums[k].narrow(0, 0, l.numel));
        const torch::Tensor expected = padded.narrow(0, l.shard_begin, l.shard);
        const torch::Tensor got = parallel->zero().shards()[k].flat_grad();
        if (got.scalar_type() != torch::kFloat32) return false;
        worst = std::max(worst, (got.to(torch::kFloat64) - expected).abs().max().item<double>());
        largest = std::max(largest, expected.abs().max().item<double>());
      }
      if (worst > 2e-6 * largest) std::fprintf(stderr, "rank %d stage %d: largest error %.3g of the largest gradient\n", mesh.rank(), stage, worst / largest);
      return worst <= 2e-6 * largest;
    }));
}
