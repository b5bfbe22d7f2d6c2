#include "engine/common/tensor_region.hpp"

#include "engine/common/error.hpp"

#include <algorithm>
#include <cstring>
#include <string>

namespace dsrun {

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> region_shape(const std::vector<int64_t>& whole_shape, const TensorRegion& region) {
  std::vector<int64_t> shape = whole_shape;
  if (region.whole()) return shape;
  int64_t length = 0;
  for (const auto& [begin, n] : region.ranges) length += n;
  shape.at(static_cast<size_t>(region.dim)) = length;
  return shape;
}

std::vector<RegionRun> region_runs(const std::vector<int64_t>& whole_shape, const TensorRegion& region) {
  const int64_t numel = element_count(whole_shape);
  if (region.whole()) return {{0, 0, numel}};
  const size_t dim = static_cast<size_t>(region.dim);
  if (dim >= whole_shape.size()) throw Error("a region along dimension " + std::to_string(region.dim) + " of a " + std::to_string(whole_shape.size()) + "-dimensional tensor");
  int64_t outer = 1, inner = 1;
  for (size_t d = 0; d < dim; ++d) outer *= whole_shape[d];
  for (size_t d = dim + 1; d < whole_shape.size(); ++d) inner *= whole_shape[d];
  const int64_t extent = whole_shape[dim];
  int64_t length = 0;
  for (const auto& [begin, n] : region.ranges) {
    if (begin < 0 || n < 0 || begin + n > extent)
      throw Error("a region's range [" + std::to_string(begin) + ", " + std::to_string(begin + n) + ") lies outside dimension " + std::to_string(dim) + " of size " + std::to_string(extent));
    length += n;
  }
  std::vector<RegionRun> runs;
  int64_t at = 0;
  for (int64_t o = 0; o < outer; ++o)
    for (const auto& [begin, n] : region.ranges) {
      if (n == 0) continue;
      runs.push_back({at, (o * extent + begin) * inner, n * inner});
      at += n * inner;
    }
  DSRUN_ASSERT(at == outer * length * inner, "runs cover the region");
  return runs;
}

void copy_region_range(const std::vector<RegionRun>& runs, int64_t begin, int64_t end, float* part, float* whole, bool to_whole) {
  // Runs are in region order: skip to the first that ends after `begin`.
  auto it = std::upper_bound(runs.begin(), runs.end(), begin, [](int64_t b, const RegionRun& r) { return b < r.in_region + r.count; });
  for (; it != runs.end() && it->in_region < end; ++it) {
    const int64_t lo = std::max(begin, it->in_region), hi = std::min(end, it->in_region + it->count);
    if (lo >= hi) continue;
    float* p = part + (lo - begin);
    float* w = whole + it->in_whole + (lo - it->in_region);
    const size_t bytes = static_cast<size_t>(hi - lo) * sizeof(float);
    if (to_whole) std::memcpy(w, p, bytes);
    else std::memcpy(p, w, bytes);
  }
}

}  // namespace dsrun
