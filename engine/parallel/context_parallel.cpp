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
  const int n_ranks = group.world_size();
  DSRUN_ASSERT(n_ranks == split.ranks && q.size(1) == split.local_tokens(), "the split is the group's and the tokens are this rank's");
  const int64_t heads = q.size(2), kv_heads = k.size(2);
  // Every rank's keys and values, rank by rank: [b, N·n, kv_heads, d], and each one's place.
  Tensor all_k = all_gather_sequence(k, group), all_v = all_gather_sequence(v, group);
  std::vector<Tensor> places;
  for (int r = 0; r < n_ranks; ++r) places.push_back(split.positions(r));
  const Tensor key_places = torch::cat(places).to(q.device()), query_places = split.positions(group.rank()).to(q.device());
  // 0 where a query may see a key (at or before its place), -inf after: [1, 1, n, N·n].
  const Tensor bias = torch::zeros({query_places.size(0), key_places.size(0)}, q.options())
                          .masked_fill(key_places.unsqueeze(0) > query_places.unsqueeze(1), -std::numeric_limits<float>::infinity())
                          .view({1, 1, query_places.size(0), key_places.size(0)});
  Tensor qh = q.transpose(1, 2), kh = all_k.transpose(1, 2), vh = all_v.transpose(1, 2);  // [b, heads, tokens, d]
  if (heads != kv_heads) {  // grouped-query attention: each key and value head serves heads / kv_heads query heads
    kh = kh.repeat_interleave(heads / kv_heads, 1);
    vh = vh.repeat_interleave(heads / kv_heads, 1);
  }
  return compat::masked_attention(qh, kh, vh, bias).transpose(1, 2);
}

}  // namespace dsrun
