#include "storage/store.hpp"

#include "engine/common/error.hpp"
#include "engine/common/file_descriptor.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

namespace dsrun {

namespace {

using Rows = SqlRows;

// Migrations, in order; migration i brings the schema to version i + 1. Never edit a shipped one.
// The PostgreSQL backend arrived at version 5: its first script creates version 5's schema whole
// (types spelled as PostgreSQL names them, a trigger function for metrics_latest), the next four
// have nothing left to do.
struct Migration {
  const char* sqlite;
  const char* postgres;
};

const char* const kPostgresVersion5 = R"sql(
CREATE TABLE runs(
  rowid BIGSERIAL UNIQUE,
  id TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at DOUBLE PRECISION NOT NULL,
  started_at DOUBLE PRECISION,
  ended_at DOUBLE PRECISION,
  heartbeat_at DOUBLE PRECISION,
  recipe_path TEXT,
  recipe_text TEXT NOT NULL,
  config_toml TEXT NOT NULL,
  plan_json TEXT,
  plan_text TEXT,
  model TEXT,
  hardware TEXT,
  zero_stage BIGINT,
  world_size BIGINT,
  host TEXT,
  git_revision TEXT,
  parent_run TEXT REFERENCES runs(id),
  parent_step BIGINT,
  sweep_id TEXT,
  error TEXT,
  deleted_at DOUBLE PRECISION,
  trial_index BIGINT,
  trial_params TEXT,
  config_json TEXT,
  pid BIGINT
);
CREATE INDEX runs_created ON runs(created_at);
CREATE INDEX runs_status ON runs(status);
CREATE INDEX runs_sweep ON runs(sweep_id, trial_index);
CREATE TABLE metrics(
  run_id TEXT NOT NULL REFERENCES runs(id),
  key TEXT NOT NULL,
  step BIGINT NOT NULL,
  value DOUBLE PRECISION NOT NULL,
  time DOUBLE PRECISION NOT NULL,
  PRIMARY KEY(run_id, key, step)
);
CREATE TABLE metrics_latest(
  run_id TEXT NOT NULL,
  key TEXT NOT NULL,
  step BIGINT NOT NULL,
  value DOUBLE PRECISION NOT NULL,
  time DOUBLE PRECISION NOT NULL,
  PRIMARY KEY(run_id, key)
);
CREATE FUNCTION dsrun_keep_latest() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO metrics_latest(run_id, key, step, value, time) VALUES (NEW.run_id, NEW.key, NEW.step, NEW.value, NEW.time)
  ON CONFLICT(run_id, key) DO UPDATE SET step = excluded.step, value = excluded.value, time = excluded.time
  WHERE excluded.step >= metrics_latest.step;
  RETURN NEW;
END $$;
CREATE TRIGGER metrics_keep_latest AFTER INSERT OR UPDATE ON metrics FOR EACH ROW EXECUTE FUNCTION dsrun_keep_latest();
CREATE TABLE checkpoints(
  run_id TEXT NOT NULL REFERENCES runs(id),
  step BIGINT NOT NULL,
  path TEXT NOT NULL,
  bytes BIGINT NOT NULL,
  checksum TEXT NOT NULL,
  created_at DOUBLE PRECISION NOT NULL,
  PRIMARY KEY(run_id, step)
);
CREATE TABLE events(
  id BIGSERIAL PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(id),
  time DOUBLE PRECISION NOT NULL,
  kind TEXT NOT NULL,
  rank BIGINT,
  message TEXT NOT NULL,
  detail TEXT
);
CREATE INDEX events_run ON events(run_id, id);
CREATE TABLE sweeps(
  rowid BIGSERIAL UNIQUE,
  id TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at DOUBLE PRECISION NOT NULL,
  ended_at DOUBLE PRECISION,
  heartbeat_at DOUBLE PRECISION,
  recipe_path TEXT NOT NULL,
  recipe_text TEXT NOT NULL,
  spec_json TEXT NOT NULL,
  host TEXT,
  pid BIGINT,
  best_run TEXT,
  error TEXT
);
-- `history --where optimizer.lr > 1e-4`: a config value as a number (JSON true/false as 1/0, as
-- SQLite's json_extract reads them), NULL when it is text or absent.
CREATE FUNCTION dsrun_json_number(doc TEXT, key TEXT) RETURNS DOUBLE PRECISION LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE jsonb_typeof(doc::jsonb -> key)
           WHEN 'number' THEN (doc::jsonb ->> key)::double precision
           WHEN 'boolean' THEN CASE WHEN (doc::jsonb -> key) = 'true'::jsonb THEN 1.0 ELSE 0.0 END
         END
$$;
)sql";

// Version 6, the same on both: the batch job behind a run, and each node's own report.
#define DSRUN_VERSION6_COMMON                                                          \
  "ALTER TABLE runs ADD COLUMN job_id TEXT;\n"                                         \
  "ALTER TABLE runs ADD COLUMN job_state TEXT;\n"                                      \
  "ALTER TABLE runs ADD COLUMN job_nodes TEXT;\n"                                      \
  "ALTER TABLE runs ADD COLUMN job_reason TEXT;\n"                                     \
  "ALTER TABLE sweeps ADD COLUMN job_id TEXT;\n"                                       \
  "CREATE TABLE run_nodes(\n"                                                          \
  "  run_id TEXT NOT NULL REFERENCES runs(id),\n"                                      \
  "  node_rank INTEGER NOT NULL,\n"                                                    \
  "  host TEXT,\n"                                                                     \
  "  pid BIGINT,\n"                                                                    \
  "  status TEXT NOT NULL,\n"                                                          \
  "  heartbeat_at DOUBLE PRECISION,\n"                                                 \
  "  restarts INTEGER NOT NULL DEFAULT 0,\n"                                           \
  "  error TEXT,\n"                                                                    \
  "  PRIMARY KEY(run_id, node_rank)\n"                                                 \
  ");\n"                                                                               \
  "CREATE INDEX runs_job ON runs(job_id);\n"

const Migration kMigrations[] = {
    // 1: runs, metrics, checkpoints, events
    {R"sql(
CREATE TABLE runs(
  id TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at REAL NOT NULL,
  started_at REAL,
  ended_at REAL,
  heartbeat_at REAL,
  recipe_path TEXT,
  recipe_text TEXT NOT NULL,
  config_toml TEXT NOT NULL,
  plan_json TEXT,
  plan_text TEXT,
  model TEXT,
  hardware TEXT,
  zero_stage INTEGER,
  world_size INTEGER,
  host TEXT,
  git_revision TEXT,
  parent_run TEXT REFERENCES runs(id),
  parent_step INTEGER,
  sweep_id TEXT,
  error TEXT
);
CREATE INDEX runs_created ON runs(created_at);
CREATE TABLE metrics(
  run_id TEXT NOT NULL REFERENCES runs(id),
  key TEXT NOT NULL,
  step INTEGER NOT NULL,
  value REAL NOT NULL,
  time REAL NOT NULL,
  PRIMARY KEY(run_id, key, step)
) WITHOUT ROWID;
CREATE TABLE checkpoints(
  run_id TEXT NOT NULL REFERENCES runs(id),
  step INTEGER NOT NULL,
  path TEXT NOT NULL,
  bytes INTEGER NOT NULL,
  checksum TEXT NOT NULL,
  created_at REAL NOT NULL,
  PRIMARY KEY(run_id, step)
);
CREATE TABLE events(
  id INTEGER PRIMARY KEY,
  run_id TEXT NOT NULL REFERENCES runs(id),
  time REAL NOT NULL,
  kind TEXT NOT NULL,
  rank INTEGER,
  message TEXT NOT NULL,
  detail TEXT
);
CREATE INDEX events_run ON events(run_id, id);
)sql",
     kPostgresVersion5},
    // 2: latest value per metric kept by a trigger (history shows it without scanning metrics),
    //    soft delete, and a status index.
    {R"sql(
CREATE TABLE metrics_latest(
  run_id TEXT NOT NULL,
  key TEXT NOT NULL,
  step INTEGER NOT NULL,
  value REAL NOT NULL,
  time REAL NOT NULL,
  PRIMARY KEY(run_id, key)
) WITHOUT ROWID;
INSERT INTO metrics_latest(run_id, key, step, value, time)
  SELECT m.run_id, m.key, m.step, m.value, m.time FROM metrics m
  WHERE m.step = (SELECT MAX(step) FROM metrics WHERE run_id = m.run_id AND key = m.key);
CREATE TRIGGER metrics_keep_latest AFTER INSERT ON metrics BEGIN
  INSERT INTO metrics_latest(run_id, key, step, value, time) VALUES (NEW.run_id, NEW.key, NEW.step, NEW.value, NEW.time)
  ON CONFLICT(run_id, key) DO UPDATE SET step = excluded.step, value = excluded.value, time = excluded.time
  WHERE excluded.step >= metrics_latest.step;
END;
ALTER TABLE runs ADD COLUMN deleted_at REAL;
CREATE INDEX runs_status ON runs(status);
)sql",
     "SELECT 1"},
    // 3: sweeps, and each trial's index and parameters on its run.
    {R"sql(
CREATE TABLE sweeps(
  id TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at REAL NOT NULL,
  ended_at REAL,
  heartbeat_at REAL,
  recipe_path TEXT NOT NULL,
  recipe_text TEXT NOT NULL,
  spec_json TEXT NOT NULL,
  host TEXT,
  pid INTEGER,
  best_run TEXT,
  error TEXT
);
ALTER TABLE runs ADD COLUMN trial_index INTEGER;
ALTER TABLE runs ADD COLUMN trial_params TEXT;
CREATE INDEX runs_sweep ON runs(sweep_id, trial_index);
)sql",
     "SELECT 1"},
    // 4: the resolved config as flat JSON, for `history --where optimizer.lr > 1e-4`.
    {R"sql(
ALTER TABLE runs ADD COLUMN config_json TEXT;
)sql",
     "SELECT 1"},
    // 5: the launcher's process id (with runs.host and runs.heartbeat_at: is a running run's
    //    launcher still alive?).
    {R"sql(
ALTER TABLE runs ADD COLUMN pid INTEGER;
)sql",
     "SELECT 1"},
    // 6: the batch job behind a run (Slurm), each node's report; SQLite's metrics_latest also
    //    follows an upsert's update path.
    {DSRUN_VERSION6_COMMON
     "CREATE TRIGGER metrics_keep_latest_update AFTER UPDATE ON metrics BEGIN\n"
     "  INSERT INTO metrics_latest(run_id, key, step, value, time) VALUES (NEW.run_id, NEW.key, NEW.step, NEW.value, NEW.time)\n"
     "  ON CONFLICT(run_id, key) DO UPDATE SET step = excluded.step, value = excluded.value, time = excluded.time\n"
     "  WHERE excluded.step >= metrics_latest.step;\n"
     "END;\n",
     DSRUN_VERSION6_COMMON},
};
constexpr int kSchemaVersion = sizeof(kMigrations) / sizeof(kMigrations[0]);

