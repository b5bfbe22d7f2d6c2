// The flat layout of one parameter unit for data parallelism: where each parameter sits in the
// unit's flat buffer, the padding that gives every rank an equal shard, and this rank's shard.
// No torch: shapes are plain vectors, so the layout can be computed and tested without tensors.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace dsrun {

struct FlatUnitLayout {
  std::vector<std::vector<int64_t>> shapes;  // the unit's parameters, in the unit's order
  std::vector<int64_t> offsets, numels;      // each parameter's place in the flat buffer
  int64_t numel = 0;   // the parameters' elements, padding excluded
  // Sharded stages pad the buffer to a multiple of the ranks, so that every rank holds the same
  // number of elements (collectives need equal parts; 3 ranks and odd sizes do not divide).
  int64_t padded = 0;
  int64_t shard = 0;        // elements this rank holds: the whole buffer when not sharded
  int64_t shard_begin = 0;  // where this rank's elements start in the flat buffer
  // [begin, end) within the shard, ascending and disjoint: the parameters of 2+ dimensions get
  // weight decay (matrices do; norms and biases do not).
  std::vector<std::pair<int64_t, int64_t>> decay_ranges;
};

// The layout of a unit whose parameters have `shapes`, on `rank` of `world` data-parallel ranks;
// `sharded` (ZeRO stage 1 and up) splits it into equal shards, else every rank holds all of it.
FlatUnitLayout lay_out_flat_unit(const std::vector<std::vector<int64_t>>& shapes, int world, int rank, bool sharded);

}  // namespace dsrun
