// Where one rank's part of a parameter lies in the whole parameter, and the contiguous runs that
// map one onto the other. Checkpoints store slices by region; tensor parallelism cuts by it. No torch.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace dsrun {

// Along `dim`, the concatenation of `ranges` (begin, length); every other dimension whole.
// Tensor parallelism gives a column block (dim 1) or a row block of each fused part (dim 0: a
// slice of q, of k and of v); dim -1 is the whole parameter.
struct TensorRegion {
  int dim = -1;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  bool whole() const { return dim < 0; }
  bool operator==(const TensorRegion& o) const { return dim == o.dim && ranges == o.ranges; }
};

int64_t element_count(const std::vector<int64_t>& shape);
std::vector<int64_t> region_shape(const std::vector<int64_t>& whole_shape, const TensorRegion& region);

// A run of `count` elements contiguous both in the region (row-major, from `in_region`) and in
// the whole (from `in_whole`).
struct RegionRun {
  int64_t in_region = 0, in_whole = 0, count = 0;
};
// The region's runs, in region order. Throws dsrun::Error when the region does not fit the shape.
std::vector<RegionRun> region_runs(const std::vector<int64_t>& whole_shape, const TensorRegion& region);

// Copies elements [begin, end) of the region, held in `part[0, end - begin)`, to their places in
// `whole` (to_whole), or the other way.
void copy_region_range(const std::vector<RegionRun>& runs, int64_t begin, int64_t end, float* part, float* whole, bool to_whole);

}  // namespace dsrun
