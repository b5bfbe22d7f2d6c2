// FP8 linear layers (precision.fp8) on GPU machines: the quantisation kernels against their
// reference expressions, the scales, and the three scaled products against a bf16 linear's.
#include "engine/common/torch_compat.hpp"
#include "engine/common/error.hpp"
#include "engine/model/fp8_linear.hpp"
#include "engine/model/grouped_experts.hpp"

#include <catch2/catch.hpp>

using namespace dsrun;

namespace {

bool fp8_runs_here() {
  if (compat::kHasScaledMm && torch::cuda::is_available()) return true;
  WARN("SKIPPED: no CUDA device visible, or a libtorch without scaled FP8 products (this test runs on GPU machines: scripts/gpu_build.sh)");
  return false;
}

bool contains_text(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got.to(torch::kFloat64) - want.to(torch::kFloat64)).norm() / want.to(torch::kFloat64).norm()).item<double>();
}

}  // namespace

TEST_CASE("CUDA: the FP8 quantisation kernels equal their reference expressions, scales and transposes included", "[engine][cuda][fp8]") {
  if (!fp8_runs_here()) return;
  torch::manual_seed(5);
  // Tiles of 64: one shape inside a tile, one across uneven tile edges, one of a layer's size.
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{16, 32}, {80, 48}, {1024, 2048}})
    for (Fp8Scaling scaling : {Fp8Scaling::Tensorwise, Fp8Scaling::Rowwise})
      for (bool e5m2 : {false, true}) {
        INFO(rows << " x " << cols << ", " << to_string(scaling) << (e5m2 ? ", E5M2" : ", E4M3"));
        const torch::Tensor x = (torch::randn({rows, cols}, torch::kCUDA) * torch::rand({rows, 1}, torch::kCUDA) * 30).to(torch::kBFloat16);
        const Fp8Operand k = quantize_fp8(x, scaling, e5m2, true, true);
        const Fp8Operand r = quantize_fp8(x, scaling, e5m2, true, true, /*reference=*/true);
        CHECK(torch::equal(k.q.view(torch::kUInt8), r.q.view(torch::kUInt8)));
        CHECK(torch::equal(k.qt.view(torch::kUInt8), r.qt.view(torch::kUInt8)));
        CHECK(torch::allclose(k.inv_q, r.inv_q, 1e-6, 0));
        CHECK(torch::allclose(k.inv_t, r.inv_t, 1e-6, 0));
        // The scales themselves: the largest magnitude of each row (or of all) maps to the format's largest value.
        const double top = e5m2 ? 57344.0 : 448.0;
        const torch::Tensor xf = x.to(torch::kFloat32).abs();
        const torch::Tensor amax = scaling == Fp8Scaling::Rowwise ? xf.amax(1, true) : xf.amax();
        CHECK(torch::allclose(k.inv_q, amax / top, 1e-6, 0));
        CHECK(k.q.to(torch::kFloat32).abs().max().item<double>() == top);
        // Dequantised, q is x within the format's rounding (3 mantissa bits: 1/16; 2: 1/8).
        const torch::Tensor back = k.q.to(torch::kFloat32) * k.inv_q;
        CHECK(relative_error(back, x) < (e5m2 ? 0.08 : 0.04));
        const torch::Tensor back_t = k.qt.to(torch::kFloat32) * k.inv_t;
        CHECK(relative_error(back_t, x.t()) < (e5m2 ? 0.08 : 0.04));
      }
}

