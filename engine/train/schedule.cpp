#include "engine/train/schedule.hpp"

#include <algorithm>
#include <cmath>

namespace dsrun {

double learning_rate_at(const LrScheduleOptions& o, int64_t step) {
  const ScheduleOptions& s = o.schedule;
  const double peak = o.peak_lr;
  const double total = static_cast<double>(o.total_steps);
  const double t = static_cast<double>(step);

  if (s.kind == ScheduleKind::OneCycle) {
    // Linear up from peak/div_factor over pct_start, cosine down to initial/final_div_factor.
    const double initial = peak / s.div_factor, final_lr = initial / s.final_div_factor;
    const double rise = std::max(1.0, s.pct_start * total);
    if (t < rise) return initial + (peak - initial) * t / rise;
    const double progress = std::min(1.0, (t - rise) / std::max(1.0, total - rise));
    return final_lr + (peak - final_lr) * 0.5 * (1 + std::cos(M_PI * progress));
  }

  const double warmup = static_cast<double>(s.warmup_steps);
  if (t < warmup) return peak * (t + 1) / warmup;  // reaches the peak at the last warmup step
  const double floor = peak * s.min_lr_ratio;
  const double progress = std::min(1.0, (t - warmup) / std::max(1.0, total - warmup));  // 0..1 after warmup
  switch (s.kind) {
    case ScheduleKind::Constant: return peak;
    case ScheduleKind::Linear: return peak + (floor - peak) * progress;
    case ScheduleKind::Cosine: return floor + (peak - floor) * 0.5 * (1 + std::cos(M_PI * progress));
    case ScheduleKind::MultiStep: {
      // Milestones are fractions of all steps (DeepSeek LLM: 80% and 90% of the tokens).
      double lr = peak;
      for (size_t i = 0; i < s.milestones.size(); ++i)
        if (t >= s.milestones[i] * total) lr = peak * s.factors[i];
      return lr;
    }
    case ScheduleKind::Wsd: {
      // Stable at the peak, then a linear decay to the floor over the last decay_fraction of steps.
      const double decay_start = total * (1 - s.decay_fraction);
      if (t < decay_start) return peak;
      return peak + (floor - peak) * std::min(1.0, (t - decay_start) / std::max(1.0, total - decay_start));
    }
    case ScheduleKind::OneCycle: break;  // handled above
  }
  return peak;
}

}  // namespace dsrun
