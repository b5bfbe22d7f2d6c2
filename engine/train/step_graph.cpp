#include "engine/train/step_graph.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"

#ifdef DSRUN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace dsrun {

#ifdef DSRUN_WITH_CUDA
struct StepGraph::Cuda {
  at::cuda::CUDAGraph graph;
};
#else
struct StepGraph::Cuda {};
#endif

StepGraph::StepGraph(std::vector<torch::Tensor> params) : params_(std::move(params)) {}
StepGraph::~StepGraph() = default;

namespace {

void copy_batch(Batch& into, const Batch& from) {
  DSRUN_ASSERT(into.inputs.sizes() == from.inputs.sizes() && into.targets.sizes() == from.targets.sizes(),
               "a CUDA graph replays the shapes it was captured with (execution.cuda_graphs needs a fixed batch)");
  into.inputs.copy_(from.inputs, /*non_blocking=*/true);
  into.targets.copy_(from.targets, /*non_blocking=*/true);
  into.items = from.items;
}

// An error's first line: c10's errors go on with a backtrace the run's events do not need.
std::string first_line(const std::exception& e) {
  const std::string text = e.what();
  return text.substr(0, text.find('\n'));
}

}  // namespace

torch::Tensor StepGraph::capture(const Batch& batch, const Pass& pass) {
#ifdef DSRUN_WITH_CUDA
  DSRUN_ASSERT(!captured_, "the step is captured once");
  for (const auto& p : params_) DSRUN_ASSERT(!p.grad().defined(), "a capture starts with no gradients: backward makes them in the graph's memory");
  // The inputs the graph reads: this batch's own tensors, copied into before each replay.
  inputs_ = batch;
  inputs_.inputs = batch.inputs.clone();
  inputs_.targets = batch.targets.clone();
  // Captured on the stream the step runs on, which must not be the legacy default stream (the
  // trainer gives its steps their own: the gradient accumulators keep the stream they were made on).
  if (at::cuda::getCurrentCUDAStream() == at::cuda::getDefaultCUDAStream())
    throw Error("the step could not be captured as a CUDA graph: it runs on the default stream");
  cuda_ = std::make_unique<Cuda>();
  // Blocks the eager steps cached go back to the device first: the graph's activations come from
  // its own pool, and both at once would hold them twice.
  c10::cuda::CUDACachingAllocator::emptyCache();
  const c10::DeviceIndex device = c10::cuda::current_device();
  const at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();
  bool ended = false;  // the capture ended cleanly: the graph releases its pool itself
  try {
    cuda_->graph.capture_begin(pool);
    try {
      loss_ = pass(inputs_);
    } catch (const std::exception& e) {
      // The capture is invalid; ending it frees the stream (its own error, if any, is the same cause).
      std::string why = first_line(e);
      try {
        cuda_->graph.capture_end();
      } catch (const std::exception& end) {
        why += " (ending the capture: " + first_line(end) + ")";
      }
      throw Error(why);
    }
    cuda_->graph.capture_end();
    ended = true;
    for (const auto& p : params_) {
      if (!p.grad().defined()) throw Error("a parameter got no gradient in the captured backward");
      grads_.push_back(p.grad());
    }
    captured_ = true;
    return replay(batch);  // (a capture runs nothing: this step's values come from the first replay)
  } catch (const std::exception& e) {
    // The gradients are the graph's outputs, never written unless a replay ran: none is kept.
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
    grads_.clear();
    loss_ = torch::Tensor();
    captured_ = false;
    // A capture that did not end cleanly leaves its pool routed to by the allocators (PyTorch's
    // capture_end throws before it ends that): ended here, then released, so the eager steps after
    // it allocate, free and retry on out-of-memory as before.
    if (!ended) {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
      c10::cuda::CUDACachingAllocator::releasePool(device, pool);
#if DSRUN_TORCH_AT_LEAST(2, 11)
      at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
      at::getHostAllocator(at::kCUDA)->release_pool(pool);
#endif
    }
    cuda_.reset();
    c10::cuda::CUDACachingAllocator::emptyCache();
    throw Error("the step could not be captured as a CUDA graph: " + first_line(e));
  }
#else
  (void)batch, (void)pass;
  throw Error("CUDA graphs need a CUDA build (execution.cuda_graphs)");
#endif
}

torch::Tensor StepGraph::replay(const Batch& batch) {
#ifdef DSRUN_WITH_CUDA
  DSRUN_ASSERT(captured_, "replay after capture");
  copy_batch(inputs_, batch);
  cuda_->graph.replay();
  for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = grads_[i];
  return loss_;
#else
  (void)batch;
  throw Error("CUDA graphs need a CUDA build (execution.cuda_graphs)");
#endif
}

}  // namespace dsrun
