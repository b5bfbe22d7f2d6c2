#include "engine/data/augment.hpp"

#include "engine/common/error.hpp"

#include <xxhash.h>

#include <string>

namespace dsrun {

torch::Tensor crop_flip(const torch::Tensor& images, const torch::Tensor& pad_value, const torch::Tensor& sample_ids,
                        uint64_t seed, const CropFlipOptions& options) {
  DSRUN_ASSERT(images.dim() == 4, "images are [n, c, h, w]");
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3), p = options.padding;
  DSRUN_ASSERT(p >= 0, "padding " + std::to_string(p));
  DSRUN_ASSERT(pad_value.numel() == c, "one pad value per channel");
  DSRUN_ASSERT(sample_ids.numel() == n, "one sample id per image");

  // The draws come from the CPU, so they are the same bits on every device and every rank.
  const torch::Tensor ids = sample_ids.to(torch::kCPU, torch::kLong).contiguous().view({n});
  const int64_t* id = ids.data_ptr<int64_t>();
  torch::Tensor draws = torch::empty({3, n}, torch::kLong);  // dy, dx, flip
  auto d = draws.accessor<int64_t, 2>();
  const uint64_t choices = static_cast<uint64_t>(2 * p + 1);
  for (int64_t i = 0; i < n; ++i) {
    // The tag keeps these bits apart from other hashes of (seed, sample id) in the project.
    const uint64_t key[3] = {0x63726f70666c6970ULL /* "cropflip" */, seed, static_cast<uint64_t>(id[i])};
    const uint64_t bits = XXH3_64bits(key, sizeof key);
    // Disjoint bit fields, so dy, dx and the flip are independent; the modulo bias is below 1e-5.
    d[0][i] = static_cast<int64_t>((bits & 0xffffffULL) % choices);
    d[1][i] = static_cast<int64_t>(((bits >> 24) & 0xffffffULL) % choices);
    d[2][i] = options.flip ? static_cast<int64_t>(bits >> 63) : 0;
  }
  draws = draws.to(images.device());  // one small copy; all the rest runs where the images are
  const torch::Tensor dy = draws[0].view({n, 1}), dx = draws[1].view({n, 1});
  const torch::Tensor flip = draws[2].view({n, 1}).to(torch::kBool);

  // Padding per channel (pad_value is not one constant), then every output pixel is one gather from it.
  const int64_t hp = h + 2 * p, wp = w + 2 * p;
  torch::Tensor padded =
      pad_value.to(images.device(), images.scalar_type()).reshape({1, c, 1, 1}).expand({n, c, hp, wp}).contiguous();
  padded.narrow(2, p, h).narrow(3, p, w).copy_(images);

  const auto index_options = torch::TensorOptions().dtype(torch::kLong).device(images.device());
  const torch::Tensor rows = dy + torch::arange(h, index_options).view({1, h});  // [n, h]
  const torch::Tensor across = torch::arange(w, index_options).view({1, w});
  const torch::Tensor cols = dx + torch::where(flip, (w - 1) - across, across);  // [n, w]
  const torch::Tensor flat = (rows.view({n, h, 1}) * wp + cols.view({n, 1, w})).view({n, 1, h * w});
  return padded.view({n, c, hp * wp}).gather(2, flat.expand({n, c, h * w})).view({n, c, h, w});
}

}  // namespace dsrun
