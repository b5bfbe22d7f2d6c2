// Dynamic loss scaling for fp16, with DeepSpeed's semantics: multiply the loss by a scale; every
// overflow skips the step; the first hysteresis - 1 overflows keep the scale, every later one halves
// it; `window` clean steps in a row double it and restore the hysteresis. No torch: the caller
// checks the gradients.
#pragma once

#include "engine/recipe/recipe.hpp"

#include <cstdint>

namespace dsrun {

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScaleOptions& options);
  double scale() const { return scale_; }
  // Reports whether the step's gradients overflowed; returns true if the step must be skipped.
  // Throws dsrun::Error when the scale would fall below min_scale (training has diverged).
  bool update(bool overflowed);
  int64_t skipped_steps() const { return skipped_; }

 private:
  LossScaleOptions options_;
  double scale_;
  int hysteresis_left_;
  int64_t clean_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace dsrun