TEST_CASE("CUDA: the blockwise FP8 kernel equals its reference expressions: 1 x 128 blocks both ways, a weight's 128 x 128, scales' layouts", "[engine][cuda][fp8]") {
  if (!fp8_runs_here()) return;
  torch::manual_seed(8);
  // One tile, tiles of uneven shape, a layer's size; rows and blocks of very different magnitudes.
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{128, 128}, {256, 384}, {1024, 2048}}) {
    const torch::Tensor x = (torch::randn({rows, cols}, torch::kCUDA) * torch::rand({rows, 1}, torch::kCUDA) * torch::rand({1, cols}, torch::kCUDA) * 30)
                                .to(torch::kBFloat16);
    for (bool e5m2 : {false, true}) {
      INFO(rows << " x " << cols << (e5m2 ? ", E5M2" : ", E4M3"));
      const Fp8Operand k = quantize_fp8(x, Fp8Scaling::Blockwise, e5m2, true, true);
      const Fp8Operand r = quantize_fp8(x, Fp8Scaling::Blockwise, e5m2, true, true, /*reference=*/true);
      CHECK(torch::equal(k.q.view(torch::kUInt8), r.q.view(torch::kUInt8)));
      CHECK(torch::equal(k.qt.view(torch::kUInt8), r.qt.view(torch::kUInt8)));
      CHECK(k.inv_q.t().is_contiguous());  // column-major (strides of a size-1 dimension are free)
      CHECK(k.inv_t.t().is_contiguous());
      CHECK(torch::allclose(k.inv_q, r.inv_q, 1e-6, 0));
      CHECK(torch::allclose(k.inv_t, r.inv_t, 1e-6, 0));
    }
    INFO(rows << " x " << cols << ", 128 x 128");
    const Fp8Operand k = quantize_fp8_weight_blocks(x);
    const Fp8Operand r = quantize_fp8_weight_blocks(x, /*reference=*/true);
    CHECK(torch::equal(k.q.view(torch::kUInt8), r.q.view(torch::kUInt8)));
    CHECK(torch::equal(k.qt.view(torch::kUInt8), r.qt.view(torch::kUInt8)));
    CHECK(k.inv_q.is_contiguous());
    CHECK(k.inv_t.is_contiguous());
    CHECK(torch::allclose(k.inv_q, r.inv_q, 1e-6, 0));
    CHECK(torch::allclose(k.inv_t, r.inv_t, 1e-6, 0));
  }
}

TEST_CASE("CUDA: an FP8 linear layer's output and both gradients track the bf16 layer's within FP8's error", "[engine][cuda][fp8]") {
  if (!fp8_runs_here()) return;
  torch::manual_seed(6);
  const torch::Tensor x0 = torch::randn({4, 64, 512}, torch::kCUDA).to(torch::kBFloat16);
  const torch::Tensor w0 = (torch::randn({384, 512}, torch::kCUDA) * 0.02).to(torch::kBFloat16);
  const torch::Tensor g = torch::randn({4, 64, 384}, torch::kCUDA).to(torch::kBFloat16);
  // The reference in fp32 from the same bf16 inputs.
  torch::Tensor xr = x0.to(torch::kFloat32).requires_grad_(true), wr = w0.to(torch::kFloat32).requires_grad_(true);
  torch::Tensor yr = torch::linear(xr, wr);
  yr.backward(g.to(torch::kFloat32));
  for (Fp8Scaling scaling : {Fp8Scaling::Tensorwise, Fp8Scaling::Rowwise, Fp8Scaling::Blockwise}) {
    INFO(to_string(scaling));
    if (scaling == Fp8Scaling::Blockwise && !compat::kHasBlockwiseScaledMm) continue;
    torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    torch::Tensor y = fp8_linear(x, w, scaling);
    REQUIRE(y.sizes() == yr.sizes());
    CHECK(y.scalar_type() == torch::kBFloat16);
    y.backward(g);
    // E4M3 operands forward (about 3.7% in a product of two), E5M2 gradients backward (about 6%;
    // rowwise and blockwise E4M3, under finer scales).
    CHECK(relative_error(y, yr) < 0.06);
    CHECK(relative_error(x.grad(), xr.grad()) < 0.09);
    CHECK(relative_error(w.grad(), wr.grad()) < 0.09);
    // And not a bf16 product in disguise: FP8's error is there.
    CHECK(relative_error(y, yr) > 0.005);
  }
  // None is torch's linear, bit for bit.
  CHECK(torch::equal(fp8_linear(x0, w0, Fp8Scaling::None), torch::linear(x0, w0)));
}

