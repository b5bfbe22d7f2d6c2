// ZeRO's owners on real processes: flat units built unit by unit, reductions overlapping backward,
// the norm over shards, recomputation around ZeRO, the offload pipeline, gradients left to autograd.
#include "engine/dist/communicator.hpp"
#include "engine/model/fused_ops.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/flat_layout.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/train/optimizer.hpp"
#include "engine_util.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <limits>

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
    ZeroDataParallel zero(*model, *comm, zo);
    // Recomputation around ZeRO's runner, as parallelize composes them (its step 4).
    struct Recomputing : UnitRunner {
      Recomputing(ZeroDataParallel& zero, Recomputation r) : zero(zero), recomputation(std::move(r)) {}
      Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) override {
        return zero.run(unit, [&](const Tensors& in) { return recomputation.run(unit, fn, in); }, inputs);
      }
      ZeroDataParallel& zero;
      Recomputation recomputation;
    } runner(zero, Recomputation(*model, checkpointing));
    MicroBatchLoss out = one_rank_loss(*model, batch, runner);
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
        for (size_t k = 0; k < zero.units().size(); ++k) {
          const torch::Tensor& master = zero.shards()[k].master;
          const int64_t begin = zero.units().master_begin(k), count = std::min<int64_t>(master.numel(), zero.units().numel(k) - begin);
          if (count > 0) same &= torch::equal(master.narrow(0, 0, count), flat_units[k].narrow(0, begin, count));
        }
        return same;
      }));
    }
}

TEST_CASE("gradient reductions start during backward, as soon as a unit's gradients (or stage 0's bucket) are complete", "[engine][overlap]") {
  // 2 Gloo ranks, one micro-batch: every unit starts its reduction from autograd's hooks, MoE
  // blocks too (the grouped experts give an expert no token chose a zero gradient). Gradients
  // stay right: the same batch on both ranks averages to the one-process gradient.
  CHECK(in_processes(2, [](int rank, Communicator& comm) {
    bool ok = true;
    for (bool moe : {false, true}) {
      // Stage 0 twice: buckets of 8 KB, which every tiny unit fills alone (each all-reduce issued
      // from the hooks), and the default 25 MB, which joins them all into one all-reduce issued
      // after backward (DDP's buckets): none overlapped, the gradients the same.
      for (int variant : {0, 1, 2, 3, 4}) {
        const int stage = variant == 4 ? 0 : variant;
        ModelSpec m = moe ? tiny_moe_decoder(4) : tiny_decoder();
        torch::manual_seed(21);
        auto model = build_model(m, 16, {21});
        ZeroOptions zo;
        zo.stage = stage;
        if (variant == 0) zo.bucket_bytes = 8192;
        ZeroDataParallel zero(*model, comm, zo);
        one_rank_loss(*model, token_batch(2, 16, m.vocab, 22), zero).loss.backward();
        const int64_t during_backward = zero.overlapped_reductions();
        zero.after_backward();
        zero.reduce_gradients();
        const int64_t units = static_cast<int64_t>(zero.units().size()), expected = variant == 4 ? 0 : units;
        if (during_backward != expected) {
          std::fprintf(stderr, "rank %d stage %d moe %d: %lld of %lld units overlapped\n", rank, stage, moe ? 1 : 0,
                       static_cast<long long>(during_backward), static_cast<long long>(units));
          ok = false;
        }
        const double ref = reference_grad_norm(m, 21, 22);
        ok &= std::abs(zero.masters().global_norm() - ref) <= 1e-5 * ref;
      }
    }
    return ok;
  }));
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
    const double sharded = zero.masters().global_norm();

    const double ref = reference_grad_norm(m, 7, 8);
    return std::fabs(sharded - ref) < 1e-4 * ref && rank >= 0;
  }));
}

TEST_CASE("an inf in one rank's gradient shard is every rank's fp16 overflow, and a clean step is none", "[engine][fp16]") {
  CHECK(in_processes(2, [](int rank, Communicator& comm) {
    ModelSpec m = tiny_decoder();
    torch::manual_seed(7);
    auto model = build_model(m, 16, {7});
    ZeroOptions zo;
    zo.stage = 2;
    ZeroDataParallel zero(*model, comm, zo);
    reduced_micro_batch(*model, zero, token_batch(2, 16, m.vocab, 8));
    const bool clean = zero.gradients_overflowed();
    if (rank == 1) zero.shards().back().flat_grad().narrow(0, 0, 1).fill_(std::numeric_limits<float>::infinity());
    const bool overflowed = zero.gradients_overflowed();
    return !clean && overflowed;
  }));
}

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
    return std::make_pair(loss, zero.masters().global_norm());
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
      const double norm = zero.masters().global_norm();
      CHECK(std::isfinite(norm));
      if (zero.offload().enabled()) zero.offload().start_host_update(opt.host_update(1e-2));
      else opt.step(1e-2);
      zero.after_step();
      losses.push_back(loss);
    }
    zero.offload().wait_host_update();
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
      seen.push_back(zero.masters().global_norm());
      if (left) CHECK(!zero.shards()[0].grad_pieces.empty());
      zero.masters().scale_gradients(0.5);  // as a clip would
      opt.step(1e-2);
      zero.after_step();
      for (size_t k = 0; k < zero.units().size(); ++k)
        for (const auto& p : zero.units().params(k)) CHECK(p.grad().defined() != left);  // dropped, or a zeroed view of the bucket
    }
    return std::make_pair(seen, zero.state_bytes().parameters_and_gradients);
  };
  const auto bucketed = train(false), left = train(true);
  REQUIRE(bucketed.first.size() == left.first.size());
  for (size_t i = 0; i < left.first.size(); ++i) CHECK(left.first[i] == Approx(bucketed.first[i]).epsilon(1e-6));
  CHECK(left.second == bucketed.second);  // the memory tally counts the gradients autograd holds
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

