// Training runs for the end-to-end tests: `dsrun run` on tests/recipes/tiny_train.toml with extra
// settings, its output and the losses it recorded; trajectories compared step by step.
#pragma once

#include "storage/store.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

namespace dsrun::test {

// A run recorded as running (with no launcher of its own yet).
inline std::string running_run(Store& store, const std::string& name) {
  NewRun n;
  n.name = name;
  n.recipe_text = n.config_toml = "x";
  const std::string id = store.create_run(n);
  store.set_status(id, RunStatus::Running);
  return id;
}

// A process id that is no longer alive (a child that exited and was reaped).
inline pid_t exited_process() {
  const pid_t exited = ::fork();
  if (exited == 0) ::_exit(0);
  int status = 0;
  REQUIRE(::waitpid(exited, &status, 0) == exited);
  return exited;
}

struct Run {
  int code = -1;
  std::string text;
  std::string id;
  std::vector<double> losses;
  double seconds = 0;
};


// Trains tests/recipes/tiny_train.toml with extra settings; `env` goes before the command.
inline Run train(const dsrun::test::TempDir& dir, const std::string& sets, const std::string& env = "", const std::string& recipe = "tests/recipes/tiny_train.toml") {
  auto t0 = std::chrono::steady_clock::now();
  dsrun::test::CommandOutput out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && " + env + " '" DSRUN_BINARY "' run " + recipe +
                                                             " --db '" + dir.file("runs.db") + "' " + sets);
  Run run;
  run.code = out.code;
  run.text = out.text;
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t at = run.text.find("\nrun ");
  if (at != std::string::npos) run.id = run.text.substr(at + 5, 8);
  if (!run.id.empty()) {
    dsrun::Store store(dir.file("runs.db"));
    for (const auto& m : store.metric_history(run.id, "loss")) run.losses.push_back(m.value);
  }
  return run;
}

inline std::string layout(int stage, int ranks) {
  return "--set parallel.zero_stage=" + std::to_string(stage) + " --set parallel.data_parallel=" + std::to_string(ranks);
}

inline void check_same_trajectory(const std::vector<double>& reference, const Run& run, double tolerance) {
  INFO(run.text);
  REQUIRE(run.code == 0);
  REQUIRE(run.losses.size() == reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    INFO("step " << i + 1 << ": " << run.losses[i] << " vs " << reference[i]);
    CHECK(std::fabs(run.losses[i] - reference[i]) <= tolerance * std::fabs(reference[i]));
  }
}

// `dsrun ARGS --db DIR/runs.db`, run from the source tree.
inline CommandOutput dsrun_command(const TempDir& dir, const std::string& args) {
  return run_command("cd '" + source_dir() + "' && '" DSRUN_BINARY "' " + args + " --db '" + dir.file("runs.db") + "'");
}

// A metric's values a run recorded, step by step.
inline std::vector<double> recorded_metric(const TempDir& dir, const std::string& run_id, const std::string& name) {
  Store store(dir.file("runs.db"));
  std::vector<double> out;
  for (const auto& m : store.metric_history(run_id, name)) out.push_back(m.value);
  return out;
}

// Losses a run recorded, read again (after a resume they cover both attempts).
inline std::vector<double> recorded_losses(const TempDir& dir, const std::string& run_id) {
  Store store(dir.file("runs.db"));
  std::vector<double> out;
  for (const auto& m : store.metric_history(run_id, "loss")) out.push_back(m.value);
  return out;
}

}  // namespace dsrun::test