TEST_CASE("CUDA: a MoE layer's expert weights quantised each expert on its own: the batched kernel equals its reference, row and column scales per expert", "[engine][cuda][fp8][moe]") {
  if (!fp8_runs_here()) return;
  torch::manual_seed(9);
  // Three experts of very different magnitudes; 40 rows cross a tile's edge.
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{40, 64}, {128, 96}}) {
    INFO(rows << " x " << cols);
    const torch::Tensor w = (torch::randn({3, rows, cols}, torch::kCUDA) * torch::tensor({1.0, 30.0, 0.01}, torch::kCUDA).view({3, 1, 1})).to(torch::kBFloat16);
    const Fp8Operand k = quantize_fp8_experts(w, true, true);
    const Fp8Operand r = quantize_fp8_experts(w, true, true, /*reference=*/true);
    REQUIRE(k.q.sizes() == torch::IntArrayRef({3, rows, cols}));
    REQUIRE(k.qt.sizes() == torch::IntArrayRef({3, cols, rows}));
    REQUIRE(k.inv_q.sizes() == torch::IntArrayRef({3, rows}));
    REQUIRE(k.inv_t.sizes() == torch::IntArrayRef({3, cols}));
    CHECK(torch::equal(k.q.view(torch::kUInt8), r.q.view(torch::kUInt8)));
    CHECK(torch::equal(k.qt.view(torch::kUInt8), r.qt.view(torch::kUInt8)));
    CHECK(torch::allclose(k.inv_q, r.inv_q, 1e-6, 0));
    CHECK(torch::allclose(k.inv_t, r.inv_t, 1e-6, 0));
    // Each expert's own maxima: its rows' and its columns', not the stack's.
    const torch::Tensor wf = w.to(torch::kFloat32).abs();
    CHECK(torch::allclose(k.inv_q, wf.amax(2) / 448.0, 1e-6, 0));
    CHECK(torch::allclose(k.inv_t, wf.amax(1) / 448.0, 1e-6, 0));
    for (int64_t e = 0; e < 3; ++e) {
      CHECK(relative_error(k.q[e].to(torch::kFloat32) * k.inv_q[e].unsqueeze(1), w[e]) < 0.04);
      CHECK(relative_error(k.qt[e].to(torch::kFloat32) * k.inv_t[e].unsqueeze(1), w[e].t()) < 0.04);
    }
  }
}

TEST_CASE("CUDA: rowwise FP8 without a transpose in one pass (a warp a row) equals the reference, across its register sizes and past them", "[engine][cuda][fp8][moe]") {
  if (!fp8_runs_here()) return;
  torch::manual_seed(11);
  // 4, 8 and 16 words a lane (48, 1408, 2816 columns: the experts' widths), and 8192 (two passes).
  for (int64_t cols : {48, 1408, 2816, 8192}) {
    INFO(cols << " columns");
    // 37 rows end a block of 8 warps part-way; past the registers the two-pass kernels need rows in eights.
    const int64_t rows = cols > 4096 ? 40 : 37;
    const torch::Tensor x = (torch::randn({rows, cols}, torch::kCUDA) * torch::rand({rows, 1}, torch::kCUDA) * 30).to(torch::kBFloat16);
    const Fp8Operand k = quantize_fp8(x, Fp8Scaling::Rowwise, false, true, false);
    const Fp8Operand r = quantize_fp8(x, Fp8Scaling::Rowwise, false, true, false, /*reference=*/true);
    CHECK_FALSE(k.qt.defined());
    REQUIRE(k.inv_q.sizes() == torch::IntArrayRef({rows, 1}));
    CHECK(torch::equal(k.q.view(torch::kUInt8), r.q.view(torch::kUInt8)));
    CHECK(torch::allclose(k.inv_q, r.inv_q, 1e-6, 0));
    CHECK(torch::allclose(k.inv_q, x.to(torch::kFloat32).abs().amax(1, true) / 448.0, 1e-6, 0));
  }
}