TEST_CASE("fp32 gradients: 4 bf16 micro-batches a rank on 2 ranks accumulate and reduce to the fp32 sum of their gradients at ZeRO 0-3 (MoE too), while bf16 gradients drift from it", "[engine][grad_dtype]") {
  // The reference: the same bf16 model in one process, each of the 8 micro-batches' gradients
  // (bitwise what each rank's backward makes) summed in fp64. With precision.grad_dtype = fp32
  // ZeRO's accumulated, reduced gradient is that sum to fp32 rounding; kept in bf16, each addition
  // rounds it to 8 bits of mantissa.
  CHECK(in_processes(2, [](int rank, Communicator& comm) {
    bool ok = true;
    const int micro_batches = 4;
    auto batch = [](int r, int mb, const ModelSpec& m) { return token_batch(2, 16, m.vocab, 300 + 10 * r + mb); };
    for (bool moe : {false, true}) {
      const ModelSpec m = moe ? tiny_moe_decoder(4) : tiny_decoder();
      // Reference gradients, unit by unit as ZeRO lays them out.
      torch::manual_seed(41);
      auto reference = build_model(m, 16, {41});
      for (auto& p : reference->module().parameters()) p.set_data(p.detach().to(torch::kBFloat16));
      const std::vector<ParameterUnit> reference_units = reference->parameter_units();
      std::vector<std::vector<torch::Tensor>> sums(reference_units.size());
      for (size_t k = 0; k < reference_units.size(); ++k)
        for (const auto& p : reference_units[k].params) sums[k].push_back(torch::zeros(p.sizes(), torch::kFloat64));
      UnitRunner plain;
      for (int r = 0; r < 2; ++r)
        for (int mb = 0; mb < micro_batches; ++mb) {
          for (auto& p : reference->module().parameters()) p.mutable_grad() = torch::Tensor();
          one_rank_loss(*reference, batch(r, mb, m), plain).loss.backward();
          for (size_t k = 0; k < reference_units.size(); ++k)
            for (size_t i = 0; i < reference_units[k].params.size(); ++i)
              if (reference_units[k].params[i].grad().defined()) sums[k][i] += reference_units[k].params[i].grad().to(torch::kFloat64);
        }
      for (int stage = moe ? 2 : 0; stage <= (moe ? 2 : 3); ++stage)
        for (DType grad_dtype : {DType::Fp32, DType::Bf16}) {
          torch::manual_seed(41);
          auto model = build_model(m, 16, {41});
          ZeroOptions zo;
          zo.stage = stage;
          zo.dtype = DType::Bf16;
          zo.grad_dtype = grad_dtype;
          ZeroDataParallel zero(*model, comm, zo);
          for (int mb = 0; mb < micro_batches; ++mb) {
            zero.begin_micro_batch(mb == micro_batches - 1);
            one_rank_loss(*model, batch(rank, mb, m), zero).loss.backward();
            zero.after_backward();
          }
          zero.reduce_gradients();
          double worst = 0, largest = 0;
          for (size_t k = 0; k < zero.units().size(); ++k) {
            const FlatUnitLayout& l = zero.units()[k].layout;
            torch::Tensor expected = torch::zeros({l.padded}, torch::kFloat64);
            for (size_t i = 0; i < sums[k].size(); ++i) expected.narrow(0, l.offsets[i], l.numels[i]).copy_(sums[k][i].flatten());
            expected = expected.narrow(0, l.shard_begin, l.shard);
            const torch::Tensor got = zero.shards()[k].flat_grad().to(torch::kFloat64);
            if (got.scalar_type() != torch::kFloat64 || got.numel() != expected.numel()) return false;
            worst = std::max(worst, (got - expected).abs().max().item<double>());
            largest = std::max(largest, expected.abs().max().item<double>());
          }
          const double relative = worst / largest;
          const bool right = grad_dtype == DType::Fp32 ? relative < 2e-6 : relative > 1e-4;
          if (!right || zero.shards()[0].flat_grad().scalar_type() != torch_dtype(grad_dtype)) {
            std::fprintf(stderr, "rank %d moe %d stage %d grad %s: largest error %.3g of the largest gradient\n", rank, moe ? 1 : 0, stage,
                         to_string(grad_dtype), relative);
            ok = false;
          }
        }
    }
    return ok;
  }));
}