std::vector<std::string> migration_scripts(SqlDialect dialect, int target_version) {
  std::vector<std::string> out;
  for (int v = 0; v < target_version; ++v) out.push_back(dialect == SqlDialect::Sqlite ? kMigrations[v].sqlite : kMigrations[v].postgres);
  return out;
}

std::string random_id() {
  unsigned char bytes[4];
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  urandom.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  if (!urandom) fail_at(__FILE__, __LINE__, "cannot read /dev/urandom for a run id");
  char out[9];
  std::snprintf(out, sizeof out, "%02x%02x%02x%02x", bytes[0], bytes[1], bytes[2], bytes[3]);
  return out;
}

bool transition_allowed(RunStatus from, RunStatus to) {
  switch (to) {
    case RunStatus::Running: return from != RunStatus::Running && from != RunStatus::Infeasible;
    case RunStatus::Infeasible: return from == RunStatus::Planned;
    case RunStatus::Planned: return false;
    // (lost: a launcher only silent for a while, back to record its end)
    default: return from == RunStatus::Running || from == RunStatus::Planned || from == RunStatus::Lost;
  }
}

const char* kRunColumns =
    "id, name, status, created_at, started_at, ended_at, recipe_path, recipe_text, config_toml, plan_json, model, hardware, "
    "zero_stage, world_size, host, git_revision, parent_run, parent_step, sweep_id, error, plan_text, trial_index, trial_params, deleted_at, "
    "heartbeat_at, pid, job_id, job_state, job_nodes, job_reason, config_json";