TEST_CASE("CUDA: FP8 routed experts (grouped scaled products) track the bf16 grouped experts' output and gradients within FP8's error", "[engine][cuda][fp8][moe]") {
  if (!fp8_runs_here() || !compat::kHasScaledGroupedMm) return;
  torch::manual_seed(10);
  const int64_t experts = 4, hidden = 256, inner = 128;
  // Uneven groups, one expert with no rows.
  const torch::Tensor counts = torch::tensor({40, 0, 88, 64}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA));
  const int64_t rows = 192;
  const torch::Tensor x0 = torch::randn({rows, hidden}, torch::kCUDA).to(torch::kBFloat16);
  const torch::Tensor g = torch::randn({rows, hidden}, torch::kCUDA).to(torch::kBFloat16);
  // The weights one after another in one buffer, as ZeRO lays them out (stacking copies nothing).
  const torch::Tensor gate_up_all = (torch::randn({experts, 2 * inner, hidden}, torch::kCUDA) * 0.05).to(torch::kBFloat16);
  const torch::Tensor down_all = (torch::randn({experts, hidden, inner}, torch::kCUDA) * 0.05).to(torch::kBFloat16);
  auto leaves = [](const torch::Tensor& all) {
    std::vector<torch::Tensor> out;
    for (int64_t e = 0; e < all.size(0); ++e) out.push_back(all[e].detach().clone().requires_grad_(true));
    return out;
  };
  // The reference: the looped experts in fp32 from the same bf16 values.
  auto to_f32 = [](std::vector<torch::Tensor> v) {
    for (auto& t : v) t = t.detach().to(torch::kFloat32).requires_grad_(true);
    return v;
  };
  std::vector<torch::Tensor> gu_r = to_f32(leaves(gate_up_all)), dn_r = to_f32(leaves(down_all));
  torch::Tensor xr = x0.to(torch::kFloat32).requires_grad_(true);
  torch::Tensor yr = looped_swiglu_experts(xr, counts, gu_r, dn_r);
  yr.backward(g.to(torch::kFloat32));

  std::vector<torch::Tensor> gu = leaves(gate_up_all), dn = leaves(down_all);
  torch::Tensor x = x0.clone().requires_grad_(true);
  torch::Tensor y = grouped_swiglu_experts(x, counts, gu, dn, /*fp8=*/true);
  REQUIRE(y.sizes() == yr.sizes());
  CHECK(y.scalar_type() == torch::kBFloat16);
  y.backward(g);
  // Two FP8 products in a row each way (E4M3, row scales): a few percent, as the linear layer's.
  CHECK(relative_error(y, yr) < 0.08);
  CHECK(relative_error(x.grad(), xr.grad()) < 0.12);
  for (int64_t e : {0, 2, 3}) {
    INFO("expert " << e);
    CHECK(relative_error(gu[e].grad(), gu_r[e].grad()) < 0.12);
    CHECK(relative_error(dn[e].grad(), dn_r[e].grad()) < 0.12);
  }
  // The expert without rows: gradients of zero.
  CHECK(gu[1].grad().abs().max().item<double>() == 0);
  CHECK(dn[1].grad().abs().max().item<double>() == 0);
  // FP8's error is there: not the bf16 path.
  CHECK(relative_error(y, yr) > 0.005);
}

TEST_CASE("CUDA: blockwise FP8 operands: each 1 x 128 and 128 x 128 block scaled from its own maximum, scales laid out as torch's product reads them", "[engine][cuda][fp8]") {
  if (!fp8_runs_here()) return;
  torch::manual_seed(7);
  const double top = 448.0;
  // Rows of very different magnitudes, and within a row blocks that differ too.
  const torch::Tensor x = (torch::randn({256, 384}, torch::kCUDA) * torch::rand({256, 1}, torch::kCUDA) * torch::rand({1, 384}, torch::kCUDA) * 30).to(torch::kBFloat16);
  const torch::Tensor xf = x.to(torch::kFloat32);
  const Fp8Operand a = quantize_fp8(x, Fp8Scaling::Blockwise, false, true, true);
  // 1 x 128: [rows, cols / 128], column-major (strides 1, rows); qt's the same for the transpose.
  REQUIRE(a.inv_q.sizes() == torch::IntArrayRef({256, 3}));
  CHECK(a.inv_q.strides() == torch::IntArrayRef({1, 256}));
  REQUIRE(a.inv_t.sizes() == torch::IntArrayRef({384, 2}));
  CHECK(a.inv_t.strides() == torch::IntArrayRef({1, 384}));
  CHECK(torch::allclose(a.inv_q, xf.view({256, 3, 128}).abs().amax(2) / top, 1e-6, 0));
  CHECK(torch::allclose(a.inv_t, xf.t().contiguous().view({384, 2, 128}).abs().amax(2) / top, 1e-6, 0));
  // Each block's largest magnitude maps to the format's largest value; dequantised, q is x within E4M3's rounding.
  CHECK(torch::equal(a.q.to(torch::kFloat32).abs().view({256, 3, 128}).amax(2), torch::full({256, 3}, top, torch::kCUDA)));
  const torch::Tensor back = (a.q.to(torch::kFloat32).view({256, 3, 128}) * a.inv_q.unsqueeze(2)).view({256, 384});
  CHECK(relative_error(back, x) < 0.04);
  // 128 x 128 of a weight: [rows / 128, cols / 128] row-major, the transpose's the transposed blocks.
  const Fp8Operand w = quantize_fp8_weight_blocks(x);
  REQUIRE(w.inv_q.sizes() == torch::IntArrayRef({2, 3}));
  CHECK(w.inv_q.is_contiguous());
  CHECK(torch::allclose(w.inv_q, xf.view({2, 128, 3, 128}).abs().amax(c10::IntArrayRef{1, 3}) / top, 1e-6, 0));
  CHECK(torch::equal(w.inv_t, w.inv_q.t()));
  CHECK(torch::equal(w.qt.view(torch::kUInt8), w.q.t().contiguous().view(torch::kUInt8)));
}

