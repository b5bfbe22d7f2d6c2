// Dynamic loss scaling for fp16 (as DeepSpeed and apex do it): multiply the loss by a scale,
// skip the step and halve the scale after `hysteresis` overflows, double it after `window`
// clean steps. No torch: the overflow check is done by the caller.
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
