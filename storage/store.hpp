// The run store: one SQLite file holding runs, metrics, checkpoints and events, with a versioned
// schema and migrations. WAL mode and short transactions keep it consistent if a process is killed.
#pragma once

#include "storage/run_query.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct sqlite3;

namespace dsrun {

// Run lifecycle: planned -> running -> finished | failed | killed | pruned;
// planned -> infeasible (the plan does not fit); a stopped run may go back to running (resume).
enum class RunStatus { Planned, Running, Finished, Failed, Killed, Infeasible, Pruned };
const char* to_string(RunStatus s);
RunStatus run_status_from_string(const std::string& s);  // throws on an unknown name

struct NewRun {
  std::string name;
  std::string recipe_path;
  std::string recipe_text;   // the recipe file as written
  std::string config_toml;   // the resolved config (defaults, bases and --set applied)
  std::string plan_json;     // the plan for machines
  std::string plan_text;     // the plan as `dsrun plan` printed it
  std::string model, hardware;
  int zero_stage = 0, world_size = 1;
  std::string host, git_revision;
  std::string parent_run;    // lineage (rollback), empty for none
  int64_t parent_step = -1;
  std::string sweep_id;
  int64_t trial_index = -1;  // a sweep's trial number, -1 outside sweeps
  std::string trial_params;  // the trial's parameters, JSON
  std::string config_json;   // the resolved config flattened to {"dotted.key": value} (queried by --where)
  RunStatus status = RunStatus::Planned;
};

struct RunRecord : NewRun {
  std::string id;
  double created_at = 0, started_at = 0, ended_at = 0;  // unix seconds, 0 when not yet
  double deleted_at = 0;
  std::string error;
  double heartbeat_at = 0;  // the launcher's last sign of life (unix seconds), 0 when none
  int64_t pid = 0;          // the launcher's process on `host`, 0 when not recorded (before schema v5)
};

struct MetricValue {
  int64_t step = 0;
  double value = 0;
  double time = 0;
};

struct EventRecord {
  int64_t id = 0;
  double time = 0;
  std::string kind;
  int rank = -1;
  std::string message, detail;
};

struct CheckpointRecord {
  int64_t step = 0;
  std::string path;
  int64_t bytes = 0;
  std::string checksum;
  double created_at = 0;
};

struct RunListOptions {
  int limit = 50;
  std::string status;  // empty: any
  std::string sweep;   // empty: any
};

// `dsrun history`'s filters; empty fields do not filter.
struct RunQuery {
  int limit = 50;
  std::string status, sweep;
  std::string model, hardware, recipe;  // substrings
  double since_seconds = 0;             // created within this many seconds
  SqlFragment where;                    // parse_where()
  SqlFragment sort;                     // sort_expression(); empty: created_at
  bool ascending = false;
  bool deleted = false;                 // list soft-deleted runs instead
};

// A sweep: its spec and where it stands; its trials are runs with its sweep_id.
struct SweepRecord {
  std::string id, name;
  std::string status;  // running, finished, stopped, failed
  double created_at = 0, ended_at = 0, heartbeat_at = 0;
  std::string recipe_path, recipe_text, spec_json;
  std::string host;
  int64_t pid = 0;     // the driver's process, for telling a live sweep from a dead one
  std::string best_run, error;
};

// An owned sqlite3 connection (closed on destruction).
struct SqliteCloser {
  void operator()(sqlite3* db) const;
};
using SqliteHandle = std::unique_ptr<sqlite3, SqliteCloser>;

class Store {
 public:
  // Opens (creating if needed) and migrates to the current schema.
  explicit Store(const std::string& path);
  static int current_schema_version();
  int schema_version() const;
  const std::string& path() const { return path_; }

  std::string create_run(const NewRun& run);  // returns the new run's id
  void set_status(const std::string& run_id, RunStatus status, const std::string& error = "");
  void add_metrics(const std::string& run_id, int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // The launcher is alive: records the time, and its host and process (a resume may run elsewhere).
  void run_heartbeat(const std::string& run_id, const std::string& host, int64_t pid);
  void add_event(const std::string& run_id, const std::string& kind, int rank, const std::string& message, const std::string& detail = "");
  void add_checkpoint(const std::string& run_id, const CheckpointRecord& checkpoint);
  void remove_checkpoint(const std::string& run_id, const std::string& path);  // retention deleted it
  // A resume with other settings (world size, ZeRO stage): the run's config and plan now.
  void update_plan(const std::string& run_id, const std::string& config_toml, const std::string& plan_json, const std::string& plan_text,
                   int zero_stage, int world_size);

  // A full id, a unique id prefix, or a unique run name -> the run's id; throws naming the matches otherwise.
  std::string resolve_run(const std::string& id_prefix_or_name, bool include_deleted = false) const;
  RunRecord get_run(const std::string& run_id) const;
  std::vector<RunRecord> list_runs(const RunListOptions& options) const;  // newest first
  std::vector<RunRecord> query_runs(const RunQuery& query) const;
  void set_deleted(const std::string& run_id, bool deleted);  // soft delete and restore
  int64_t count_runs() const;
  std::map<std::string, MetricValue> latest_metrics(const std::string& run_id) const;
  std::vector<MetricValue> metric_history(const std::string& run_id, const std::string& key) const;
  std::vector<EventRecord> events(const std::string& run_id) const;
  std::vector<CheckpointRecord> checkpoints(const std::string& run_id) const;
  std::vector<RunRecord> children(const std::string& run_id) const;  // runs rolled back from this one, oldest first

  std::string create_sweep(const SweepRecord& sweep);  // status running; returns the id ("s" + 7 hex)
  void update_sweep(const std::string& id, const std::string& status, const std::string& best_run, const std::string& error, int64_t pid);
  void sweep_heartbeat(const std::string& id);
  SweepRecord get_sweep(const std::string& id_prefix_or_name) const;  // throws naming the matches
  std::vector<RunRecord> sweep_trials(const std::string& sweep_id) const;  // by trial index

  sqlite3* handle() const { return db_.get(); }

 private:
  std::string path_;
  SqliteHandle db_;
};

// Applies migrations up to `target_version` (tests use it to build an old database).
void migrate_store(sqlite3* db, int target_version);
double unix_now();

}  // namespace dsrun