RunRecord read_run(const SqlRow& s) {
  RunRecord r;
  r.id = s.text(0);
  r.name = s.text(1);
  r.status = run_status_from_string(s.text(2));
  r.created_at = s.real(3);
  r.started_at = s.real(4);
  r.ended_at = s.real(5);
  r.recipe_path = s.text(6);
  r.recipe_text = s.text(7);
  r.config_toml = s.text(8);
  r.plan_json = s.text(9);
  r.model = s.text(10);
  r.hardware = s.text(11);
  r.zero_stage = static_cast<int>(s.integer(12));
  r.world_size = static_cast<int>(s.integer(13));
  r.host = s.text(14);
  r.git_revision = s.text(15);
  r.parent_run = s.text(16);
  r.parent_step = s.is_null(17) ? -1 : s.integer(17);
  r.sweep_id = s.text(18);
  r.error = s.text(19);
  r.plan_text = s.text(20);
  r.trial_index = s.is_null(21) ? -1 : s.integer(21);
  r.trial_params = s.text(22);
  r.deleted_at = s.real(23);
  r.heartbeat_at = s.real(24);
  r.pid = s.is_null(25) ? 0 : s.integer(25);
  r.job_id = s.text(26);
  r.job_state = s.text(27);
  r.job_nodes = s.text(28);
  r.job_reason = s.text(29);
  r.config_json = s.text(30);
  return r;
}

std::vector<RunRecord> read_runs(const Rows& rows) {
  std::vector<RunRecord> out;
  out.reserve(rows.size());
  for (const auto& row : rows) out.push_back(read_run(row));
  return out;
}

const char* kSweepColumns = "id, name, status, created_at, ended_at, heartbeat_at, recipe_path, recipe_text, spec_json, host, pid, best_run, error";

SweepRecord read_sweep(const SqlRow& s) {
  SweepRecord w;
  w.id = s.text(0);
  w.name = s.text(1);
  w.status = s.text(2);
  w.created_at = s.real(3);
  w.ended_at = s.real(4);
  w.heartbeat_at = s.real(5);
  w.recipe_path = s.text(6);
  w.recipe_text = s.text(7);
  w.spec_json = s.text(8);
  w.host = s.text(9);
  w.pid = s.integer(10);
  w.best_run = s.text(11);
  w.error = s.text(12);
  return w;
}

// A fresh id that no row of `table` has (read inside the caller's transaction).
std::string unused_id(Database& db, const char* table, const std::string& prefix) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    const std::string candidate = prefix + random_id().substr(prefix.size());
    if (db.query(std::string("SELECT 1 FROM ") + table + " WHERE id = ?", {candidate}).empty()) return candidate;
  }
  fail_at(__FILE__, __LINE__, "16 random 32-bit ids collided");
}

}  // namespace

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const char* to_string(RunStatus s) {
  switch (s) {
    case RunStatus::Planned: return "planned";
    case RunStatus::Running: return "running";
    case RunStatus::Finished: return "finished";
    case RunStatus::Failed: return "failed";
    case RunStatus::Killed: return "killed";
    case RunStatus::Infeasible: return "infeasible";
    case RunStatus::Pruned: return "pruned";
    case RunStatus::Lost: return "lost";
  }
  return "?";
}

RunStatus run_status_from_string(const std::string& s) {
  for (RunStatus st : {RunStatus::Planned, RunStatus::Running, RunStatus::Finished, RunStatus::Failed, RunStatus::Killed,
                       RunStatus::Infeasible, RunStatus::Pruned, RunStatus::Lost})
    if (s == to_string(st)) return st;
  ErrorContext c;
  c.hint = "use planned, running, finished, failed, killed, infeasible, pruned or lost";
  throw Error("unknown run status \"" + s + "\"", c);
}

std::string runs_directory(const std::string& location) {
  if (is_postgres_location(location)) {
    const char* dir = std::getenv("DSRUN_RUNS_DIR");
    return dir && *dir ? dir : "runs";
  }
  return parent_directory(location);
}

bool store_exists(const std::string& location) {
  struct stat st {};
  return is_postgres_location(location) || ::stat(location.c_str(), &st) == 0;
}

void migrate_store(Database& db, int target_version) { db.migrate(migration_scripts(db.dialect(), target_version)); }

Store::Store(const std::string& location) : db_(open_database(location)) { migrate_store(*db_, kSchemaVersion); }

int Store::current_schema_version() { return kSchemaVersion; }
int Store::schema_version() const { return db_->schema_version(); }

std::string Store::create_run(const NewRun& run) {
  std::string id;
  db_->transaction([&] {
    id = unused_id(*db_, "runs", "");
    db_->query("INSERT INTO runs(id, name, status, created_at, recipe_path, recipe_text, config_toml, plan_json, model, hardware, "
               "zero_stage, world_size, host, git_revision, parent_run, parent_step, sweep_id, plan_text, trial_index, trial_params, config_json) "
               "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
               {id, run.name, to_string(run.status), unix_now(), run.recipe_path, run.recipe_text, run.config_toml, run.plan_json, run.model,
                run.hardware, run.zero_stage, run.world_size, run.host, SqlValue::text_or_null(run.git_revision),
                SqlValue::text_or_null(run.parent_run), SqlValue::integer_or_null(run.parent_step, run.parent_step >= 0),
                SqlValue::text_or_null(run.sweep_id), run.plan_text, SqlValue::integer_or_null(run.trial_index, run.trial_index >= 0),
                SqlValue::text_or_null(run.trial_params), SqlValue::text_or_null(run.config_json)});
  });
  return id;
}

void Store::complete_run(const std::string& run_id, const NewRun& run) {
  db_->query("UPDATE runs SET recipe_path = ?, recipe_text = ?, config_toml = ?, plan_json = ?, plan_text = ?, model = ?, hardware = ?, zero_stage = ?, "
             "world_size = ?, host = ?, git_revision = ?, config_json = ? WHERE id = ?",
             {run.recipe_path, run.recipe_text, run.config_toml, run.plan_json, run.plan_text, run.model, run.hardware, run.zero_stage, run.world_size, run.host,
              SqlValue::text_or_null(run.git_revision), SqlValue::text_or_null(run.config_json), run_id});
}

namespace {
// A write as one line of the launcher's journal (Store::journal_writes_to); file names and
// messages need not be UTF-8.
// Each carries the time it was made: replayed later, its rows and events keep that time.
std::string journal_line(nlohmann::json entry) {
  entry["time"] = unix_now();
  return entry.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}
}  // namespace

double Store::write_time() const { return written_at_ > 0 ? written_at_ : unix_now(); }

void Store::set_status(const std::string& run_id, RunStatus status, const std::string& error) {
  write([&] {
    db_->transaction([&] {
      RunStatus from = get_run(run_id).status;
      if (!transition_allowed(from, status)) {
        ErrorContext c;
        c.key = run_id;
        throw Error(std::string("run cannot go from ") + to_string(from) + " to " + to_string(status), c);
      }
      const double now = write_time();
      const std::string st = to_string(status);
      db_->query("UPDATE runs SET status = ?1, error = CASE WHEN ?1 = 'running' THEN NULL ELSE COALESCE(?2, error) END, "
                 "started_at = CASE WHEN ?1 = 'running' THEN COALESCE(started_at, ?3) ELSE started_at END, "
                 "ended_at = CASE WHEN ?1 IN ('finished','failed','killed','pruned','infeasible','lost') THEN ?3 ELSE NULL END WHERE id = ?4",
                 {st, SqlValue::text_or_null(error), now, run_id});
    });
  }, [&] { return journal_line({{"op", "status"}, {"run", run_id}, {"status", to_string(status)}, {"error", error}}); });
}

