// Tensor parallelism as Megatron-LM does it, over the mesh's tensor dimension: the two region
// boundaries (enter: identity forward, gradient summed; leave: sum forward), the vocabulary-
// parallel embedding lookup and cross-entropy, and cutting a full weight to this rank's slice.
#pragma once

#include "engine/common/tensor_region.hpp"
#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"

#include <torch/torch.h>

#include <vector>

namespace dsrun {

// A communicator as the fused loss sees the ranks the vocabulary is split over
// (model/linear_cross_entropy.hpp), which runs no collectives of its own.
class CommunicatorVocabulary final : public VocabularyGroup {
 public:
  explicit CommunicatorVocabulary(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.world_size(); }
  void all_gather(const torch::Tensor& shard, torch::Tensor& full) override { c_.all_gather(shard, full); }
  void all_reduce_sum(torch::Tensor& t) override { c_.all_reduce_sum(t); }

 private:
  Communicator& c_;
};

// With sequence parallelism (Korthikanti et al. 2022) the activations between regions, [b, s, h],
// are split along the sequence: rank r holds positions [r·s/t, (r+1)·s/t). Entering a region
// all-gathers them, leaving reduce-scatters, in place of the all-reduce (the same traffic), and
// the norms run on 1/t of the tokens; their weights' gradients are then partial sums.
class TensorParallel {
 public:
  explicit TensorParallel(Communicator& group, bool sequence_parallel = false)
      : group_(group), vocabulary_(group), sequence_(sequence_parallel && group.world_size() > 1) {}
  int size() const { return group_.world_size(); }
  int rank() const { return group_.rank(); }
  bool sequence_parallel() const { return sequence_; }

  // Before column-parallel layers: every rank gets the whole input (gathered along the sequence
  // with sequence parallelism); the input's gradient is the sum of the ranks' (Megatron's f).
  torch::Tensor enter(const torch::Tensor& x);
  // After row-parallel layers: the ranks' partial sums become the whole output, or with sequence
  // parallelism this rank's part of the sequence of it (Megatron's g).
  torch::Tensor leave(const torch::Tensor& partial);
  // Rows [rank · V/t, (rank+1) · V/t) of the vocabulary live here: ids outside look up zeros,
  // and the sum over ranks (left as from a row-parallel layer) is the full lookup.
  torch::Tensor embedding(const torch::Tensor& local_weight, const torch::Tensor& ids);
  // Sequence parallelism: a replicated weight used on this rank's part of the sequence gets a
  // partial gradient; this hook sums it over the group, in `reduce_dtype` (the gradient dtype:
  // fp32 partials summed, then rounded once), before it is accumulated.
  void sum_gradient_over_group(torch::Tensor& parameter, torch::ScalarType reduce_dtype);
  // Mean cross-entropy over tokens from this rank's vocabulary slice of the logits [N, V/t], fp32;
  // the full logits are never gathered (two all-reduces of N numbers and one of N maxima).
  torch::Tensor cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& targets);
  // The same from the hidden states and this rank's rows of the output projection, chunk by chunk
  // (linear_cross_entropy.hpp): no rank ever holds its whole slice of the logits.
  torch::Tensor projected_loss(const torch::Tensor& hidden, const torch::Tensor& local_weight, const torch::Tensor& targets, int64_t chunk_tokens,
                               bool gradients_in_forward = true);

 private:
  Communicator& group_;
  CommunicatorVocabulary vocabulary_;
  bool sequence_;
};

// The shape of rank r's slice of a parameter of `full_shape` split `split` over `size` ranks.
std::vector<int64_t> tensor_slice_shape(const std::vector<int64_t>& full_shape, const TensorSplit& split, int size);
// Rank r's slice of `full` (a copy, contiguous).
torch::Tensor tensor_slice(const torch::Tensor& full, const TensorSplit& split, int rank, int size);
// The same slice copied into `out` (its shape), with no copy between: a model build's host peak is
// then the full weight and the slice alone.
void copy_tensor_slice(torch::Tensor& out, const torch::Tensor& full, const TensorSplit& split, int rank, int size);
// The full tensor from every rank's slice, in rank order (tensor_slice's inverse).
torch::Tensor tensor_join(const std::vector<torch::Tensor>& slices, const TensorSplit& split);
// Where rank r's slice lies in the whole parameter (checkpoints store slices by it).
TensorRegion tensor_region(const std::vector<int64_t>& full_shape, const TensorSplit& split, int rank, int size);
// The whole parameter's shape from rank r's slice shape (tensor_slice_shape's inverse).
std::vector<int64_t> tensor_whole_shape(const std::vector<int64_t>& slice_shape, const TensorSplit& split, int size);
// Why a split cannot be cut evenly over `size` ranks ("" when it can).
std::string tensor_split_problem(const std::vector<int64_t>& full_shape, const TensorSplit& split, int size);

}  // namespace dsrun
