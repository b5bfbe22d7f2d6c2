// Dense decoders at speed: attention within packed documents (the masked path here, the
// variable-length flash kernel on GPUs), rotary by position in document, and the output projection
// fused with the cross-entropy over chunks of tokens, on one rank and vocabulary-parallel.
#include "engine/common/torch_compat.hpp"
#include "engine/model/document_attention.hpp"
#include "engine/model/fused_ops.hpp"
#include "engine/model/linear_cross_entropy.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/train/loss.hpp"
#include "engine_util.hpp"
#include <catch2/catch.hpp>

#include <limits>
#include <vector>

using namespace dsrun;
using dsrun::test::in_processes;

namespace {

// Documents of the given lengths packed into rows of `s` tokens: their numbers and positions.
struct Packing {
  torch::Tensor documents, positions;
};
Packing pack(const std::vector<std::vector<int64_t>>& rows, int64_t s) {
  Packing p{torch::empty({static_cast<int64_t>(rows.size()), s}, torch::kInt32), torch::empty({static_cast<int64_t>(rows.size()), s}, torch::kInt64)};
  for (size_t r = 0; r < rows.size(); ++r) {
    int64_t k = 0;
    for (size_t d = 0; d < rows[r].size(); ++d)
      for (int64_t i = 0; i < rows[r][d]; ++i, ++k) {
        p.documents[r][k] = static_cast<int32_t>(d);
        p.positions[r][k] = i;
      }
    REQUIRE(k == s);
  }
  return p;
}

// Causal attention over each document alone ([1, heads, len, d] slices), put back in place.
torch::Tensor per_document(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const std::vector<std::vector<int64_t>>& rows) {
  const int64_t group = q.size(2) / k.size(2);
  std::vector<torch::Tensor> out_rows;
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<torch::Tensor> parts;
    int64_t begin = 0;
    for (int64_t len : rows[r]) {
      auto slice = [&](const torch::Tensor& x) { return x[r].narrow(0, begin, len).transpose(0, 1).unsqueeze(0); };  // [1, heads, len, d]
      torch::Tensor kk = slice(k).repeat_interleave(group, 1), vv = slice(v).repeat_interleave(group, 1);
      parts.push_back(compat::causal_attention(slice(q), kk, vv)[0].transpose(0, 1));
      begin += len;
    }
    out_rows.push_back(torch::cat(parts, 0));
  }
  return torch::stack(out_rows);
}

}  // namespace

TEST_CASE("attention within packed documents equals each document's attention alone, forward and gradients", "[engine][documents]") {
  const std::vector<std::vector<int64_t>> rows{{5, 1, 10}, {16}, {3, 3, 3, 7}};
  const Packing p = pack(rows, 16);
  const PackedDocuments docs(p.documents, p.positions, torch::kCPU);
  CHECK(docs.count() == 8);
  CHECK(docs.longest() == 16);
  torch::manual_seed(5);
  for (int64_t kv_heads : {4, 2}) {  // multi-head, and grouped-query (2 query heads per KV head)
    INFO("kv_heads " << kv_heads);
    const torch::Tensor q0 = torch::randn({3, 16, 4, 8}), k0 = torch::randn({3, 16, kv_heads, 8}), v0 = torch::randn({3, 16, kv_heads, 8});
    const torch::Tensor upstream = torch::randn({3, 16, 4, 8});
    auto run = [&](bool packed) {
      torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true), v = v0.clone().requires_grad_(true);
      torch::Tensor out = packed ? docs.attend(q, k, v) : per_document(q, k, v, rows);
      (out * upstream).sum().backward();
      return std::vector<torch::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
    };
    const auto packed = run(true), alone = run(false);
    for (size_t i = 0; i < packed.size(); ++i) {
      INFO("tensor " << i << " (out, dq, dk, dv)");
      CHECK(torch::allclose(packed[i], alone[i], 1e-5, 1e-6));
    }
  }
}

TEST_CASE("rotary by position in document rotates each document as if it began the row", "[engine][documents][fused]") {
  const int64_t d = 8;
  torch::Tensor inv = 1.0 / torch::pow(10000.0, torch::arange(0, d, 2, torch::kFloat64) / static_cast<double>(d));
  torch::Tensor full = torch::cat({torch::outer(torch::arange(16, torch::kFloat64), inv), torch::outer(torch::arange(16, torch::kFloat64), inv)}, -1);
  const torch::Tensor cos = full.cos().to(torch::kFloat32), sin = full.sin().to(torch::kFloat32);
  const Packing p = pack({{5, 11}}, 16);
  torch::manual_seed(6);
  const torch::Tensor qk = torch::randn({1, 16, 3 * d});
  const torch::Tensor packed = fused::rotary(qk, d, cos, sin, p.positions);
  CHECK(torch::allclose(packed.narrow(1, 0, 5), fused::rotary(qk.narrow(1, 0, 5), d, cos, sin), 1e-6, 1e-6));
  CHECK(torch::allclose(packed.narrow(1, 5, 11), fused::rotary(qk.narrow(1, 5, 11).contiguous(), d, cos, sin), 1e-6, 1e-6));
  CHECK_FALSE(torch::allclose(packed, fused::rotary(qk, d, cos, sin), 1e-3, 1e-3));  // positions matter
}

