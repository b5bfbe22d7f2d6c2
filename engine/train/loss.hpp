// The training objective, owned by the trainer rather than the model: token cross-entropy for
// decoders (plus the MoE balance loss), classification cross-entropy and accuracy for images.
#pragma once

#include "engine/model/model.hpp"
#include "engine/parallel/tensor_parallel.hpp"

#include <torch/torch.h>

namespace dsrun {

struct MicroBatchLoss {
  torch::Tensor loss;     // what backward starts from: the mean over the batch, aux loss included
  double task_loss = 0;   // cross-entropy alone, for reporting
  double aux_loss = 0;    // MoE load balance (0 for dense models)
  // Unread (micro_batch_loss's read_now false): the two as fp32 scalars where they were computed
  // (aux undefined for dense models), for the caller to read once per step: reading them between
  // forward and backward would stop the host until the device caught up.
  torch::Tensor task_value, aux_value;
  int64_t correct = -1;   // images: correct predictions; -1 where it does not apply
};

// Classification when the targets are one label per sample ([b]); next-token prediction otherwise,
// over this tensor-parallel rank's vocabulary slice of the logits (vocabulary-parallel
// cross-entropy; the whole vocabulary on one rank). Cross-entropy in fp32 whatever the logits' dtype.
MicroBatchLoss micro_batch_loss(const ModelOutput& out, const Batch& batch, TensorParallel& tensor, bool read_now = true);

}  // namespace dsrun
