#include "storage/store.hpp"

#include "engine/common/error.hpp"

#include <sqlite3.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

namespace dsrun {

// The message names the store file and SQLite's reason; the statement and dsrun's source line go
// to the origin (shown with DSRUN_DEBUG=1).
[[noreturn]] static void sqlite_fail(sqlite3* db, int rc, const char* what, const char* file, int line) {
  ErrorContext c;
  const char* path = db ? sqlite3_db_filename(db, "main") : nullptr;
  c.file = path ? path : "";
  c.hint = rc == SQLITE_BUSY || rc == SQLITE_LOCKED ? "another dsrun holds the store for long; try again" :
           rc == SQLITE_FULL || rc == SQLITE_IOERR ? "check free disk space and the file system" : "";
  std::string detail = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  throw Error("run store: " + detail + " (SQLite error " + std::to_string(rc) + ")", c).with_origin(source_origin(file, line) + ": " + what);
}

// Every SQLite return code goes through this: anything but OK/ROW/DONE throws with file:line.
#define SQLITE_CHECK(db, expr)                                                            \
  do {                                                                                    \
    int rc_ = (expr);                                                                     \
    if (rc_ != SQLITE_OK && rc_ != SQLITE_ROW && rc_ != SQLITE_DONE)                      \
      sqlite_fail((db), rc_, #expr, __FILE__, __LINE__);                                  \
  } while (0)

void SqliteCloser::operator()(sqlite3* db) const { sqlite3_close_v2(db); }

namespace {

// An owned prepared statement with typed binds and reads.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) {
    const int rc = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
    if (rc != SQLITE_OK) sqlite_fail(db, rc, sql, __FILE__, __LINE__);
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int i, const std::string& v) {
    SQLITE_CHECK(db_, sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT));
    return *this;
  }
  Statement& bind(int i, int64_t v) { SQLITE_CHECK(db_, sqlite3_bind_int64(stmt_, i, v)); return *this; }
  Statement& bind(int i, int v) { return bind(i, static_cast<int64_t>(v)); }
  Statement& bind(int i, double v) { SQLITE_CHECK(db_, sqlite3_bind_double(stmt_, i, v)); return *this; }
  Statement& bind_null(int i) { SQLITE_CHECK(db_, sqlite3_bind_null(stmt_, i)); return *this; }
  Statement& bind_optional(int i, const std::string& v) { return v.empty() ? bind_null(i) : bind(i, v); }

  // True while rows come; false when done.
  bool step() {
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    sqlite_fail(db_, rc, sqlite3_sql(stmt_), __FILE__, __LINE__);
  }
  void run() {
    step();
    SQLITE_CHECK(db_, sqlite3_reset(stmt_));
  }
  std::string text(int col) const {
    const unsigned char* t = sqlite3_column_text(stmt_, col);
    return t ? std::string(reinterpret_cast<const char*>(t), sqlite3_column_bytes(stmt_, col)) : std::string();
  }
  int64_t integer(int col) const { return sqlite3_column_int64(stmt_, col); }
  double real(int col) const { return sqlite3_column_double(stmt_, col); }
  bool is_null(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
};

void exec(sqlite3* db, const char* sql) {
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) sqlite_fail(db, rc, sql, __FILE__, __LINE__);
}

// One transaction; rolled back unless commit() is reached (an exception leaves the store untouched).
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) { exec(db_, "BEGIN IMMEDIATE"); }
  ~Transaction() {
    if (!done_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);  // nothing to report: the error is already in flight
  }
  void commit() {
    exec(db_, "COMMIT");
    done_ = true;
  }

 private:
  sqlite3* db_;
  bool done_ = false;
};

