#include "engine/train/loss.hpp"

namespace dsrun {

MicroBatchLoss micro_batch_loss(const ModelOutput& out, const Batch& batch, TensorParallel& tensor, bool read_now) {
  MicroBatchLoss l;
  const bool classification = batch.targets.dim() == 1;
  torch::Tensor task = out.loss;  // the model's fused projection and loss, or from the logits here
  if (!task.defined()) {
    const torch::Tensor logits = out.logits.to(torch::kFloat32);
    task = tensor.cross_entropy(logits.reshape({-1, logits.size(-1)}), batch.targets.reshape({-1}));
  }
  l.loss = task;
  l.task_value = task.detach();
  if (out.aux_loss.defined()) {
    l.loss = task + out.aux_loss;
    l.aux_value = out.aux_loss.detach();
  }
  if (out.mtp_loss.defined()) l.mtp_value = out.mtp_loss;
  if (read_now) {
    l.task_loss = l.task_value.item<double>();
    if (l.aux_value.defined()) l.aux_loss = l.aux_value.item<double>();
    if (l.mtp_value.defined()) l.mtp_loss = l.mtp_value.item<double>();
  }
  if (classification) l.correct = out.logits.argmax(-1).eq(batch.targets).sum().item<int64_t>();
  return l;
}

}  // namespace dsrun
