#include "engine/parallel/flat_layout.hpp"

#include <algorithm>

namespace dsrun {

FlatUnitLayout lay_out_flat_unit(const std::vector<std::vector<int64_t>>& shapes, int world, int rank, bool sharded) {
  FlatUnitLayout l;
  l.shapes = shapes;
  for (const auto& shape : shapes) {
    int64_t numel = 1;  // a 0-dim parameter holds one element, as torch counts it
    for (int64_t d : shape) numel *= d;
    l.offsets.push_back(l.numel);
    l.numels.push_back(numel);
    l.numel += numel;
  }
  l.padded = sharded ? (l.numel + world - 1) / world * world : l.numel;
  l.shard = sharded ? l.padded / world : l.padded;
  l.shard_begin = sharded ? rank * l.shard : 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (shapes[i].size() < 2) continue;
    const int64_t begin = std::max(l.offsets[i], l.shard_begin), end = std::min(l.offsets[i] + l.numels[i], l.shard_begin + l.shard);
    if (begin < end) l.decay_ranges.push_back({begin - l.shard_begin, end - l.shard_begin});
  }
  return l;
}

}  // namespace dsrun
