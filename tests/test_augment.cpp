// crop_flip: determinism per (seed, sample id), exact windows of the padded image, the spread of
// offsets and flips, per-channel pad values, and CPU/CUDA agreement.
#include "engine/data/augment.hpp"

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <vector>

using dsrun::crop_flip;
using dsrun::CropFlipOptions;

namespace {

torch::Tensor ids_from(int64_t first, int64_t n) { return torch::arange(first, first + n, torch::kLong); }

// For each sample, the (dy, dx) whose window of `padded` (flipped or not) equals its output, as
// dy * (2p + 1) + dx; -1 where none does, -2 where several do.
std::vector<int> window_offsets(const torch::Tensor& out, const torch::Tensor& padded, int64_t p, bool flipped) {
  const int64_t n = out.size(0), h = out.size(2), w = out.size(3), m = 2 * p + 1;
  std::vector<int> found(static_cast<size_t>(n), -1);
  for (int64_t dy = 0; dy < m; ++dy)
    for (int64_t dx = 0; dx < m; ++dx) {
      torch::Tensor window = padded.narrow(2, dy, h).narrow(3, dx, w);
      if (flipped) window = window.flip({3});
      const torch::Tensor match = out.eq(window).flatten(1).all(1);
      auto a = match.accessor<bool, 1>();
      for (int64_t i = 0; i < n; ++i)
        if (a[i]) {
          int& f = found[static_cast<size_t>(i)];
          f = f == -1 ? static_cast<int>(dy * m + dx) : -2;
        }
    }
  return found;
}

torch::Tensor pad_with(const torch::Tensor& images, const torch::Tensor& pad_value, int64_t p) {
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  torch::Tensor padded = pad_value.view({1, c, 1, 1}).expand({n, c, h + 2 * p, w + 2 * p}).clone();
  padded.narrow(2, p, h).narrow(3, p, w).copy_(images);
  return padded;
}

}  // namespace

TEST_CASE("crop_flip is fixed by the seed and the sample ids", "[augment]") {
  torch::manual_seed(1);
  const torch::Tensor images = torch::randn({64, 3, 32, 32});
  const torch::Tensor pad = torch::tensor({-1.9f, -1.98f, -1.71f});
  const torch::Tensor ids = ids_from(1000, 64);
  const torch::Tensor a = crop_flip(images, pad, ids, 7), b = crop_flip(images, pad, ids, 7);
  REQUIRE(a.sizes() == images.sizes());
  REQUIRE(a.scalar_type() == images.scalar_type());
  CHECK(torch::equal(a, b));
  CHECK_FALSE(torch::equal(a, images));
  CHECK_FALSE(torch::equal(a, crop_flip(images, pad, ids, 8)));
  CHECK_FALSE(torch::equal(a, crop_flip(images, pad, ids_from(2000, 64), 7)));
}

TEST_CASE("crop_flip of a sample does not depend on its batch", "[augment]") {
  torch::manual_seed(2);
  const torch::Tensor images = torch::randn({8, 3, 32, 32});
  const torch::Tensor pad = torch::tensor({0.5f, -0.5f, 1.0f});
  const torch::Tensor ids = torch::tensor({5, 17, 3, 100, 42, 7, 99, 1000}, torch::kLong);
  const torch::Tensor whole = crop_flip(images, pad, ids, 3);
  const torch::Tensor first = crop_flip(images.narrow(0, 0, 3), pad, ids.narrow(0, 0, 3), 3);
  const torch::Tensor rest = crop_flip(images.narrow(0, 3, 5), pad, ids.narrow(0, 3, 5), 3);
  CHECK(torch::equal(whole, torch::cat({first, rest})));
  // Reordered batch, reordered rows.
  const torch::Tensor order = torch::tensor({7, 0, 5, 2, 6, 1, 4, 3}, torch::kLong);
  const torch::Tensor reordered = crop_flip(images.index_select(0, order), pad, ids.index_select(0, order), 3);
  CHECK(torch::equal(whole.index_select(0, order), reordered));
}

