// `dsrun sweep`: runs a recipe's [sweep] as trials, each a normal `dsrun run` child process with
// its share of the devices, prunes poor trials from their metrics in the store, and can resume.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace dsrun {

struct SweepArgs {
  std::string file;               // the recipe with a [sweep] section
  std::vector<std::string> sets;  // --set overrides applied to every trial (the trial's values win)
  std::string resume;             // --resume SWEEP: continue that sweep
  std::string show;               // --show SWEEP: print its leaderboard only
  bool json = false, csv = false; // leaderboard format
  bool slurm = false;             // submit the trials as a Slurm job array (at most sweep.concurrency at once)
  std::string slurm_task;         // --slurm-task SWEEP: one array task (claims and runs trials from the store)
};

int command_sweep(const SweepArgs& args, const std::string& db_path);

class Store;
// A sweep's trials, best first (`dsrun sweep --show S --json`): its parameters' keys, each trial's
// run, status, objective and values, the best run. Throws naming the matches for an unknown sweep.
nlohmann::json sweep_leaderboard(const Store& store, const std::string& sweep_query);

}  // namespace dsrun
