// Looking at past runs: `history` with filters, a query expression and sorting; soft `delete`,
// `restore` and `gc`; `compare` (config, plan, metrics, predicted vs measured); `watch`.
#pragma once

#include "storage/run_query.hpp"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dsrun {

class Store;
struct RunRecord;

struct HistoryArgs {
  int limit = 50;
  std::string status, sweep, model, hardware, recipe, since, where, sort;
  bool ascending = false, deleted = false, json = false, csv = false;
};
int command_history(const HistoryArgs& args, const std::string& db_path);
// What names mean in --where and --sort (run columns, schema and hook-option config keys,
// metrics.KEY), with the schema's keys for did-you-mean: history's, the ui's and alerts'.
QueryNames query_names();

// A run marked running is refused, unless its launcher is gone (launcher_gone) and `force` is set.
int command_delete(const std::vector<std::string>& runs, bool force, const std::string& db_path);
int command_restore(const std::vector<std::string>& runs, const std::string& db_path);
// `dsrun store copy SRC DST`: every record from one store (SQLite file or PostgreSQL URL) into another.
int command_store_copy(const std::string& from, const std::string& to);
// Removes the files (run directory, checkpoints) of soft-deleted runs; reports the bytes freed.
int command_gc(bool dry_run, const std::string& db_path);

// A TOML document flattened to "a.b" -> value text (a table's keys dotted; arrays as TOML).
std::map<std::string, std::string> flat_toml(const std::string& text);
// Keys where the maps differ (or every key, with `all`), as rows: the key, then each map's value ("-" where absent).
std::vector<std::vector<std::string>> differences(const std::vector<std::map<std::string, std::string>>& maps, bool all);

// The plan's figures beside what a run measured: model states, each rank's device peak (the GPU
// allocator's; a CPU rank's RSS), each GPU rank's host peak, the step time and tokens/s (means after
// the first step). `dsrun compare` prints them; `dsrun ui`'s run page shows them.
struct PlanBesideMeasured {
  std::string quantity;
  double predicted = 0, measured = 0, error_percent = 0;  // NaN where missing
  std::string predicted_text, measured_text;
  int rank = -1;         // a per-rank row's rank
  std::string kind;      // "GPU allocated", "CPU RSS", "host RSS"
  bool host = false;     // a GPU rank's host row
};
std::vector<PlanBesideMeasured> plan_beside_measured(const Store& store, const RunRecord& run);

struct CompareArgs {
  std::vector<std::string> runs;
  bool all = false;     // every config key, not only those that differ
  int64_t at_step = -1; // also each metric at this step
  bool json = false;
};
int command_compare(const CompareArgs& args, const std::string& db_path);

// Follows a run from the store until it ends (another process is running it); an error when the
// run is marked running but its launcher is gone (launcher_gone).
int command_watch(const std::string& run, double interval_s, const std::string& db_path);

}  // namespace dsrun