// Migrations, in order; migration i brings the schema to version i + 1. Never edit a shipped one.
const char* const kMigrations[] = {
    // 1: runs, metrics, checkpoints, events
    R"sql(
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
    // 2: latest value per metric kept by a trigger (history shows it without scanning metrics),
    //    soft delete, and a status index.
    R"sql(
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
    // 3: sweeps, and each trial's index and parameters on its run.
    R"sql(
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
    // 4: the resolved config as flat JSON, for `history --where optimizer.lr > 1e-4`.
    R"sql(
ALTER TABLE runs ADD COLUMN config_json TEXT;
)sql",
    // 5: the launcher's process id (with runs.host and runs.heartbeat_at: is a running run's
    //    launcher still alive?).
    R"sql(
ALTER TABLE runs ADD COLUMN pid INTEGER;
)sql",
};
constexpr int kSchemaVersion = sizeof(kMigrations) / sizeof(kMigrations[0]);

int read_user_version(sqlite3* db) {
  Statement s(db, "PRAGMA user_version");
  s.step();
  return static_cast<int>(s.integer(0));
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
    default: return from == RunStatus::Running || from == RunStatus::Planned;
  }
}

const char* kRunColumns =
    "id, name, status, created_at, started_at, ended_at, recipe_path, recipe_text, config_toml, plan_json, model, hardware, "
    "zero_stage, world_size, host, git_revision, parent_run, parent_step, sweep_id, error, plan_text, trial_index, trial_params, deleted_at, "
    "heartbeat_at, pid";

RunRecord read_run(const Statement& s) {
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
  return r;
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
  }
  return "?";
}

RunStatus run_status_from_string(const std::string& s) {
  for (RunStatus st : {RunStatus::Planned, RunStatus::Running, RunStatus::Finished, RunStatus::Failed, RunStatus::Killed,
                       RunStatus::Infeasible, RunStatus::Pruned})
    if (s == to_string(st)) return st;
  ErrorContext c;
  c.hint = "use planned, running, finished, failed, killed, infeasible or pruned";
  throw Error("unknown run status \"" + s + "\"", c);
}

// Switches a new store to WAL (a persistent setting). SQLite answers a switch that races another
// connection with SQLITE_BUSY at once, without its busy handler, so this one retries for as long
// as the busy timeout would have waited.
void use_wal(sqlite3* db) {
  for (int attempt = 0;; ++attempt) {
    {
      Statement mode(db, "PRAGMA journal_mode");
      if (mode.step() && mode.text(0) == "wal") return;
    }
    const int rc = sqlite3_exec(db, "PRAGMA journal_mode = WAL", nullptr, nullptr, nullptr);
    if (rc == SQLITE_OK) return;
    if ((rc != SQLITE_BUSY && rc != SQLITE_LOCKED) || attempt >= 500) sqlite_fail(db, rc, "PRAGMA journal_mode = WAL", __FILE__, __LINE__);
    ::usleep(static_cast<useconds_t>(5000 + (attempt * 7919) % 15000));  // 5-20 ms, staggered
  }
}

// Creation and every migration in one exclusive transaction, the version read inside it: of many
// processes opening a new store at once, one creates it and the others find it created. A kill
// leaves the old schema or the new one.
void migrate_store(sqlite3* db, int target_version) {
  auto check_not_newer = [&](int version) {
    if (version <= kSchemaVersion) return;
    ErrorContext c;
    c.file = sqlite3_db_filename(db, "main");
    c.hint = "use a newer dsrun, or point --db at another file";
    throw Error("the run store has schema version " + std::to_string(version) + ", newer than this dsrun's " + std::to_string(kSchemaVersion), c);
  };
  int version = read_user_version(db);
  check_not_newer(version);
  if (version >= target_version) return;
  Transaction t(db);
  version = read_user_version(db);
  check_not_newer(version);
  if (version >= target_version) return;
  for (int v = version; v < target_version; ++v) exec(db, kMigrations[v]);
  exec(db, ("PRAGMA user_version = " + std::to_string(target_version)).c_str());
  t.commit();
}

