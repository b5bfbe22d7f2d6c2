// Learning rate as a pure function of the step: warmup, then constant, linear, cosine, OneCycle,
// DeepSeek's multi-step, or warmup-stable-decay. No torch: tested and plotted without it.
#pragma once

#include "engine/recipe/recipe.hpp"

#include <cstdint>

namespace dsrun {

struct LrScheduleOptions {
  ScheduleOptions schedule;
  double peak_lr = 3e-4;
  int64_t total_steps = 100;
};

// The rate for optimizer step `step` (0-based).
double learning_rate_at(const LrScheduleOptions& o, int64_t step);

}  // namespace dsrun
