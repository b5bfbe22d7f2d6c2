#include "engine/parallel/context_parallel.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/parallel/sequence_collectives.hpp"

#include <limits>

namespace dsrun {

using torch::Tensor;

Tensor ZigzagSplit::positions(int rank) const {
  const int64_t c = chunk();
  return torch::cat({torch::arange(rank * c, (rank + 1) * c, torch::kInt64), torch::arange((2 * ranks - 1 - rank) * c, (2 * ranks - rank) * c, torch::kInt64)});
}

Tensor ZigzagSplit::take(const Tensor& whole, int rank) const {
  DSRUN_ASSERT(whole.size(1) == seq_len, "a whole sequence is split");
  const int64_t c = chunk();
  return torch::cat({whole.narrow(1, rank * c, c), whole.narrow(1, (2 * ranks - 1 - rank) * c, c)}, 1);
}

Batch ZigzagSplit::take(const Batch& whole, int rank) const {
  DSRUN_ASSERT(!whole.positions.defined(), "packed documents are not split over context ranks (the recipe refuses them)");
  Batch share = whole;
  share.inputs = take(whole.inputs, rank);
  share.targets = take(whole.targets, rank);
  share.places = positions(rank);
  share.items = share.targets.numel();
  return share;
}

Tensor context_parallel_attention(const Tensor& q, const Tensor& k, const Tensor& v, const ZigzagSplit& split, Communicator& group) {
  const int n_ranks = group.world_size(), rank = group.rank();
  DSRUN_ASSERT(n_ranks == split.ranks && q.size(1) == split.local_tokens(), "the split is the group's and the tokens are this rank's");
  const int64_t heads = q.size(2), kv_heads = k.size(2), c = split.chunk();
  // Every rank's keys and values, rank by rank ([b, N·n, kv_heads, d]), put in sequence order:
  // gathered row i lies at place places[i], so sorting the places gives each place's row.
  const Tensor all_k = all_gather_sequence(k, group), all_v = all_gather_sequence(v, group);
  std::vector<Tensor> places;
  for (int r = 0; r < n_ranks; ++r) places.push_back(split.positions(r));
  const Tensor in_order = torch::cat(places).argsort().to(q.device());
  Tensor keys = all_k.index_select(1, in_order).transpose(1, 2), values = all_v.index_select(1, in_order).transpose(1, 2);  // [b, kv_heads, s, d]
  if (heads != kv_heads) {  // grouped-query attention: each key and value head serves heads / kv_heads query heads
    keys = keys.repeat_interleave(heads / kv_heads, 1);
    values = values.repeat_interleave(heads / kv_heads, 1);
  }
  // Each of this rank's chunks attends to the chunks up to its own: the earlier ones whole, its own
  // causally (0 at or before a query's place, -inf after). No score past the causal line but the
  // diagonal block's is computed: (2N+1)/(4N) of the whole sequence's, not all of them.
  std::vector<Tensor> outputs;
  for (const int64_t j : {static_cast<int64_t>(rank), static_cast<int64_t>(2 * n_ranks - 1 - rank)}) {
    const Tensor queries = q.narrow(1, j == rank ? 0 : c, c).transpose(1, 2);  // [b, heads, c, d]
    const int64_t visible = (j + 1) * c;
    Tensor mask = torch::zeros({c, visible}, q.options());
    mask.narrow(1, j * c, c).copy_(torch::full({c, c}, -std::numeric_limits<float>::infinity(), q.options()).triu(1));
    outputs.push_back(compat::masked_attention(queries, keys.narrow(2, 0, visible), values.narrow(2, 0, visible), mask.view({1, 1, c, visible})).transpose(1, 2));
  }
  return torch::cat(outputs, 1);
}

}  // namespace dsrun
