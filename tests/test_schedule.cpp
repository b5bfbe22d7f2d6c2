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
  LossScaleOptions o;
  o.initial_power = 4;  // 16
  o.window = 3;
  o.hysteresis = 2;
  o.min_scale = 2;
  DynamicLossScaler s(o);
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
