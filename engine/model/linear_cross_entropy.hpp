// The output projection and the token cross-entropy as one function, over chunks of the tokens, so
// that the whole [tokens, vocabulary] logits and their gradient never exist at once; vocabulary-
// parallel over a tensor-parallel group as Megatron-LM's cross-entropy is.
#pragma once

#include <torch/torch.h>

namespace dsrun {

// The ranks the vocabulary is split over, as the loss needs them. Tensor parallelism adapts its
// communicator to this (parallel/tensor_parallel.hpp): the model layer runs no collectives itself.
class VocabularyGroup {
 public:
  virtual ~VocabularyGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_gather(const torch::Tensor& shard, torch::Tensor& full) = 0;  // rank order
  virtual void all_reduce_sum(torch::Tensor& t) = 0;
};

struct LinearCrossEntropyOptions {
  int64_t chunk_tokens = 4096;     // tokens whose logits exist at once (fp32, [chunk, V/t])
  VocabularyGroup* group = nullptr;  // the ranks the vocabulary is split over (weight rows rank·V/t ..); null: one rank
  // Compute the gradients during forward, in the same pass as the loss (the loss is the last node
  // of the graph: backward only scales them), where that is exact: one rank, and a dtype whose
  // gradient cannot underflow before the loss scale multiplies it (not fp16). Otherwise backward
  // recomputes each chunk's logits. False forces the recomputing path (tests).
  bool gradient_in_forward = true;
};

// The mean over tokens of -log softmax(hidden · weightᵀ)[target]. hidden [N, H] and weight [V/t, H]
// in the compute dtype (products in fp32 where the GPU's kernels allow), targets [N] int64 over the
// whole vocabulary. Returns an fp32 scalar with autograd into hidden and weight.
torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                                   const LinearCrossEntropyOptions& options);

}  // namespace dsrun