bool Store::set_status_if(const std::string& run_id, RunStatus from, RunStatus to, const std::string& error) {
  DSRUN_ASSERT(transition_allowed(from, to), "a conditional status change the store allows");
  const SqlRows changed = db_->query(
      "UPDATE runs SET status = ?1, error = ?2, ended_at = CASE WHEN ?1 IN ('finished','failed','killed','pruned','infeasible','lost') THEN ?3 ELSE NULL END "
      "WHERE id = ?4 AND status = ?5 RETURNING id",
      {std::string(to_string(to)), SqlValue::text_or_null(error), unix_now(), run_id, std::string(to_string(from))});
  return !changed.empty();
}

bool Store::claim_run(const std::string& run_id, RunStatus status, double heartbeat_at, const std::string& host, int64_t pid) {
  // One statement: the database decides which of two concurrent claims matches the row.
  const double now = unix_now();
  const SqlRows claimed = db_->query(
      "UPDATE runs SET status = 'running', error = NULL, ended_at = NULL, started_at = COALESCE(started_at, ?1), heartbeat_at = ?1, host = ?2, pid = ?3 "
      "WHERE id = ?4 AND status = ?5 AND (?5 <> 'running' OR COALESCE(heartbeat_at, 0) = ?6) RETURNING id",
      {now, host, pid, run_id, std::string(to_string(status)), heartbeat_at});
  return !claimed.empty();
}

void Store::add_metrics(const std::string& run_id, int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  write([&] {
    db_->transaction([&] {
      // A (run, key, step) row stays unique: a step recorded again after a resume overwrites, never duplicates.
      const double now = write_time();
      for (const auto& [key, value] : values)
        db_->query("INSERT INTO metrics(run_id, key, step, value, time) VALUES(?,?,?,?,?) "
                   "ON CONFLICT(run_id, key, step) DO UPDATE SET value = excluded.value, time = excluded.time",
                   {run_id, key, step, value, now});
      db_->query("UPDATE runs SET heartbeat_at = ? WHERE id = ?", {now, run_id});
    });
  }, [&] { return journal_line({{"op", "metrics"}, {"run", run_id}, {"step", step}, {"values", values}}); });
}

void Store::run_heartbeat(const std::string& run_id, const std::string& host, int64_t pid) {
  write([&] {
    // A run a reader marked lost while its launcher was only silent is running again.
    const SqlRows back = db_->query("UPDATE runs SET status = 'running', error = NULL, ended_at = NULL WHERE id = ? AND status = 'lost' AND pid = ? RETURNING id", {run_id, pid});
    if (!back.empty()) add_event(run_id, "running", -1, "its launcher (process " + std::to_string(pid) + " on " + host + ") was heard from again: running, not lost");
    db_->query("UPDATE runs SET heartbeat_at = ?, host = ?, pid = ? WHERE id = ?", {unix_now(), host, pid, run_id});
  }, [&] { return std::string(); });
}

void Store::add_event(const std::string& run_id, const std::string& kind, int rank, const std::string& message, const std::string& detail) {
  write([&] {
    db_->query("INSERT INTO events(run_id, time, kind, rank, message, detail) VALUES(?,?,?,?,?,?)",
               {run_id, write_time(), kind, SqlValue::integer_or_null(rank, rank >= 0), message, SqlValue::text_or_null(detail)});
  }, [&] { return journal_line({{"op", "event"}, {"run", run_id}, {"kind", kind}, {"rank", rank}, {"message", message}, {"detail", detail}}); });
}

void Store::add_checkpoint(const std::string& run_id, const CheckpointRecord& c) {
  write([&] {
    db_->query("INSERT INTO checkpoints(run_id, step, path, bytes, checksum, created_at) VALUES(?,?,?,?,?,?) "
               "ON CONFLICT(run_id, step) DO UPDATE SET path = excluded.path, bytes = excluded.bytes, checksum = excluded.checksum, "
               "created_at = excluded.created_at",
               {run_id, c.step, c.path, c.bytes, c.checksum, c.created_at > 0 ? c.created_at : unix_now()});
  }, [&] { return journal_line({{"op", "checkpoint"}, {"run", run_id}, {"step", c.step}, {"path", c.path}, {"bytes", c.bytes}, {"checksum", c.checksum}, {"created_at", c.created_at > 0 ? c.created_at : unix_now()}}); });
}

void Store::remove_checkpoint(const std::string& run_id, const std::string& path) {
  write([&] {
    db_->query("DELETE FROM checkpoints WHERE run_id = ? AND path = ?", {run_id, path});
  }, [&] { return journal_line({{"op", "remove_checkpoint"}, {"run", run_id}, {"path", path}}); });
}

void Store::update_plan(const std::string& run_id, const std::string& config_toml, const std::string& plan_json, const std::string& plan_text,
                        int zero_stage, int world_size) {
  db_->query("UPDATE runs SET config_toml = ?, plan_json = ?, plan_text = ?, zero_stage = ?, world_size = ? WHERE id = ?",
             {config_toml, plan_json, plan_text, zero_stage, world_size, run_id});
}

std::string Store::resolve_run(const std::string& query, bool include_deleted) const {
  std::vector<std::string> matches;
  const SqlValue deleted_too = include_deleted ? 1 : 0;
  for (const auto& row : db_->query("SELECT id FROM runs WHERE substr(id, 1, length(?1)) = ?1 AND (deleted_at IS NULL OR ?2 = 1) "
                                    "ORDER BY created_at DESC",
                                    {query, deleted_too}))
    matches.push_back(row.text(0));
  if (matches.empty())
    for (const auto& row : db_->query("SELECT id FROM runs WHERE name = ?1 AND (deleted_at IS NULL OR ?2 = 1) ORDER BY created_at DESC", {query, deleted_too}))
      matches.push_back(row.text(0));
  ErrorContext c;
  c.file = path();
  c.key = query;
  if (matches.empty()) {
    c.hint = "`dsrun history` lists the runs";
    throw Error("no run with that id, id prefix or name", c);
  }
  if (matches.size() > 1 && matches[0] != query) {
    std::string list;
    for (size_t i = 0; i < matches.size() && i < 5; ++i) list += (i ? ", " : "") + matches[i];
    c.hint = "give more characters of the id: " + list;
    throw Error(std::to_string(matches.size()) + " runs match", c);
  }
  return matches[0];
}

