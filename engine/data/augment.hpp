// Standard CIFAR training augmentation (zero-padded random crop, random horizontal flip), done on the
// batch's own device in one gather, with each sample's draw fixed by (seed, global sample id) alone.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace dsrun {

struct CropFlipOptions {
  int64_t padding = 4;  // zero padding on each side before the crop
  bool flip = true;     // random horizontal flip, probability 1/2
};

// images: [n, c, h, w], already normalised per channel, on any device. `pad_value` [c]: what a black
// (zero) pixel becomes after normalisation, -mean/std per channel, so the padding is black as in
// torchvision's RandomCrop(32, padding=4) applied before Normalize. `sample_ids` [n] int64 (read on the
// CPU): each sample's global index in the training stream, which makes the draw independent of how a
// global batch is split among ranks. Returns a new tensor of the same shape, device and dtype.
torch::Tensor crop_flip(const torch::Tensor& images, const torch::Tensor& pad_value, const torch::Tensor& sample_ids,
                        uint64_t seed, const CropFlipOptions& options = {});

}  // namespace dsrun
