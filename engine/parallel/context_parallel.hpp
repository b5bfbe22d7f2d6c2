// Context parallelism: one sequence split over a group of ranks, balanced for the causal mask, and
// causal attention over the whole sequence by all-gathered keys and values (Llama 3's design).
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"

#include <torch/torch.h>

namespace dsrun {

// Where each rank's tokens lie in the sequence. Cut into 2N chunks, rank r of N holds chunks r and
// 2N-1-r (Megatron-Core's "zigzag"): under the causal mask an early chunk attends to few keys and a
// late one to many, so every rank computes the same share of the attention.
struct ZigzagSplit {
  int ranks = 1;
  int64_t seq_len = 0;  // the whole sequence: a multiple of 2 · ranks (the recipe checks it)

  int64_t chunk() const { return seq_len / (2 * ranks); }
  int64_t local_tokens() const { return 2 * chunk(); }
  // Rank r's tokens' places in the sequence, in the order it holds them: [seq_len / ranks] int64.
  torch::Tensor positions(int rank) const;
  // Rank r's tokens of `whole` [b, seq_len, ...] (dim 1), in that order.
  torch::Tensor take(const torch::Tensor& whole, int rank) const;
  // Rank r's share of a batch of whole sequences: its tokens and targets, their places
  // (Batch::places) and count. The model then attends through its runner's
  // split_sequence_attention, which context_parallel_attention serves.
  Batch take(const Batch& whole, int rank) const;
};

// Causal attention of this rank's queries over the whole sequence. q [b, n, heads, d], k [b, n,
// kv_heads, d] and v [b, n, kv_heads, dv] for the n tokens this rank holds (split.take's order);
// heads a multiple of kv_heads. Every rank's keys and values are gathered (in backward their
// gradients are reduce-scattered back), and each query attends to the keys at or before its place
// in the sequence: each of the rank's two chunks to the chunks up to its own, its own causally.
// Returns [b, n, heads, dv].
torch::Tensor context_parallel_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const ZigzagSplit& split,
                                         Communicator& group);

}  // namespace dsrun