TEST_CASE("crop_flip crops exact windows and reaches every offset", "[augment]") {
  torch::manual_seed(3);
  const int64_t n = 500, p = 4;
  const torch::Tensor images = torch::randn({n, 1, 32, 32});
  const torch::Tensor pad = torch::tensor({-1.5f});
  const torch::Tensor padded = pad_with(images, pad, p);

  const torch::Tensor out = crop_flip(images, pad, ids_from(0, n), 11, {p, false});
  const std::vector<int> offsets = window_offsets(out, padded, p, false);
  std::set<int> seen;
  for (int o : offsets) {
    REQUIRE(o >= 0);  // exactly one window matches
    seen.insert(o);
  }
  CHECK(seen.size() >= 75);

  // With flips on, the same draws of offsets hold, and each output is that window, mirrored or not.
  const torch::Tensor flipped_out = crop_flip(images, pad, ids_from(0, n), 11, {p, true});
  const std::vector<int> plain = window_offsets(flipped_out, padded, p, false);
  const std::vector<int> mirrored = window_offsets(flipped_out, padded, p, true);
  int flips = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    REQUIRE((plain[k] >= 0) != (mirrored[k] >= 0));
    CHECK(std::max(plain[k], mirrored[k]) == offsets[k]);
    flips += mirrored[k] >= 0;
  }
  CHECK(flips > 0);
  CHECK(flips < n);
}

TEST_CASE("crop_flip flips half of the samples", "[augment]") {
  const int64_t n = 1000, w = 32;
  // A horizontal gradient: a flipped image starts with w - 1.
  const torch::Tensor images = torch::arange(w, torch::kFloat).view({1, 1, 1, w}).expand({n, 1, 8, w}).contiguous();
  const torch::Tensor out = crop_flip(images, torch::zeros({1}), ids_from(123456, n), 5, {0, true});
  const torch::Tensor flipped = out.select(3, 0).select(2, 0).select(1, 0).eq(w - 1);
  const torch::Tensor mirrored = images.flip({3});
  for (int64_t i = 0; i < n; ++i) {
    REQUIRE(torch::equal(out[i], flipped[i].item<bool>() ? mirrored[i] : images[i]));
  }
  const double fraction = flipped.to(torch::kDouble).mean().item<double>();
  CHECK(fraction > 0.4);
  CHECK(fraction < 0.6);
  // No flips when asked for none.
  CHECK(torch::equal(crop_flip(images, torch::zeros({1}), ids_from(123456, n), 5, {0, false}), images));
}

TEST_CASE("crop_flip pads each channel with its own value", "[augment]") {
  torch::manual_seed(4);
  const int64_t n = 64, p = 4, h = 32, w = 32;
  const torch::Tensor pad = torch::tensor({0.5f, 1.5f, -2.5f});
  const torch::Tensor ids = ids_from(77, n);
  // The offsets each sample gets, read off a random image (they depend on seed and id only).
  const torch::Tensor probe = torch::randn({n, 3, h, w});
  const torch::Tensor probed = crop_flip(probe, pad, ids, 9, {p, false});
  const std::vector<int> offsets = window_offsets(probed, pad_with(probe, pad, p), p, false);

  const torch::Tensor out = crop_flip(torch::full({n, 3, h, w}, 5.0f), pad, ids, 9, {p, false});
  int padded_samples = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int o = offsets[static_cast<size_t>(i)];
    REQUIRE(o >= 0);
    const int64_t dy = o / (2 * p + 1), dx = o % (2 * p + 1);
    const int64_t expected = h * w - (h - std::abs(dy - p)) * (w - std::abs(dx - p));
    for (int64_t k = 0; k < 3; ++k) {
      const torch::Tensor plane = out[i][k];
      const float v = pad[k].item<float>();
      const int64_t pads = plane.eq(v).sum().item<int64_t>(), fives = plane.eq(5.0f).sum().item<int64_t>();
      CHECK(pads == expected);
      CHECK(pads + fives == h * w);
    }
    padded_samples += expected > 0;
  }
  CHECK(padded_samples > 0);
}

TEST_CASE("crop_flip gives the same result on CUDA as on the CPU", "[augment]") {
  if (!torch::cuda::is_available()) return;
  torch::manual_seed(5);
  const torch::Tensor images = torch::randn({32, 3, 32, 32});
  const torch::Tensor pad = torch::tensor({-1.9f, -1.98f, -1.71f});
  const torch::Tensor ids = ids_from(4096, 32);
  const torch::Tensor on_gpu = crop_flip(images.to(torch::kCUDA), pad.to(torch::kCUDA), ids, 21);
  REQUIRE(on_gpu.is_cuda());
  CHECK(torch::equal(on_gpu.cpu(), crop_flip(images, pad, ids, 21)));
}
