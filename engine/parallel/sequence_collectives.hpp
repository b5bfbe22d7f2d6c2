// Differentiable collectives along a tensor's sequence dimension (dim 1): what sequence
// parallelism (tensor_parallel.cpp) and context parallelism (context_parallel.cpp) move between ranks.
#pragma once

#include "engine/dist/communicator.hpp"

#include <torch/torch.h>

namespace dsrun {

// [b, n, ...] on each of the group's ranks -> [b, t·n, ...], rank r's part at [r·n, (r+1)·n).
// Backward reduce-scatters the gradient: each rank gets the sum of every rank's for its part.
torch::Tensor all_gather_sequence(const torch::Tensor& part, Communicator& group);

// [b, s, ...] partial sums on each rank -> [b, s/t, ...], the sum of rank r's part of the sequence.
// Backward all-gathers the gradient.
torch::Tensor reduce_scatter_sequence(const torch::Tensor& whole, Communicator& group);

// Statistics over whole sequences of which each rank holds a part (context parallelism): the sum of
// every rank's `part`, on every rank. Every rank's loss reads the sum, so backward sums the
// gradients too: each rank's part gets the gradient of the whole objective.
torch::Tensor all_reduce_sequence_sum(const torch::Tensor& part, Communicator& group);

}  // namespace dsrun
