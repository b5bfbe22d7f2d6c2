// The run store: runs, metrics, checkpoints, events, sweeps and each node's reports, with a
// versioned schema and migrations, in a SQLite file (the default) or on a PostgreSQL server.
#pragma once

#include "storage/database.hpp"
#include "storage/run_query.hpp"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

// Run lifecycle: planned -> running -> finished | failed | killed | pruned | lost;
// planned -> infeasible (the plan does not fit); a stopped run may go back to running (resume).
// Lost: its batch job vanished from the scheduler without the run's own final report.
enum class RunStatus { Planned, Running, Finished, Failed, Killed, Infeasible, Pruned, Lost };
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
  // A batch job's scheduler record (Slurm): empty when the run was started directly.
  std::string job_id, job_state, job_nodes, job_reason;
};

// What one node of a run reports: its launcher (or an outside launcher's rank 0 of that node).
struct NodeReport {
  int node_rank = 0;
  std::string host;
  int64_t pid = 0;
  std::string status;  // starting, running, finished, failed, killed, lost
  int restarts = 0;
  std::string error;
};

struct NodeRecord : NodeReport {
  double heartbeat_at = 0;
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
  // --where and --sort as the user wrote them (storage/run_query.hpp), and what names mean; the
  // store renders them into its own dialect's SQL. Empty: no condition; created_at order.
  std::string where, sort;
  QueryNames names;
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

class Store {
 public:
  // Opens (creating if needed) and migrates to the current schema. `location` is a SQLite file
  // or a postgresql:// URL.
  explicit Store(const std::string& location);
  static int current_schema_version();
  int schema_version() const;
  // The file, or the URL without its password.
  const std::string& path() const { return db_->location(); }
  SqlDialect dialect() const { return db_->dialect(); }

  std::string create_run(const NewRun& run);  // returns the new run's id
  void set_status(const std::string& run_id, RunStatus status, const std::string& error = "");
  // A resume's compare-and-set: the run becomes `running` under this launcher (host, pid, a
  // heartbeat now) only if it is still as the caller read it: `status`, and for a running run
  // (resume --force of a vanished launcher) the same heartbeat. False: another dsrun took it
  // first, and nothing was changed.
  bool claim_run(const std::string& run_id, RunStatus status, double heartbeat_at, const std::string& host, int64_t pid);
  // `from` -> `to` only if the run is still `from` (a reader marking a silent run lost must not
  // overwrite the ending its launcher recorded meanwhile). False: it was not.
  bool set_status_if(const std::string& run_id, RunStatus from, RunStatus to, const std::string& error);
  // A run recorded ahead of its plan (a Slurm sweep's claimed trial): the plan and config now.
  void complete_run(const std::string& run_id, const NewRun& run);
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

  // A node's launcher reports (one row per node, replaced): also its heartbeat.
  void report_node(const std::string& run_id, const NodeReport& report);
  std::vector<NodeRecord> nodes(const std::string& run_id) const;  // by node rank
  // The batch job behind a run (Slurm's id, state, nodes and reason).
  void set_job(const std::string& run_id, const std::string& job_id, const std::string& job_state, const std::string& job_nodes,
               const std::string& job_reason);
  // Runs with a batch job whose end is not yet settled: the run planned or running, or the job in a
  // state not among `final_states` (a finished run whose job Slurm has not yet closed).
  std::vector<RunRecord> runs_with_open_jobs(const std::vector<std::string>& final_states) const;
  // The newest planned or running run of a batch job (or rendezvous), created since `since`; "" for none.
  std::string find_job_run(const std::string& job_id, double since) const;
  void set_sweep_job(const std::string& sweep_id, const std::string& job_id);
  std::string sweep_job(const std::string& sweep_id) const;
  // Runs `body` in one transaction (retried from the start on a serialization conflict).
  void transaction(const std::function<void()>& body) const { db_->transaction(body); }

  // Raw SQL, for tests and `store copy`.
  Database& database() const { return *db_; }

  // A launcher's writes outlive a server store that stays away: after `reconnect_seconds` of
  // trying, a write that cannot be made goes to `path` instead (one JSON line each, in order,
  // fsync'd, at most 256 MiB), and what waits there is replayed, in order, before a later write
  // once the store answers (tried every 10 s). Status, metrics, events, checkpoints and node
  // reports are kept; a heartbeat while the store is away is not (it is about now). Training never
  // stops for the journal either: a write the file cannot take (unwritable, the disk full) waits in
  // memory after the file's lines, and a replay that fails leaves the file as it is.
  void journal_writes_to(const std::string& path, double reconnect_seconds);
  // Replays what waits in the journal now; true when nothing is left (or there is no journal).
  bool replay_journal(bool now = false);
  bool journal_pending() const { return journal_pending_; }
  // The journal waits because the store lacks its run (not because the store is away): waiting
  // for the store to come back would not help.
  bool journal_waits_for_missing_run() const { return run_missing_now_; }
  // The writes that wait in memory only (the journal file could not take them), described:
  // "3 writes: metrics of steps 25-27, 1 status" ("" when none). Lost if the process ends now.
  std::string unjournaled_writes() const;

 private:
  // Runs `apply`; with a journal, while the store is away, appends `entry()` (a JSON line) instead.
  void write(const std::function<void()>& apply, const std::function<std::string()>& entry);
  void append_journal(const std::string& line);
  void apply_journal_entry(const std::string& line);
  // Whether the run a journal line is about has no row in the store (said once on stderr).
  bool run_missing(const std::string& line);

  std::unique_ptr<Database> db_;
  std::string journal_path_;
  // The time of the writes being made: now, or a journaled write's own time while it is replayed.
  double write_time() const;
  double written_at_ = 0;
  std::vector<std::string> unjournaled_;  // lines the journal file could not take, in order after its own
  int64_t unjournaled_bytes_ = 0;         // their size (append_journal's bound counts it on every write)
  size_t replayed_file_lines_ = 0;        // the file's first lines already applied (its rewrite failed)
  bool journal_pending_ = false, replaying_ = false;
  bool run_missing_said_ = false, run_missing_now_ = false;
  double next_replay_ = 0, reconnect_seconds_ = 0;
};

// Where runs' directories (config, logs, checkpoints) go: beside a SQLite store; with a server
// store, $DSRUN_RUNS_DIR or ./runs.
std::string runs_directory(const std::string& store_location);
// A SQLite file that exists, or any server URL (the server says whether it answers).
bool store_exists(const std::string& store_location);

// Applies migrations up to `target_version` (tests use it to build an old database).
void migrate_store(Database& db, int target_version);
// What a copy added to its destination, table by table.
struct StoreCopy {
  int64_t sweeps = 0, runs = 0, metrics = 0, events = 0, checkpoints = 0, nodes = 0;
};
// Copies every sweep, run, metric, event, checkpoint record and node report from `from` into
// `to`; what `to` already holds is kept, so copying twice changes nothing. A run (or sweep) of
// `from` whose id `to` holds for a different one (another creation time or recipe) is a clash:
// the copy is refused before anything is written, naming both, never merged.
StoreCopy copy_store(const Store& from, Store& to);
double unix_now();

}  // namespace dsrun
