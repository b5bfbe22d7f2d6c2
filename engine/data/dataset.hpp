// Training and validation data as an indexable stream of samples. Sample g of the training stream
// is fixed by the seed (a fresh permutation each epoch), so ranks read disjoint slices of every
// global batch, and a resumed run continues from a step number alone. Formats: docs/data.md.
#pragma once

#include "engine/model/model.hpp"
#include "engine/recipe/recipe.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dsrun {

class Dataset {
 public:
  virtual ~Dataset() = default;
  // `count` consecutive samples of the training stream, starting at global sample index `first`.
  virtual Batch train_batch(int64_t first, int64_t count) = 0;
  // Validation samples, in order, wrapping around.
  virtual Batch val_batch(int64_t first, int64_t count) = 0;
  virtual std::string describe() const = 0;
  // The files read, for the checkpoint's record of the data (empty: synthetic data, images).
  virtual std::vector<std::string> files() const { return {}; }
  // What the data's reader found worth saying (a validation split far from data.val_fraction).
  virtual std::vector<std::string> warnings() const { return {}; }
  // Training augmentation, on the batch's device once it is there (data.augment for images).
  virtual void augment(Batch& /*on_device*/) const {}
};

std::unique_ptr<Dataset> open_dataset(const DataOptions& data, const ModelSpec& model, int64_t seq_len, uint64_t seed);

}  // namespace dsrun