Store::Store(const std::string& path) : path_(path) {
  sqlite3* raw = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &raw, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr);
  db_.reset(raw);  // owned even when opening failed, so the handle is closed
  if (rc != SQLITE_OK) {
    ErrorContext c;
    c.file = path;
    c.hint = "check that the directory exists and is writable, or pass --db";
    throw Error(std::string("cannot open the run store: ") + (raw ? sqlite3_errmsg(raw) : sqlite3_errstr(rc)), c);
  }
  // Readers never block the writer; a writer waits up to 10 s for another instead of failing.
  SQLITE_CHECK(raw, sqlite3_busy_timeout(raw, 10000));
  use_wal(raw);
  exec(raw, "PRAGMA synchronous = NORMAL");  // with WAL: durable at checkpoints, never corrupt
  exec(raw, "PRAGMA foreign_keys = ON");
  migrate_store(raw, kSchemaVersion);
}

int Store::current_schema_version() { return kSchemaVersion; }
int Store::schema_version() const { return read_user_version(db_.get()); }

std::string Store::create_run(const NewRun& run) {
  Transaction t(db_.get());
  std::string id;
  for (int attempt = 0; attempt < 16 && id.empty(); ++attempt) {
    std::string candidate = random_id();
    Statement exists(db_.get(), "SELECT 1 FROM runs WHERE id = ?");
    exists.bind(1, candidate);
    if (!exists.step()) id = candidate;
  }
  DSRUN_ASSERT(!id.empty(), "16 random 32-bit ids collided");
  Statement s(db_.get(),
              "INSERT INTO runs(id, name, status, created_at, recipe_path, recipe_text, config_toml, plan_json, model, hardware, "
              "zero_stage, world_size, host, git_revision, parent_run, parent_step, sweep_id, plan_text, trial_index, trial_params, config_json) "
              "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
  s.bind(1, id).bind(2, run.name).bind(3, std::string(to_string(run.status))).bind(4, unix_now());
  s.bind(5, run.recipe_path).bind(6, run.recipe_text).bind(7, run.config_toml).bind(8, run.plan_json);
  s.bind(9, run.model).bind(10, run.hardware).bind(11, run.zero_stage).bind(12, run.world_size);
  s.bind(13, run.host).bind_optional(14, run.git_revision).bind_optional(15, run.parent_run);
  if (run.parent_step >= 0) s.bind(16, run.parent_step);
  else s.bind_null(16);
  s.bind_optional(17, run.sweep_id).bind(18, run.plan_text);
  if (run.trial_index >= 0) s.bind(19, run.trial_index);
  else s.bind_null(19);
  s.bind_optional(20, run.trial_params).bind_optional(21, run.config_json);
  s.run();
  t.commit();
  return id;
}

void Store::set_status(const std::string& run_id, RunStatus status, const std::string& error) {
  Transaction t(db_.get());
  RunStatus from = get_run(run_id).status;
  if (!transition_allowed(from, status)) {
    ErrorContext c;
    c.key = run_id;
    throw Error(std::string("run cannot go from ") + to_string(from) + " to " + to_string(status), c);
  }
  double now = unix_now();
  Statement s(db_.get(),
              "UPDATE runs SET status = ?1, error = CASE WHEN ?1 = 'running' THEN NULL ELSE COALESCE(?2, error) END, "
              "started_at = CASE WHEN ?3 = 'running' THEN COALESCE(started_at, ?4) ELSE started_at END, "
              "ended_at = CASE WHEN ? IN ('finished','failed','killed','pruned','infeasible') THEN ? ELSE NULL END WHERE id = ?");
  std::string st = to_string(status);
  s.bind(1, st).bind_optional(2, error).bind(3, st).bind(4, now).bind(5, st).bind(6, now).bind(7, run_id);
  s.run();
  t.commit();
}

void Store::add_metrics(const std::string& run_id, int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  Transaction t(db_.get());
  // REPLACE keeps a (run, key, step) row unique: a step recorded again after a resume overwrites, never duplicates.
  Statement s(db_.get(), "INSERT OR REPLACE INTO metrics(run_id, key, step, value, time) VALUES(?,?,?,?,?)");
  double now = unix_now();
  for (const auto& [key, value] : values) {
    s.bind(1, run_id).bind(2, key).bind(3, step).bind(4, value).bind(5, now);
    s.run();
  }
  Statement hb(db_.get(), "UPDATE runs SET heartbeat_at = ? WHERE id = ?");
  hb.bind(1, now).bind(2, run_id);
  hb.run();
  t.commit();
}

void Store::run_heartbeat(const std::string& run_id, const std::string& host, int64_t pid) {
  Statement s(db_.get(), "UPDATE runs SET heartbeat_at = ?, host = ?, pid = ? WHERE id = ?");
  s.bind(1, unix_now()).bind(2, host).bind(3, pid).bind(4, run_id);
  s.run();
}

void Store::add_event(const std::string& run_id, const std::string& kind, int rank, const std::string& message, const std::string& detail) {
  Statement s(db_.get(), "INSERT INTO events(run_id, time, kind, rank, message, detail) VALUES(?,?,?,?,?,?)");
  s.bind(1, run_id).bind(2, unix_now()).bind(3, kind);
  if (rank >= 0) s.bind(4, rank);
  else s.bind_null(4);
  s.bind(5, message).bind_optional(6, detail);
  s.run();
}

void Store::add_checkpoint(const std::string& run_id, const CheckpointRecord& c) {
  Statement s(db_.get(), "INSERT OR REPLACE INTO checkpoints(run_id, step, path, bytes, checksum, created_at) VALUES(?,?,?,?,?,?)");
  s.bind(1, run_id).bind(2, c.step).bind(3, c.path).bind(4, c.bytes).bind(5, c.checksum).bind(6, c.created_at > 0 ? c.created_at : unix_now());
  s.run();
}

void Store::remove_checkpoint(const std::string& run_id, const std::string& path) {
  Statement s(db_.get(), "DELETE FROM checkpoints WHERE run_id = ? AND path = ?");
  s.bind(1, run_id).bind(2, path);
  s.run();
}

void Store::update_plan(const std::string& run_id, const std::string& config_toml, const std::string& plan_json, const std::string& plan_text,
                        int zero_stage, int world_size) {
  Statement s(db_.get(), "UPDATE runs SET config_toml = ?, plan_json = ?, plan_text = ?, zero_stage = ?, world_size = ? WHERE id = ?");
  s.bind(1, config_toml).bind(2, plan_json).bind(3, plan_text).bind(4, zero_stage).bind(5, world_size).bind(6, run_id);
  s.run();
}

std::string Store::resolve_run(const std::string& query, bool include_deleted) const {
  std::vector<std::string> matches;
  {
    Statement s(db_.get(), "SELECT id FROM runs WHERE substr(id, 1, length(?1)) = ?1 AND (deleted_at IS NULL OR ?2) ORDER BY created_at DESC");
    s.bind(1, query).bind(2, include_deleted ? 1 : 0);
    while (s.step()) matches.push_back(s.text(0));
  }
  if (matches.empty()) {
    Statement s(db_.get(), "SELECT id FROM runs WHERE name = ? AND (deleted_at IS NULL OR ?2) ORDER BY created_at DESC");
    s.bind(1, query).bind(2, include_deleted ? 1 : 0);
    while (s.step()) matches.push_back(s.text(0));
  }
  ErrorContext c;
  c.file = path_;
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
  Statement s(db_.get(), (std::string("SELECT ") + kRunColumns + " FROM runs WHERE id = ?").c_str());
  s.bind(1, run_id);
  if (!s.step()) {
    ErrorContext c;
    c.file = path_;
    c.key = run_id;
    throw Error("no such run", c);
  }
  return read_run(s);
}

std::vector<RunRecord> Store::list_runs(const RunListOptions& o) const {
  std::string sql = std::string("SELECT ") + kRunColumns + " FROM runs WHERE deleted_at IS NULL AND (?1 = '' OR status = ?1) "
                    "AND (?3 = '' OR sweep_id = ?3) ORDER BY created_at DESC, rowid DESC LIMIT ?2";
  Statement s(db_.get(), sql.c_str());
  s.bind(1, o.status).bind(2, o.limit).bind(3, o.sweep);
  std::vector<RunRecord> out;
  while (s.step()) out.push_back(read_run(s));
  return out;
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
  auto contains = [&](const char* column, const std::string& value) {  // a substring, LIKE wildcards escaped
    if (value.empty()) return;
    std::string pattern = "%";
    for (char c : value) pattern += (c == '%' || c == '_' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    text(std::string(" AND ") + column + " LIKE ? ESCAPE '\\'", pattern + "%");
  };
  contains("model", q.model);
  contains("hardware", q.hardware);
  contains("recipe_path", q.recipe);
  if (q.since_seconds > 0) {
    sql += " AND created_at >= ?";
    params.push_back({true, unix_now() - q.since_seconds, ""});
  }
  if (!q.where.sql.empty()) {
    sql += " AND (" + q.where.sql + ")";
    params.insert(params.end(), q.where.params.begin(), q.where.params.end());
  }
  if (!q.sort.sql.empty()) {
    // Runs without the sort value (a metric never recorded) go last either way.
    sql += " ORDER BY (" + q.sort.sql + ") IS NULL, (" + q.sort.sql + ")" + (q.ascending ? " ASC" : " DESC") + ", created_at DESC";
    params.insert(params.end(), q.sort.params.begin(), q.sort.params.end());
    params.insert(params.end(), q.sort.params.begin(), q.sort.params.end());
  } else {
    sql += std::string(" ORDER BY created_at ") + (q.ascending ? "ASC" : "DESC") + ", rowid DESC";
  }
  sql += " LIMIT ?";
  params.push_back({true, static_cast<double>(q.limit), ""});
  Statement s(db_.get(), sql.c_str());
  for (size_t i = 0; i < params.size(); ++i) {
    const int index = static_cast<int>(i) + 1;
    if (!params[i].is_number) s.bind(index, params[i].text);
    else if (std::floor(params[i].number) == params[i].number && std::fabs(params[i].number) < 9e15) s.bind(index, static_cast<int64_t>(params[i].number));
    else s.bind(index, params[i].number);
  }
  std::vector<RunRecord> out;
  while (s.step()) out.push_back(read_run(s));
  return out;
}

void Store::set_deleted(const std::string& run_id, bool deleted) {
  Statement s(db_.get(), "UPDATE runs SET deleted_at = ? WHERE id = ?");
  if (deleted) s.bind(1, unix_now());
  else s.bind_null(1);
  s.bind(2, run_id);
  s.run();
}

int64_t Store::count_runs() const {
  Statement s(db_.get(), "SELECT count(*) FROM runs WHERE deleted_at IS NULL");
  s.step();
  return s.integer(0);
}

std::map<std::string, MetricValue> Store::latest_metrics(const std::string& run_id) const {
  Statement s(db_.get(), "SELECT key, step, value, time FROM metrics_latest WHERE run_id = ?");
  s.bind(1, run_id);
  std::map<std::string, MetricValue> out;
  while (s.step()) out[s.text(0)] = {s.integer(1), s.real(2), s.real(3)};
  return out;
}

std::vector<MetricValue> Store::metric_history(const std::string& run_id, const std::string& key) const {
  Statement s(db_.get(), "SELECT step, value, time FROM metrics WHERE run_id = ? AND key = ? ORDER BY step");
  s.bind(1, run_id).bind(2, key);
  std::vector<MetricValue> out;
  while (s.step()) out.push_back({s.integer(0), s.real(1), s.real(2)});
  return out;
}

std::vector<EventRecord> Store::events(const std::string& run_id) const {
  Statement s(db_.get(), "SELECT id, time, kind, rank, message, detail FROM events WHERE run_id = ? ORDER BY id");
  s.bind(1, run_id);
  std::vector<EventRecord> out;
  while (s.step()) out.push_back({s.integer(0), s.real(1), s.text(2), s.is_null(3) ? -1 : static_cast<int>(s.integer(3)), s.text(4), s.text(5)});
  return out;
}

std::vector<CheckpointRecord> Store::checkpoints(const std::string& run_id) const {
  Statement s(db_.get(), "SELECT step, path, bytes, checksum, created_at FROM checkpoints WHERE run_id = ? ORDER BY step");
  s.bind(1, run_id);
  std::vector<CheckpointRecord> out;
  while (s.step()) out.push_back({s.integer(0), s.text(1), s.integer(2), s.text(3), s.real(4)});
  return out;
}

namespace {

const char* kSweepColumns = "id, name, status, created_at, ended_at, heartbeat_at, recipe_path, recipe_text, spec_json, host, pid, best_run, error";

SweepRecord read_sweep(const Statement& s) {
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

}  // namespace

std::string Store::create_sweep(const SweepRecord& w) {
  Transaction t(db_.get());
  std::string id;
  for (int attempt = 0; attempt < 16 && id.empty(); ++attempt) {
    std::string candidate = "s" + random_id().substr(1);
    Statement exists(db_.get(), "SELECT 1 FROM sweeps WHERE id = ?");
    exists.bind(1, candidate);
    if (!exists.step()) id = candidate;
  }
  DSRUN_ASSERT(!id.empty(), "16 random sweep ids collided");
  Statement s(db_.get(), "INSERT INTO sweeps(id, name, status, created_at, heartbeat_at, recipe_path, recipe_text, spec_json, host, pid) VALUES(?,?,?,?,?,?,?,?,?,?)");
  const double now = unix_now();
  s.bind(1, id).bind(2, w.name).bind(3, std::string("running")).bind(4, now).bind(5, now).bind(6, w.recipe_path).bind(7, w.recipe_text);
  s.bind(8, w.spec_json).bind(9, w.host).bind(10, w.pid);
  s.run();
  t.commit();
  return id;
}

void Store::update_sweep(const std::string& id, const std::string& status, const std::string& best_run, const std::string& error, int64_t pid) {
  const bool ended = status != "running";
  Statement s(db_.get(), "UPDATE sweeps SET status = ?, best_run = ?, error = ?, heartbeat_at = ?, pid = ?, ended_at = ? WHERE id = ?");
  s.bind(1, status).bind_optional(2, best_run).bind_optional(3, error).bind(4, unix_now()).bind(5, pid);
  if (ended) s.bind(6, unix_now());
  else s.bind_null(6);
  s.bind(7, id);
  s.run();
}

void Store::sweep_heartbeat(const std::string& id) {
  Statement s(db_.get(), "UPDATE sweeps SET heartbeat_at = ? WHERE id = ?");
  s.bind(1, unix_now()).bind(2, id);
  s.run();
}

SweepRecord Store::get_sweep(const std::string& id_prefix) const {
  std::string sql = std::string("SELECT ") + kSweepColumns + " FROM sweeps WHERE substr(id, 1, length(?1)) = ?1 OR name = ?1 ORDER BY created_at DESC";
  Statement s(db_.get(), sql.c_str());
  s.bind(1, id_prefix);
  std::vector<SweepRecord> found;
  while (s.step()) found.push_back(read_sweep(s));
  if (found.size() == 1) return found[0];
  ErrorContext c;
  c.file = path_;
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
  std::string sql = std::string("SELECT ") + kRunColumns + " FROM runs WHERE sweep_id = ? AND deleted_at IS NULL ORDER BY trial_index, created_at, rowid";
  Statement s(db_.get(), sql.c_str());
  s.bind(1, sweep_id);
  std::vector<RunRecord> out;
  while (s.step()) out.push_back(read_run(s));
  return out;
}

std::vector<RunRecord> Store::children(const std::string& run_id) const {
  std::string sql = std::string("SELECT ") + kRunColumns + " FROM runs WHERE parent_run = ? AND deleted_at IS NULL ORDER BY created_at, rowid";
  Statement s(db_.get(), sql.c_str());
  s.bind(1, run_id);
  std::vector<RunRecord> out;
  while (s.step()) out.push_back(read_run(s));
  return out;
}

}  // namespace dsrun
