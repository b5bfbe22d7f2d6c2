// Learning-rate schedules and fp16 loss scaling: pure functions and small state machines.
#include "engine/train/loss_scaler.hpp"
#include "engine/train/schedule.hpp"

#include <catch2/catch.hpp>

using namespace dsrun;

namespace {
LrScheduleOptions schedule(ScheduleKind kind, int64_t warmup, int64_t total = 100) {
  LrScheduleOptions o;
  o.schedule.kind = kind;
  o.schedule.warmup_steps = warmup;
  o.schedule.min_lr_ratio = 0.1;
  o.peak_lr = 1.0;
  o.total_steps = total;
  return o;
}
// Scale 2^power, doubling after `window` clean steps, two overflows of hysteresis.
LossScaleOptions scaler_options(int power, int64_t window, double min_scale, int overflow_retries) {
  LossScaleOptions o;
  o.initial_power = power;
  o.window = window;
  o.hysteresis = 2;
  o.min_scale = min_scale;
  o.overflow_retries = overflow_retries;
  return o;
}

}  // namespace

TEST_CASE("warmup rises linearly to the peak", "[schedule]") {
  auto o = schedule(ScheduleKind::Constant, 10);
  CHECK(learning_rate_at(o, 0) == Approx(0.1));
  CHECK(learning_rate_at(o, 4) == Approx(0.5));
  CHECK(learning_rate_at(o, 9) == Approx(1.0));
  CHECK(learning_rate_at(o, 50) == Approx(1.0));
}

TEST_CASE("linear and cosine decay to min_lr_ratio", "[schedule]") {
  auto lin = schedule(ScheduleKind::Linear, 0);
  CHECK(learning_rate_at(lin, 0) == Approx(1.0));
  CHECK(learning_rate_at(lin, 50) == Approx(0.55));
  CHECK(learning_rate_at(lin, 100) == Approx(0.1));
  auto cos = schedule(ScheduleKind::Cosine, 10, 110);
  CHECK(learning_rate_at(cos, 10) == Approx(1.0));
  CHECK(learning_rate_at(cos, 60) == Approx(0.55));  // halfway: the mean of peak and floor
  CHECK(learning_rate_at(cos, 110) == Approx(0.1));
}

TEST_CASE("multistep drops at the milestones (DeepSeek LLM)", "[schedule]") {
  auto o = schedule(ScheduleKind::MultiStep, 5, 1000);
  o.schedule.milestones = {0.8, 0.9};
  o.schedule.factors = {0.316, 0.1};
  CHECK(learning_rate_at(o, 2) == Approx(0.6));
  CHECK(learning_rate_at(o, 799) == Approx(1.0));
  CHECK(learning_rate_at(o, 800) == Approx(0.316));
  CHECK(learning_rate_at(o, 899) == Approx(0.316));
  CHECK(learning_rate_at(o, 900) == Approx(0.1));
}

TEST_CASE("warmup-stable-decay holds the peak then decays over the last fraction", "[schedule]") {
  auto o = schedule(ScheduleKind::Wsd, 10, 100);
  o.schedule.decay_fraction = 0.2;
  CHECK(learning_rate_at(o, 50) == Approx(1.0));
  CHECK(learning_rate_at(o, 80) == Approx(1.0));
  CHECK(learning_rate_at(o, 90) == Approx(0.55));
  CHECK(learning_rate_at(o, 100) == Approx(0.1));
}

TEST_CASE("OneCycle rises from peak/div_factor and ends at initial/final_div_factor", "[schedule]") {
  auto o = schedule(ScheduleKind::OneCycle, 0, 100);
  o.schedule.pct_start = 0.25;
  o.schedule.div_factor = 25;
  o.schedule.final_div_factor = 1e4;
  CHECK(learning_rate_at(o, 0) == Approx(0.04));
  CHECK(learning_rate_at(o, 25) == Approx(1.0));
  CHECK(learning_rate_at(o, 100) == Approx(0.04 / 1e4));
  CHECK(learning_rate_at(o, 60) < learning_rate_at(o, 30));
}

TEST_CASE("the fp16 loss scaler backs off on overflow and recovers (DeepSpeed's hysteresis)", "[scaler]") {
  DynamicLossScaler s(scaler_options(4, 3, 2, 0));  // 16
  CHECK(s.scale() == 16);
  CHECK(s.update(true));   // overflow: skipped, the hysteresis absorbs the first
  CHECK(s.scale() == 16);
  CHECK(s.update(true));   // second: halve
  CHECK(s.scale() == 8);
  CHECK(s.update(true));   // hysteresis spent: every further overflow halves
  CHECK(s.scale() == 4);
  CHECK(s.skipped_steps() == 3);
  CHECK_FALSE(s.update(false));
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 4);
  CHECK_FALSE(s.update(false));  // a clean window: double, and the hysteresis is restored
  CHECK(s.scale() == 8);
  CHECK(s.update(true));         // absorbed again
  CHECK(s.scale() == 8);
  CHECK(s.update(true));
  CHECK(s.scale() == 4);
  CHECK(s.update(true));
  CHECK(s.scale() == 2);
  CHECK_THROWS_WITH(s.update(true), Catch::Contains("below the minimum"));  // diverging
}

TEST_CASE("an fp16 step that overflowed runs again at half the scale, up to overflow_retries times, then is skipped", "[scaler]") {
  const LossScaleOptions o = scaler_options(5, 2, 2, 2);  // 32, two retries a step
  DynamicLossScaler s(o);
  // Step 1 overflows at 32 and 16, and is clean at 8: applied, nothing skipped.
  CHECK(s.retry_overflow());
  CHECK(s.scale() == 16);  // halved at once, hysteresis or not: the same batch would overflow again
  CHECK(s.retry_overflow());
  CHECK(s.scale() == 8);
  CHECK_FALSE(s.update(false));
  CHECK(s.skipped_steps() == 0);
  CHECK(s.retried_steps() == 2);
  // Step 2 overflows three times: two retries, then the skip (the hysteresis absorbs its halving).
  CHECK(s.retry_overflow());
  CHECK(s.retry_overflow());
  CHECK(s.scale() == 2);
  CHECK_FALSE(s.retry_overflow());  // this step's retries are spent
  CHECK(s.update(true));
  CHECK(s.scale() == 2);
  CHECK(s.skipped_steps() == 1);
  // A new step may retry again, but never below min_scale: then the skip path decides, and its
  // halving below the minimum is the divergence error.
  CHECK_FALSE(s.retry_overflow());
  CHECK_THROWS_WITH(s.update(true), Catch::Contains("below the minimum"));
  // The retries travel with a checkpoint's state.
  DynamicLossScaler restored(o);
  restored.restore(s.state());
  CHECK(restored.retried_steps() == 4);
  CHECK(restored.scale() == s.scale());
}
