// Dynamic loss scaling for fp16, with DeepSpeed's semantics: multiply the loss by a scale; every
// overflow skips the step; the first hysteresis - 1 overflows keep the scale, every later one halves
// it; `window` clean steps in a row double it and restore the hysteresis. A step may first run
// again on its batch at half the scale (overflow_retries), so that it is not lost. No torch: the
// caller checks the gradients.
#pragma once

#include "engine/recipe/recipe.hpp"

#include <cstdint>

namespace dsrun {

// Everything the scaler remembers between steps, for checkpoints.
struct LossScalerState {
  double scale = 0;
  int hysteresis_left = 0;
  int64_t clean_steps = 0, skipped = 0;
  int64_t retried = 0;  // runs again on the same batch, over the run
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScaleOptions& options);
  double scale() const { return scale_; }
  // After an overflow, before update(): true when the step is to run again on the same batch at
  // half the scale (at most overflow_retries times a step, never below min_scale); the halving is
  // at once, since the same batch at the same scale overflows again. False: skip it (update(true)).
  bool retry_overflow();
  // Reports whether the step's gradients overflowed; returns true if the step must be skipped.
  // Throws dsrun::Error when the scale would fall below min_scale (training has diverged).
  bool update(bool overflowed);
  int64_t skipped_steps() const { return skipped_; }
  int64_t retried_steps() const { return retried_; }
  LossScalerState state() const { return {scale_, hysteresis_left_, clean_steps_, skipped_, retried_}; }
  void restore(const LossScalerState& s) {
    scale_ = s.scale;
    hysteresis_left_ = s.hysteresis_left;
    clean_steps_ = s.clean_steps;
    skipped_ = s.skipped;
    retried_ = s.retried;
  }

 private:
  LossScaleOptions options_;
  double scale_;
  int hysteresis_left_;
  int64_t clean_steps_ = 0;
  int64_t skipped_ = 0;
  int64_t retried_ = 0;
  int retries_this_step_ = 0;
};

}  // namespace dsrun
