// Alert rules ([[alerts]] in a recipe, or in the user's alerts file): what to watch for in a run and
// where to say so. load.cpp parses and checks them; the launcher evaluates and delivers them (runner/alerts).
#pragma once

#include "engine/recipe/kinds.hpp"

#include <string>
#include <vector>

namespace dsrun {

// What a rule fires on, once per run: the run failed (or was killed); a loss that is NaN or infinite;
// no step completed for `minutes`; a metric condition (`when`, parsed as `dsrun history --where`,
// bare names being metrics) became true; a sweep finished.
enum class AlertOn { Failed, NanLoss, Stalled, Metric, SweepFinished };
template <>
struct EnumNames<AlertOn> {
  static constexpr NameTable<AlertOn, 5> table{{{AlertOn::Failed, "failed"}, {AlertOn::NanLoss, "nan"}, {AlertOn::Stalled, "stalled"},
                                                {AlertOn::Metric, "metric"}, {AlertOn::SweepFinished, "sweep_finished"}}};
};

struct AlertRule {
  AlertOn on = AlertOn::Failed;
  std::string name;                  // for messages; default: `on` and its condition
  std::string when;                  // metric: "val_loss > 3.0"
  double minutes = 0;                // stalled: no step for this long
  std::string url;                   // a webhook: POST of a JSON body ({"text": ..., "alert": {...}})
  std::vector<std::string> command;  // a program and its arguments, the alert as JSON on its stdin (no shell)
  std::string written_at;            // "recipes/a.toml:12:1": where the rule is
};

}  // namespace dsrun
