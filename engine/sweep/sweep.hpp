// Sweeps without processes: the [sweep] section of a recipe (parameters, method, objective,
// budget, pruning), trial parameters by grid, seeded random or TPE, objectives from metric
// curves, and pruning decisions (median stopping, ASHA). The driver is runner/sweep.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

enum class Distribution { Values, Uniform, LogUniform, IntUniform };
enum class SweepMethod { Grid, Random, Tpe };
enum class PruneMethod { None, Median, Asha };

// One dimension of the search space: a recipe key (or, paired, several keys varying together).
struct SweepParameter {
  std::vector<std::string> keys;        // one key; paired: several
  Distribution distribution = Distribution::Values;
  std::vector<nlohmann::json> values;   // Values: scalars (paired: arrays, one element per key)
  double min = 0, max = 0;              // ranges
  int grid_points = 0;                  // how a range is gridded (linear, log-spaced for log_uniform)
};

struct PruningSpec {
  PruneMethod method = PruneMethod::None;
  int64_t grace_steps = 1;      // no trial is pruned before this step (also ASHA's first rung)
  double reduction_factor = 3;  // ASHA: keep the top 1/factor at each rung; rungs at grace·factor^k
  int min_trials = 3;           // median: trials that must have reached the step before comparing
};

struct SweepSpec {
  std::string path;             // the sweep (recipe) file
  SweepMethod method = SweepMethod::Grid;
  uint64_t seed = 0;
  int64_t max_trials = 0;       // 0: grid: every combination; random/TPE: required
  double max_minutes = 0;       // 0: no time budget
  int concurrency = 1;
  std::string metric = "loss";
  bool maximize = false;
  std::optional<double> target;  // a trial reaching it ends the sweep
  std::string summary = "last";  // how a trial's curve becomes its objective: last, best, mean
  int tpe_startup = 5;           // TPE: random trials before the model is used
  std::vector<SweepParameter> parameters;
  PruningSpec pruning;
};

// Reads the [sweep] table of a recipe file. Throws dsrun::Error naming file, line and key.
SweepSpec load_sweep_spec(const std::string& path);
nlohmann::json sweep_spec_to_json(const SweepSpec& spec);
SweepSpec sweep_spec_from_json(const nlohmann::json& j);

// A trial's values: recipe key -> value (a JSON scalar).
using TrialParams = std::map<std::string, nlohmann::json>;

int64_t grid_size(const SweepSpec& spec);  // -1 when a range has no grid_points
TrialParams grid_trial(const SweepSpec& spec, int64_t index);
// Random: trial `index` depends only on (seed, index), so a resumed sweep draws the same trials.
TrialParams random_trial(const SweepSpec& spec, int64_t index);

struct TrialOutcome {
  TrialParams params;
  double objective = 0;
};
// TPE (Bergstra et al. 2011): after tpe_startup random trials, split the finished ones at the best
// quartile, model each parameter's good and bad values with Parzen estimators and take, of 24
// candidates drawn from the good model, the one with the highest good/bad density ratio.
TrialParams tpe_trial(const SweepSpec& spec, int64_t index, const std::vector<TrialOutcome>& finished);

TrialParams next_trial(const SweepSpec& spec, int64_t index, const std::vector<TrialOutcome>& finished);
int64_t trial_budget(const SweepSpec& spec);  // how many trials the sweep runs at most

// "key=value" overrides (TOML values) for `--set`.
std::vector<std::string> trial_overrides(const TrialParams& params);
std::string describe_params(const TrialParams& params);  // "optimizer.lr=0.003 batch.micro=2"

// A metric's values over steps.
using Curve = std::vector<std::pair<int64_t, double>>;
std::optional<double> summarize_curve(const Curve& curve, const std::string& summary, bool maximize);

// Whether a running trial should stop now, and why. `others`: every other trial's curve
// (finished and running). Median: the trial's best value so far is worse than the median of the
// others' best values up to the same step. ASHA: at each rung it reached, the trial must be in
// the top 1/reduction_factor of the trials that reached that rung (decided once enough have).
std::optional<std::string> prune_reason(const PruningSpec& p, bool maximize, const Curve& trial, const std::vector<Curve>& others);

}  // namespace dsrun
