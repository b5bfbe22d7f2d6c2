// The steady step's forward and backward as one CUDA graph (execution.cuda_graphs): captured once
// on the step's own stream, then replayed with each step's batch copied into the inputs it was captured on.
#pragma once

#include "engine/model/model.hpp"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

namespace dsrun {

class StepGraph {
 public:
  // One micro-batch's forward and backward from `batch`; returns the loss value to read after it
  // (an fp32 scalar on the device). It must leave the parameters' gradients in their .grad.
  using Pass = std::function<torch::Tensor(const Batch&)>;

  explicit StepGraph(std::vector<torch::Tensor> params);
  ~StepGraph();

  bool captured() const { return captured_; }

  // Records pass(batch) into the graph and replays it once (a capture runs nothing). The
  // parameters' gradients must be undefined, so that backward makes them in the graph's memory.
  // Throws Error with the reason when the capture fails (an operation a graph cannot hold); the
  // parameters' gradients are then undefined again.
  torch::Tensor capture(const Batch& batch, const Pass& pass);

  // batch's tensors copied into the captured inputs (same shapes), the graph replayed, and the
  // parameters' gradients set to the ones it writes (the step drops them after the update).
  torch::Tensor replay(const Batch& batch);

 private:
  struct Cuda;  // the graph, on CUDA builds
  std::unique_ptr<Cuda> cuda_;
  std::vector<torch::Tensor> params_, grads_;
  Batch inputs_;
  torch::Tensor loss_;
  bool captured_ = false;
};

}  // namespace dsrun
