// The training objective, owned by the trainer rather than the model: token cross-entropy for
// decoders (plus the MoE balance loss), classification cross-entropy and accuracy for images.
#pragma once

#include "engine/model/model.hpp"
#include "engine/parallel/tensor_parallel.hpp"

#include <torch/torch.h>

namespace dsrun {

// Classification when the targets are one label per sample ([b]); next-token prediction otherwise,
// over this tensor-parallel rank's vocabulary slice of the logits (vocabulary-parallel
// cross-entropy; the whole vocabulary on one rank). Cross-entropy in fp32 whatever the logits' dtype.
MicroBatchLoss micro_batch_loss(const ModelOutput& out, const Batch& batch, TensorParallel& tensor, bool read_now = true);

}  // namespace dsrun
