#include "engine/train/loss_scaler.hpp"

#include "engine/common/error.hpp"

#include <cmath>

namespace dsrun {

DynamicLossScaler::DynamicLossScaler(const LossScaleOptions& options)
    : options_(options), scale_(std::ldexp(1.0, options.initial_power)), hysteresis_left_(options.hysteresis) {}

bool DynamicLossScaler::retry_overflow() {
  if (retries_this_step_ >= options_.overflow_retries || scale_ / 2 < options_.min_scale) return false;
  ++retries_this_step_;
  ++retried_;
  clean_steps_ = 0;
  scale_ /= 2;
  return true;
}

bool DynamicLossScaler::update(bool overflowed) {
  retries_this_step_ = 0;
  if (!overflowed) {
    if (++clean_steps_ % options_.window == 0) {
      scale_ *= 2;
      hysteresis_left_ = options_.hysteresis;
    }
    return false;
  }
  ++skipped_;
  clean_steps_ = 0;
  if (hysteresis_left_ > 1) {
    --hysteresis_left_;  // tolerated: skip the step, keep the scale
    return true;
  }
  if (scale_ / 2 < options_.min_scale) {
    ErrorContext c;
    c.key = "precision.loss_scale.min_scale";
    c.hint = "the fp16 loss keeps overflowing: lower the learning rate, or use bf16";
    throw Error("loss scale would drop below the minimum " + std::to_string(options_.min_scale), c);
  }
  scale_ /= 2;  // hysteresis spent: every overflow halves until a clean window restores it
  return true;
}

}  // namespace dsrun