TEST_CASE("the chunked projection and loss equals the plain loss and gradients within 1e-6 (fp32)", "[engine][loss]") {
  torch::manual_seed(8);
  const int64_t n = 37, h = 16, vocab = 50;
  const torch::Tensor h0 = torch::randn({n, h}), w0 = 0.3 * torch::randn({vocab, h}), targets = torch::randint(vocab, {n}, torch::kInt64);
  auto plain = [&](double scale) {
    torch::Tensor x = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    torch::Tensor loss = torch::nn::functional::cross_entropy(torch::linear(x, w), targets);
    (loss * scale).backward();
    return std::vector<torch::Tensor>{loss.detach(), x.grad(), w.grad()};
  };
  for (double scale : {1.0, 3.5}) {  // a loss scale or micro-batch weight multiplies the gradients
    const auto want = plain(scale);
    for (int64_t chunk : {1, 7, 36, 37, 1000}) {
      for (bool in_forward : {true, false}) {
        INFO("chunk " << chunk << (in_forward ? ", gradients in forward" : ", recomputed in backward") << ", scale " << scale);
        torch::Tensor x = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        LinearCrossEntropyOptions o;
        o.chunk_tokens = chunk;
        o.gradient_in_forward = in_forward;
        torch::Tensor loss = linear_cross_entropy(x, w, targets, o);
        CHECK(loss.scalar_type() == torch::kFloat32);
        (loss * scale).backward();
        CHECK(std::fabs(loss.item<double>() - want[0].item<double>()) <= 1e-6);
        CHECK(torch::allclose(x.grad(), want[1], 0, 1e-6));
        CHECK(torch::allclose(w.grad(), want[2], 0, 1e-6));
      }
    }
  }
  SECTION("without autograd it is the loss alone") {
    const double want = plain(1)[0].item<double>();
    torch::NoGradGuard no_grad;
    LinearCrossEntropyOptions o;
    o.chunk_tokens = 5;
    CHECK(std::fabs(linear_cross_entropy(h0, w0, targets, o).item<double>() - want) <= 1e-6);
  }
}

TEST_CASE("the chunked projection and loss split by vocabulary over 2 ranks equals one rank's within 1e-6", "[engine][loss][tensor]") {
  CHECK(in_processes(2, [](int rank, Communicator& comm) {
    torch::manual_seed(9);
    const int64_t n = 23, h = 8, vocab = 30;
    const torch::Tensor h0 = torch::randn({n, h}), w0 = 0.3 * torch::randn({vocab, h}), targets = torch::randint(vocab, {n}, torch::kInt64);
    torch::Tensor x = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    torch::Tensor want = torch::nn::functional::cross_entropy(torch::linear(x, w), targets);
    want.backward();
    bool ok = true;
    for (int64_t chunk : {4, 23}) {
      torch::Tensor xs = h0.clone().requires_grad_(true), ws = w0.narrow(0, rank * vocab / 2, vocab / 2).clone().requires_grad_(true);
      LinearCrossEntropyOptions o;
      o.chunk_tokens = chunk;
      CommunicatorVocabulary vocabulary(comm);
      o.group = &vocabulary;
      torch::Tensor loss = linear_cross_entropy(xs, ws, targets, o);
      loss.backward();
      torch::Tensor dh = xs.grad().clone();
      comm.all_reduce_sum(dh);  // each rank's share of the hidden states' gradient (the region's entry sums them)
      ok &= std::fabs(loss.item<double>() - want.item<double>()) <= 1e-6;
      ok &= torch::allclose(dh, x.grad(), 0, 1e-6);
      ok &= torch::allclose(ws.grad(), w.grad().narrow(0, rank * vocab / 2, vocab / 2), 0, 1e-6);
      if (!ok) std::fprintf(stderr, "rank %d chunk %lld differs\n", rank, static_cast<long long>(chunk));
    }
    return ok;
  }));
}

TEST_CASE("a decoder with the fused projection and loss trains as with whole logits", "[engine][loss]") {
  ModelSpec m = dsrun::test::tiny_decoder();
  const Batch batch = dsrun::test::token_batch(2, 16, m.vocab, 4);
  auto grads_of = [&](int64_t chunk, double& loss) {
    ModelBuild build;
    build.seed = 7;
    build.loss_chunk_tokens = chunk;
    auto model = build_model(m, 16, build);
    CHECK(model->computes_loss() == (chunk > 0));
    UnitRunner plain;
    MicroBatchLoss l = dsrun::test::one_rank_loss(*model, batch, plain);
    l.loss.backward();
    loss = l.task_loss;
    dsrun::test::Reference r;
    dsrun::test::collect_gradients(*model, r);
    return r;
  };
  double whole = 0, chunked = 0;
  const dsrun::test::Reference a = grads_of(0, whole), b = grads_of(5, chunked);
  CHECK(chunked == Approx(whole).epsilon(1e-6));
  for (const auto& [name, g] : a.grads) {
    INFO(name);
    CHECK(torch::allclose(b.grads.at(name), g, 1e-5, 1e-6));
  }
}