TEST_CASE("CUDA: blockwise FP8 with the weight in 128 x 128 blocks (its sizes / 128 multiples of 4) tracks the bf16 layer too", "[engine][cuda][fp8]") {
  if (!fp8_runs_here() || !compat::kHasBlockwiseScaledMm) return;
  torch::manual_seed(8);
  // [1024, 512]: 8 x 4 blocks, whose scales cuBLASLt reads unpadded both ways (the [384, 512] above
  // took the 1 x 128 path: 3 blocks a row of the transpose's scales).
  const torch::Tensor x0 = torch::randn({2, 128, 512}, torch::kCUDA).to(torch::kBFloat16);
  const torch::Tensor w0 = (torch::randn({1024, 512}, torch::kCUDA) * 0.02).to(torch::kBFloat16);
  const torch::Tensor g = torch::randn({2, 128, 1024}, torch::kCUDA).to(torch::kBFloat16);
  torch::Tensor xr = x0.to(torch::kFloat32).requires_grad_(true), wr = w0.to(torch::kFloat32).requires_grad_(true);
  torch::linear(xr, wr).backward(g.to(torch::kFloat32));
  torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  torch::Tensor y = fp8_linear(x, w, Fp8Scaling::Blockwise);
  y.backward(g);
  CHECK(relative_error(y, torch::linear(x0.to(torch::kFloat32), w0.to(torch::kFloat32))) < 0.06);
  CHECK(relative_error(x.grad(), xr.grad()) < 0.09);
  CHECK(relative_error(w.grad(), wr.grad()) < 0.09);
}

TEST_CASE("blockwise FP8 refuses a layer not in whole blocks of 128, naming precision.fp8 (no padding)", "[engine][fp8]") {
  // Runs on every build: the sizes are checked before any FP8 product.
  const torch::Tensor w = torch::zeros({256, 128}, torch::kBFloat16);
  for (int64_t tokens : {64, 200}) {
    INFO(tokens << " rows");
    try {
      fp8_linear(torch::zeros({tokens, 128}, torch::kBFloat16), w, Fp8Scaling::Blockwise);
      FAIL("not refused");
    } catch (const Error& e) {
      CHECK(e.context().key == "precision.fp8");
      CHECK(contains_text(e.what(), "not all multiples of 128"));
      CHECK(contains_text(e.context().hint, "precision.fp8 = \"rowwise\""));
    }
  }
  // Whole blocks pass the sizes; a torch without block scales says so instead of failing inside it.
  if (!compat::kHasBlockwiseScaledMm) {
    try {
      fp8_linear(torch::zeros({128, 128}, torch::kBFloat16), w, Fp8Scaling::Blockwise);
      FAIL("not refused");
    } catch (const Error& e) {
      CHECK(e.context().key == "precision.fp8");
      CHECK(contains_text(e.what(), "PyTorch 2.9"));
    }
  }
}