RunRecord Store::get_run(const std::string& run_id) const {
  Rows rows = db_->query(std::string("SELECT ") + kRunColumns + " FROM runs WHERE id = ?", {run_id});
  if (rows.empty()) {
    ErrorContext c;
    c.file = path();
    c.key = run_id;
    throw Error("no such run", c);
  }
  return read_run(rows[0]);
}

std::vector<RunRecord> Store::list_runs(const RunListOptions& o) const {
  return read_runs(db_->query(std::string("SELECT ") + kRunColumns +
                                  " FROM runs WHERE deleted_at IS NULL AND (?1 = '' OR status = ?1) "
                                  "AND (?3 = '' OR sweep_id = ?3) ORDER BY created_at DESC, rowid DESC LIMIT ?2",
                              {o.status, o.limit, o.sweep}));
}

std::vector<RunRecord> Store::query_runs(const RunQuery& q) const {
  std::string sql = std::string("SELECT ") + kRunColumns + " FROM runs WHERE " + (q.deleted ? "deleted_at IS NOT NULL" : "deleted_at IS NULL");
  std::vector<SqlFragment::Param> params;
  auto text = [&](const std::string& clause, const std::string& value) {
    if (value.empty()) return;
    sql += clause;
    params.push_back({false, 0, value});
  };
  text(" AND status = ?", q.status);
  text(" AND sweep_id = ?", q.sweep);
  // A substring, wildcards escaped; ASCII case folded on both backends (SQLite's LIKE does).
  const char* like = dialect() == SqlDialect::Postgres ? " ILIKE ? ESCAPE '\\'" : " LIKE ? ESCAPE '\\'";
  auto contains = [&](const char* column, const std::string& value) {
    if (value.empty()) return;
    std::string pattern = "%";
    for (char c : value) pattern += (c == '%' || c == '_' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    text(std::string(" AND ") + column + like, pattern + "%");
  };
  contains("model", q.model);
  contains("hardware", q.hardware);
  contains("recipe_path", q.recipe);
  if (q.since_seconds > 0) {
    sql += " AND created_at >= ?";
    params.push_back({true, unix_now() - q.since_seconds, ""});
  }
  QueryNames names = q.names;
  names.dialect = dialect();
  if (!q.where.empty()) {
    const SqlFragment where = parse_where(q.where, names);
    sql += " AND (" + where.sql + ")";
    params.insert(params.end(), where.params.begin(), where.params.end());
  }
  if (!q.sort.empty()) {
    // Runs without the sort value (a metric never recorded) go last either way.
    const SqlFragment sort = sort_expression(q.sort, names);
    sql += " ORDER BY (" + sort.sql + ") IS NULL, (" + sort.sql + ")" + (q.ascending ? " ASC" : " DESC") + ", created_at DESC";
    params.insert(params.end(), sort.params.begin(), sort.params.end());
    params.insert(params.end(), sort.params.begin(), sort.params.end());
  } else {
    sql += std::string(" ORDER BY created_at ") + (q.ascending ? "ASC" : "DESC") + ", rowid DESC";
  }
  sql += " LIMIT ?";
  params.push_back({true, static_cast<double>(q.limit), ""});
  std::vector<SqlValue> values;
  for (const auto& p : params) {
    if (!p.is_number) values.emplace_back(p.text);
    else if (std::floor(p.number) == p.number && std::fabs(p.number) < 9e15) values.emplace_back(static_cast<int64_t>(p.number));
    else values.emplace_back(p.number);
  }
  return read_runs(db_->query(sql, values));
}

void Store::set_deleted(const std::string& run_id, bool deleted) {
  db_->query("UPDATE runs SET deleted_at = ? WHERE id = ?", {deleted ? SqlValue(unix_now()) : SqlValue(), run_id});
}

int64_t Store::count_runs() const { return db_->query("SELECT count(*) FROM runs WHERE deleted_at IS NULL").at(0).integer(0); }

std::map<std::string, MetricValue> Store::latest_metrics(const std::string& run_id) const {
  std::map<std::string, MetricValue> out;
  for (const auto& s : db_->query("SELECT key, step, value, time FROM metrics_latest WHERE run_id = ?", {run_id}))
    out[s.text(0)] = {s.integer(1), s.real(2), s.real(3)};
  return out;
}

std::vector<MetricValue> Store::metric_history(const std::string& run_id, const std::string& key) const {
  std::vector<MetricValue> out;
  for (const auto& s : db_->query("SELECT step, value, time FROM metrics WHERE run_id = ? AND key = ? ORDER BY step", {run_id, key}))
    out.push_back({s.integer(0), s.real(1), s.real(2)});
  return out;
}

std::vector<EventRecord> Store::events(const std::string& run_id) const {
  std::vector<EventRecord> out;
  for (const auto& s : db_->query("SELECT id, time, kind, rank, message, detail FROM events WHERE run_id = ? ORDER BY id", {run_id}))
    out.push_back({s.integer(0), s.real(1), s.text(2), s.is_null(3) ? -1 : static_cast<int>(s.integer(3)), s.text(4), s.text(5)});
  return out;
}

std::vector<CheckpointRecord> Store::checkpoints(const std::string& run_id) const {
  std::vector<CheckpointRecord> out;
  for (const auto& s : db_->query("SELECT step, path, bytes, checksum, created_at FROM checkpoints WHERE run_id = ? ORDER BY step", {run_id}))
    out.push_back({s.integer(0), s.text(1), s.integer(2), s.text(3), s.real(4)});
  return out;
}

void Store::report_node(const std::string& run_id, const NodeReport& r) {
  write([&] {
    db_->query("INSERT INTO run_nodes(run_id, node_rank, host, pid, status, heartbeat_at, restarts, error) VALUES(?,?,?,?,?,?,?,?) "
               "ON CONFLICT(run_id, node_rank) DO UPDATE SET host = excluded.host, pid = excluded.pid, status = excluded.status, "
               "heartbeat_at = excluded.heartbeat_at, restarts = excluded.restarts, error = excluded.error",
               {run_id, r.node_rank, r.host, r.pid, r.status, write_time(), r.restarts, SqlValue::text_or_null(r.error)});
  }, [&] { return journal_line({{"op", "node"}, {"run", run_id}, {"node_rank", r.node_rank}, {"host", r.host}, {"pid", r.pid}, {"status", r.status}, {"restarts", r.restarts}, {"error", r.error}}); });
}

std::vector<NodeRecord> Store::nodes(const std::string& run_id) const {
  std::vector<NodeRecord> out;
  for (const auto& s : db_->query("SELECT node_rank, host, pid, status, restarts, error, heartbeat_at FROM run_nodes WHERE run_id = ? ORDER BY node_rank",
                                  {run_id})) {
    NodeRecord n;
    n.node_rank = static_cast<int>(s.integer(0));
    n.host = s.text(1);
    n.pid = s.integer(2);
    n.status = s.text(3);
    n.restarts = static_cast<int>(s.integer(4));
    n.error = s.text(5);
    n.heartbeat_at = s.real(6);
    out.push_back(n);
  }
  return out;
}

void Store::set_job(const std::string& run_id, const std::string& job_id, const std::string& job_state, const std::string& job_nodes,
                    const std::string& job_reason) {
  db_->query("UPDATE runs SET job_id = COALESCE(?, job_id), job_state = COALESCE(?, job_state), job_nodes = COALESCE(?, job_nodes), "
             "job_reason = ? WHERE id = ?",
             {SqlValue::text_or_null(job_id), SqlValue::text_or_null(job_state), SqlValue::text_or_null(job_nodes), SqlValue::text_or_null(job_reason),
              run_id});
}

std::vector<RunRecord> Store::runs_with_open_jobs(const std::vector<std::string>& final_states) const {
  std::string marks;
  std::vector<SqlValue> params;
  for (const auto& s : final_states) {
    marks += marks.empty() ? "?" : ",?";
    params.emplace_back(s);
  }
  return read_runs(db_->query(std::string("SELECT ") + kRunColumns + " FROM runs WHERE job_id IS NOT NULL AND deleted_at IS NULL AND "
                                  "(status IN ('planned', 'running') OR job_state IS NULL OR job_state NOT IN (" + (marks.empty() ? "''" : marks) + "))",
                              params));
}

std::string Store::find_job_run(const std::string& job_id, double since) const {
  Rows rows = db_->query("SELECT id FROM runs WHERE job_id = ? AND status IN ('planned', 'running') AND created_at >= ? "
                         "AND deleted_at IS NULL ORDER BY created_at DESC LIMIT 1",
                         {job_id, since});
  return rows.empty() ? "" : rows[0].text(0);
}

void Store::set_sweep_job(const std::string& sweep_id, const std::string& job_id) {
  db_->query("UPDATE sweeps SET job_id = ? WHERE id = ?", {job_id, sweep_id});
}

std::string Store::sweep_job(const std::string& sweep_id) const {
  Rows rows = db_->query("SELECT job_id FROM sweeps WHERE id = ?", {sweep_id});
  return rows.empty() ? "" : rows[0].text(0);
}

std::string Store::create_sweep(const SweepRecord& w) {
  std::string id;
  db_->transaction([&] {
    id = unused_id(*db_, "sweeps", "s");
    const double now = unix_now();
    db_->query("INSERT INTO sweeps(id, name, status, created_at, heartbeat_at, recipe_path, recipe_text, spec_json, host, pid) VALUES(?,?,?,?,?,?,?,?,?,?)",
               {id, w.name, "running", now, now, w.recipe_path, w.recipe_text, w.spec_json, w.host, w.pid});
  });
  return id;
}

void Store::update_sweep(const std::string& id, const std::string& status, const std::string& best_run, const std::string& error, int64_t pid) {
  const double now = unix_now();
  db_->query("UPDATE sweeps SET status = ?, best_run = ?, error = ?, heartbeat_at = ?, pid = ?, ended_at = ? WHERE id = ?",
             {status, SqlValue::text_or_null(best_run), SqlValue::text_or_null(error), now, pid, status != "running" ? SqlValue(now) : SqlValue(), id});
}

void Store::sweep_heartbeat(const std::string& id) { db_->query("UPDATE sweeps SET heartbeat_at = ? WHERE id = ?", {unix_now(), id}); }

SweepRecord Store::get_sweep(const std::string& id_prefix) const {
  std::vector<SweepRecord> found;
  for (const auto& row : db_->query(std::string("SELECT ") + kSweepColumns +
                                        " FROM sweeps WHERE substr(id, 1, length(?1)) = ?1 OR name = ?1 ORDER BY created_at DESC",
                                    {id_prefix}))
    found.push_back(read_sweep(row));
  if (found.size() == 1) return found[0];
  ErrorContext c;
  c.file = path();
  c.key = "sweep";
  if (found.empty()) {
    c.hint = "dsrun history lists runs with their sweep ids";
    throw Error("no sweep \"" + id_prefix + "\"", c);
  }
  std::string ids;
  for (size_t i = 0; i < found.size() && i < 5; ++i) ids += (i ? ", " : "") + found[i].id;
  c.hint = "give more characters: " + ids;
  throw Error(std::to_string(found.size()) + " sweeps match \"" + id_prefix + "\"", c);
}

std::vector<RunRecord> Store::sweep_trials(const std::string& sweep_id) const {
  return read_runs(db_->query(std::string("SELECT ") + kRunColumns +
                                  " FROM runs WHERE sweep_id = ? AND deleted_at IS NULL ORDER BY trial_index, created_at, rowid",
                              {sweep_id}));
}

std::vector<RunRecord> Store::children(const std::string& run_id) const {
  return read_runs(db_->query(std::string("SELECT ") + kRunColumns + " FROM runs WHERE parent_run = ? AND deleted_at IS NULL ORDER BY created_at, rowid",
                              {run_id}));
}

namespace {

// One table's rows copied as they are: columns listed, a row the destination already holds (by its
// key) left alone. `order` puts parents before children (runs reference their parent run).
int64_t copy_table(Database& from, Database& to, const std::string& table, const std::string& columns, const std::string& key,
                   const std::string& order) {
  const Rows rows = from.query("SELECT " + columns + " FROM " + table + " ORDER BY " + order);
  size_t n = 1;
  for (char c : columns) n += c == ',';
  std::string marks;
  for (size_t i = 0; i < n; ++i) marks += i ? ",?" : "?";
  const std::string insert = "INSERT INTO " + table + "(" + columns + ") VALUES(" + marks + ") ON CONFLICT(" + key + ") DO NOTHING";
  int64_t before = to.query("SELECT count(*) FROM " + table).at(0).integer(0);
  to.transaction([&] {
    for (const auto& row : rows) to.query(insert, row.cells);
  });
  return to.query("SELECT count(*) FROM " + table).at(0).integer(0) - before;
}


// Ids of `table` in both stores that name different records there: another creation time or
// recipe text (ids are 8 hex digits of randomness: two stores can draw the same one).
std::vector<std::string> clashes(Database& src, Database& dst, const std::string& table, const std::string& what) {
  std::vector<std::string> out;
  for (const auto& row : src.query("SELECT id, created_at, recipe_text, name FROM " + table + " ORDER BY id")) {
    const Rows there = dst.query("SELECT created_at, recipe_text, name FROM " + table + " WHERE id = ?", {row.text(0)});
    if (there.empty()) continue;
    if (there[0].real(0) != row.real(1) || there[0].text(1) != row.text(2))
      out.push_back(what + " " + row.text(0) + " (\"" + row.text(3) + "\" created " + std::to_string(static_cast<int64_t>(row.real(1))) + " here, \"" + there[0].text(2) +
                    "\" created " + std::to_string(static_cast<int64_t>(there[0].real(0))) + " there)");
  }
  return out;
}

}  // namespace

StoreCopy copy_store(const Store& from, Store& to) {
  Database& src = from.database();
  Database& dst = to.database();
  std::vector<std::string> clashing = clashes(src, dst, "sweeps", "sweep");
  for (const std::string& c : clashes(src, dst, "runs", "run")) clashing.push_back(c);
  if (!clashing.empty()) {
    ErrorContext c;
    c.file = to.path();
    c.hint = "these are different records under the same id: copy into a new store, or delete one of them first (dsrun delete)";
    throw Error("store copy refused: " + std::to_string(clashing.size()) + " id(s) name another record in the destination: " + join(clashing, "; "), c);
  }
  StoreCopy n;
  n.sweeps = copy_table(src, dst, "sweeps",
                        "id, name, status, created_at, ended_at, heartbeat_at, recipe_path, recipe_text, spec_json, host, pid, best_run, error, job_id", "id",
                        "created_at, id");
  n.runs = copy_table(src, dst, "runs", kRunColumns, "id", "created_at, id");
  n.metrics = copy_table(src, dst, "metrics", "run_id, key, step, value, time", "run_id, key, step", "run_id, key, step");
  n.checkpoints = copy_table(src, dst, "checkpoints", "run_id, step, path, bytes, checksum, created_at", "run_id, step", "run_id, step");
  n.nodes = copy_table(src, dst, "run_nodes", "run_id, node_rank, host, pid, status, heartbeat_at, restarts, error", "run_id, node_rank", "run_id, node_rank");
  const int64_t events_before = dst.query("SELECT count(*) FROM events").at(0).integer(0);
  // Events have no natural key: one is copied unless the destination holds the same run, time,
  // kind and message; their ids are the destination's own.
  const Rows events = src.query("SELECT run_id, time, kind, rank, message, detail FROM events ORDER BY id");
  dst.transaction([&] {
    for (const auto& e : events)
      dst.query("INSERT INTO events(run_id, time, kind, rank, message, detail) "
                "SELECT ?1, CAST(?2 AS DOUBLE PRECISION), ?3, CAST(?4 AS BIGINT), ?5, ?6 WHERE NOT EXISTS "
                "(SELECT 1 FROM events WHERE run_id = ?1 AND time = CAST(?2 AS DOUBLE PRECISION) AND kind = ?3 AND message = ?5)",
                e.cells);
  });
  n.events = dst.query("SELECT count(*) FROM events").at(0).integer(0) - events_before;
  return n;
}

// ---- the launcher's journal (Store::journal_writes_to) ----------------------------------------

namespace {
constexpr int64_t kJournalBytes = int64_t{256} << 20;
constexpr double kReplayEverySeconds = 10;
}  // namespace

void Store::journal_writes_to(const std::string& path, double reconnect_seconds) {
  journal_path_ = path;
  reconnect_seconds_ = reconnect_seconds;
  db_->set_reconnect_seconds(reconnect_seconds);
  journal_pending_ = file_size(path) > 0;  // a journal a launcher before this one left
}

void Store::write(const std::function<void()>& apply, const std::function<std::string()>& entry) {
  if (journal_path_.empty() || replaying_) return apply();
  auto journal = [&] {
    const std::string line = entry();  // (empty: a write not worth keeping, a heartbeat)
    if (!line.empty()) append_journal(line);
  };
  if (journal_pending_ && !replay_journal()) return journal();
  try {
    apply();
  } catch (const Error&) {
    // The store answered and refused: the caller's error, unless the run is gone from it (its
    // database dropped and made again, the run deleted by hand): training goes on, its writes wait.
    if (!db_->connection_lost() && !run_missing(entry())) throw;
    journal();
  }
}

bool Store::run_missing(const std::string& line) {
  const nlohmann::json e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  const std::string run = e.is_object() ? e.value("run", "") : "";
  bool missing = false;
  try {
    missing = !run.empty() && db_->query("SELECT 1 FROM runs WHERE id = ?", {run}).empty();
  } catch (const Error&) {
    return false;  // (the store cannot even say: the original error stands)
  }
  if (missing && !run_missing_said_) {
    run_missing_said_ = true;
    std::fprintf(stderr, "dsrun: warning: run %s is not in the run store %s (its database dropped and made again?): training goes on, its writes go to %s; "
                 "bring the run back (dsrun store copy from a copy of the store), then dsrun store replay %s\n",
                 run.c_str(), path().c_str(), journal_path_.c_str(), run.c_str());
  }
  run_missing_now_ = missing;
  return missing;
}

void Store::append_journal(const std::string& line) {
  if (!journal_pending_ && !run_missing_now_)
    std::fprintf(stderr, "dsrun: warning: run store %s is away: its writes go to %s, in order, until it is back\n", path().c_str(), journal_path_.c_str());
  journal_pending_ = true;
  const int64_t on_disk = file_exists(journal_path_) && !is_directory(journal_path_) ? file_size(journal_path_) : 0;
  if (on_disk + unjournaled_bytes_ + static_cast<int64_t>(line.size()) > kJournalBytes) {
    ErrorContext c;
    c.file = journal_path_;
    c.hint = "bring the store back; then `dsrun resume` the run (its checkpoints are on disk)";
    throw Error("the run store has been away too long: the journal of its writes reached " + std::to_string(kJournalBytes >> 20) + " MiB", c);
  }
  // Once a line waits in memory the rest follow it there: the file's order is the writes' order.
  if (unjournaled_.empty()) {
    FileDescriptor fd(::open(journal_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    const std::string text = line + "\n";
    const off_t before = fd.get() >= 0 ? ::lseek(fd.get(), 0, SEEK_END) : 0;
    const bool written = fd.get() >= 0 && ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fdatasync(fd.get()) == 0;
    const int saved = errno;
    // A partial line is cut off again; where even that fails, its replay reports a cut line
    // rather than apply half a write.
    if (fd.get() >= 0 && !written) (void)::ftruncate(fd.get(), before);
    if (written) return;
    std::fprintf(stderr, "dsrun: warning: cannot write the store journal %s: %s; the run's writes wait in memory until the store is back\n",
                 journal_path_.c_str(), std::strerror(saved));
  }
  unjournaled_.push_back(line);
  unjournaled_bytes_ += static_cast<int64_t>(line.size());
}

std::string Store::unjournaled_writes() const {
  if (unjournaled_.empty()) return "";
  int64_t first_step = -1, last_step = -1;
  std::map<std::string, int> others;
  for (const std::string& line : unjournaled_) {
    const nlohmann::json e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const std::string op = e.is_object() ? e.value("op", "") : "";
    if (op == "metrics") {
      const int64_t step = e.value("step", int64_t{0});
      first_step = first_step < 0 ? step : std::min(first_step, step);
      last_step = std::max(last_step, step);
    } else {
      ++others[op.empty() ? "unreadable" : op];
    }
  }
  std::vector<std::string> parts;
  if (first_step >= 0) parts.push_back("metrics of steps " + std::to_string(first_step) + "-" + std::to_string(last_step));
  for (const auto& [op, n] : others) parts.push_back(std::to_string(n) + " " + op);
  return std::to_string(unjournaled_.size()) + " writes: " + join(parts, ", ");
}

bool Store::replay_journal(bool now) {
  if (!journal_pending_) return true;
  if (!now && unix_now() < next_replay_) return false;
  next_replay_ = unix_now() + kReplayEverySeconds;
  // The file's lines not yet applied, then those that wait in memory.
  std::vector<std::string> lines;
  if (file_exists(journal_path_) && !is_directory(journal_path_))
    for (const std::string& l : split(read_file(journal_path_), '\n'))
      if (!l.empty()) lines.push_back(l);
  lines.erase(lines.begin(), lines.begin() + static_cast<std::ptrdiff_t>(std::min(replayed_file_lines_, lines.size())));
  const size_t file_lines = lines.size();
  lines.insert(lines.end(), unjournaled_.begin(), unjournaled_.end());
  size_t done = 0;
  replaying_ = true;
  // One try to reach the server, not the whole reconnect window: training waits for none of this.
  db_->set_reconnect_seconds(0);
  try {
    for (; done < lines.size(); ++done) apply_journal_entry(lines[done]);
    db_->set_reconnect_seconds(reconnect_seconds_);
  } catch (const Error&) {
    db_->set_reconnect_seconds(reconnect_seconds_);
    replaying_ = false;
    if (!db_->connection_lost() && !run_missing(lines[done])) throw;
    // What was applied leaves the journal: from memory at once; from the file by rewriting it
    // without those lines where the disk allows, else by remembering how many (a full disk must
    // not end the run: the file stays as it was, and nothing is applied twice by this process).
    const size_t from_file = std::min(done, file_lines);
    for (size_t i = 0; i < done - from_file; ++i) unjournaled_bytes_ -= static_cast<int64_t>(unjournaled_[i].size());
    unjournaled_.erase(unjournaled_.begin(), unjournaled_.begin() + static_cast<std::ptrdiff_t>(done - from_file));
    if (from_file > 0) {
      try {
        std::vector<std::string> rest(lines.begin() + static_cast<std::ptrdiff_t>(from_file), lines.begin() + static_cast<std::ptrdiff_t>(file_lines));
        write_file_atomic(journal_path_, rest.empty() ? "" : join(rest, "\n") + "\n", 0600);
        replayed_file_lines_ = 0;
      } catch (const Error& e) {
        replayed_file_lines_ += from_file;
        std::fprintf(stderr, "dsrun: warning: the store journal %s keeps %zu lines already replayed (%s); this launcher skips them\n", journal_path_.c_str(),
                     replayed_file_lines_, e.what());
      }
    }
    return false;
  }
  replaying_ = false;
  run_missing_now_ = false;
  if (file_exists(journal_path_) && !is_directory(journal_path_) && ::unlink(journal_path_.c_str()) != 0) {
    // Still there: its lines must not be applied again by this launcher or the next.
    const int saved = errno;
    replayed_file_lines_ = ::truncate(journal_path_.c_str(), 0) == 0 ? 0 : replayed_file_lines_ + file_lines;
    std::fprintf(stderr, "dsrun: warning: cannot remove the replayed store journal %s: %s\n", journal_path_.c_str(), std::strerror(saved));
  } else {
    replayed_file_lines_ = 0;
  }
  unjournaled_.clear();
  unjournaled_bytes_ = 0;
  journal_pending_ = false;
  std::fprintf(stderr, "dsrun: run store %s is back: %zu journaled write(s) replayed in order\n", path().c_str(), lines.size());
  return true;
}

void Store::apply_journal_entry(const std::string& line) {
  nlohmann::json e;
  try {
    e = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& x) {
    ErrorContext c;
    c.file = journal_path_;
    c.hint = "the journal is dsrun's own: a line was cut (a crash mid-write?); remove that line and run again";
    throw Error(std::string("unreadable store journal line: ") + x.what(), c);
  }
  const std::string op = e.value("op", ""), run = e.value("run", "");
  // The write's own time, not the replay's (a 45 s run read 96.5 s once its end was replayed).
  struct WrittenAt {
    double& at;
    ~WrittenAt() { at = 0; }
  } written{written_at_};
  written_at_ = e.contains("time") && e.at("time").is_number() ? e.at("time").get<double>() : 0;
  if (op == "status") {
    set_status(run, run_status_from_string(e.value("status", "")), e.value("error", ""));
  } else if (op == "metrics") {
    add_metrics(run, e.value("step", int64_t{0}), e.at("values").get<std::vector<std::pair<std::string, double>>>());
  } else if (op == "event") {
    add_event(run, e.value("kind", ""), e.value("rank", -1), e.value("message", ""), e.value("detail", ""));
  } else if (op == "checkpoint") {
    add_checkpoint(run, {e.value("step", int64_t{0}), e.value("path", ""), e.value("bytes", int64_t{0}), e.value("checksum", ""), e.value("created_at", 0.0)});
  } else if (op == "remove_checkpoint") {
    remove_checkpoint(run, e.value("path", ""));
  } else if (op == "node") {
    NodeReport n;
    n.node_rank = e.value("node_rank", 0);
    n.host = e.value("host", "");
    n.pid = e.value("pid", int64_t{0});
    n.status = e.value("status", "");
    n.restarts = e.value("restarts", 0);
    n.error = e.value("error", "");
    report_node(run, n);
  } else {
    ErrorContext c;
    c.file = journal_path_;
    throw Error("store journal line of unknown kind \"" + op + "\"", c);
  }
}

}  // namespace dsrun
