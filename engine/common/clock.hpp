// Seconds on the monotonic clock: for durations and deadlines (never a date: unix_now in the store).
// One definition for the launcher, the sweep driver, alerts, the probes and the hooks' budgets.
#pragma once

#include <chrono>

namespace dsrun {

inline double steady_seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace dsrun