TEST_CASE("CUDA: the variable-length flash kernel matches the masked path, and the fused loss kernel the reference", "[engine][cuda][documents]") {
  if (!torch::cuda::is_available()) {
    WARN("SKIPPED: no CUDA device visible (this test runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  const torch::Device gpu(torch::kCUDA, 0);
  const std::vector<std::vector<int64_t>> rows{{100, 28, 300, 84}, {512}, {1, 511}};
  const Packing p = pack(rows, 512);
  const PackedDocuments docs(p.documents, p.positions, gpu, /*variable_length=*/true);
  torch::manual_seed(10);
  const auto bf16 = torch::TensorOptions().device(gpu).dtype(torch::kBFloat16);
  const torch::Tensor q0 = torch::randn({3, 512, 8, 64}, bf16), k0 = torch::randn({3, 512, 4, 64}, bf16), v0 = torch::randn({3, 512, 4, 64}, bf16);
  const torch::Tensor upstream = torch::randn({3, 512, 8, 64}, bf16);
  REQUIRE(compat::varlen_attention_applies(q0));
  auto run = [&](bool kernel) {
    torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true), v = v0.clone().requires_grad_(true);
    torch::Tensor out = kernel ? docs.attend(q, k, v) : docs.attend_masked(q, k, v);
    (out * upstream).sum().backward();
    return std::vector<torch::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
  };
  const auto varlen = run(true), masked = run(false);
  for (size_t i = 0; i < varlen.size(); ++i) {
    INFO("tensor " << i << " (out, dq, dk, dv)");
    const torch::Tensor a = varlen[i].to(torch::kFloat32), b = masked[i].to(torch::kFloat32);
    CHECK(((a - b).abs().max().item<double>()) <= 0.02 * std::max(1.0, b.abs().max().item<double>()));
  }
  // The one-pass log-sum-exp against libtorch's, rows of mixed scale (and one of -inf but one entry).
  torch::Tensor z = torch::randn({37, 5000}, torch::TensorOptions().device(gpu)) * torch::linspace(0.1, 30, 37, torch::TensorOptions().device(gpu)).unsqueeze(1);
  z[3].fill_(-std::numeric_limits<float>::infinity());
  z[3][17] = 2.5;
  CHECK(torch::allclose(fused::row_logsumexp(z), z.logsumexp(1), 1e-5, 1e-5));
  // The fused projection and loss on the GPU (the one-pass gradient kernel, fp32 products) against
  // the plain expression in fp32, and in bf16 within bf16's tolerance.
  const int64_t n = 300, h = 64, vocab = 1000;
  const torch::Tensor h0 = torch::randn({n, h}, torch::TensorOptions().device(gpu)), w0 = 0.2 * torch::randn({vocab, h}, torch::TensorOptions().device(gpu));
  const torch::Tensor targets = torch::randint(vocab, {n}, torch::TensorOptions().device(gpu).dtype(torch::kInt64));
  // Gradients in forward (one kernel per chunk, scaled in backward) and recomputed in backward;
  // a loss scale of 3 reaches both. fp16 as its runs take it (recomputed, under a dynamic scale
  // of 4096) and in forward: its kernels' half instantiations (issue 48's fp16 gap).
  for (auto [dtype, in_forward] : {std::pair{torch::kFloat32, true}, {torch::kBFloat16, true}, {torch::kFloat32, false}, {torch::kBFloat16, false},
                                   {torch::kFloat16, false}, {torch::kFloat16, true}}) {
    const double scale = dtype == torch::kFloat16 ? 4096 : 3;
    INFO(c10::toString(dtype) << (in_forward ? ", gradients in forward" : ", gradients in backward"));
    torch::Tensor x = h0.to(dtype).clone().requires_grad_(true), w = w0.to(dtype).clone().requires_grad_(true);
    torch::Tensor want = torch::nn::functional::cross_entropy(torch::linear(x, w).to(torch::kFloat32), targets);
    (want * scale).backward();
    torch::Tensor xs = h0.to(dtype).clone().requires_grad_(true), ws = w0.to(dtype).clone().requires_grad_(true);
    LinearCrossEntropyOptions o;
    o.chunk_tokens = 64;
    o.gradient_in_forward = in_forward;
    torch::Tensor loss = linear_cross_entropy(xs, ws, targets, o);
    (loss * scale).backward();
    const double tol = dtype == torch::kFloat32 ? 1e-5 : dtype == torch::kFloat16 ? 5e-3 : 2e-2;
    CHECK(std::fabs(loss.item<double>() - want.item<double>()) <= tol * std::max(1.0, std::fabs(want.item<double>())));
    auto close = [&](const torch::Tensor& a, const torch::Tensor& b) {  // within tol of the largest entry
      return (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>() <= tol * b.to(torch::kFloat32).abs().max().item<double>();
    };
    CHECK(close(xs.grad(), x.grad()));
    CHECK(close(ws.grad(), w.grad()));
  }
}
