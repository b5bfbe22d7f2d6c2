// The run store's embedded backend: one SQLite file in WAL mode, writers waiting for each other
// up to 10 s, schema version in PRAGMA user_version.
#include "engine/common/error.hpp"
#include "storage/database.hpp"

#include <sqlite3.h>
#include <unistd.h>


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

namespace {

struct SqliteCloser {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
struct StatementFinalizer {
  void operator()(sqlite3_stmt* s) const { sqlite3_finalize(s); }
};

class SqliteDatabase final : public Database {
 public:
  explicit SqliteDatabase(const std::string& path) : path_(path) {
    sqlite3* raw = nullptr;
    const int rc = sqlite3_open_v2(path.c_str(), &raw, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr);
    db_.reset(raw);  // owned even when opening failed, so the handle is closed
    if (rc != SQLITE_OK) {
      ErrorContext c;
      c.file = path;
      c.hint = "check that the directory exists and is writable, or pass --db";
      throw Error(std::string("cannot open the run store: ") + (raw ? sqlite3_errmsg(raw) : sqlite3_errstr(rc)), c);
    }
    // Readers never block the writer; a writer waits up to 10 s for another instead of failing.
    SQLITE_CHECK(raw, sqlite3_busy_timeout(raw, 10000));
    use_wal();
    execute_script("PRAGMA synchronous = NORMAL");  // with WAL: durable at checkpoints, never corrupt
    execute_script("PRAGMA foreign_keys = ON");
  }

  SqlDialect dialect() const override { return SqlDialect::Sqlite; }
  const std::string& location() const override { return path_; }

  SqlRows query(const std::string& sql, const std::vector<SqlValue>& params) override {
    sqlite3_stmt* raw = nullptr;
    const int rc = sqlite3_prepare_v2(db_.get(), sql.c_str(), -1, &raw, nullptr);
    std::unique_ptr<sqlite3_stmt, StatementFinalizer> stmt(raw);
    if (rc != SQLITE_OK) sqlite_fail(db_.get(), rc, sql.c_str(), __FILE__, __LINE__);
    for (size_t i = 0; i < params.size(); ++i) {
      const int at = static_cast<int>(i) + 1;
      const SqlValue& v = params[i];
      switch (v.kind) {
        case SqlValue::Kind::Null: SQLITE_CHECK(db_.get(), sqlite3_bind_null(raw, at)); break;
        case SqlValue::Kind::Integer: SQLITE_CHECK(db_.get(), sqlite3_bind_int64(raw, at, v.integer)); break;
        case SqlValue::Kind::Real: SQLITE_CHECK(db_.get(), sqlite3_bind_double(raw, at, v.real)); break;
        case SqlValue::Kind::Text:
          SQLITE_CHECK(db_.get(), sqlite3_bind_text(raw, at, v.text.data(), static_cast<int>(v.text.size()), SQLITE_TRANSIENT));
          break;
      }
    }
    SqlRows rows;
    for (;;) {
      const int step = sqlite3_step(raw);
      if (step == SQLITE_DONE) break;
      if (step != SQLITE_ROW) sqlite_fail(db_.get(), step, sql.c_str(), __FILE__, __LINE__);
      SqlRow row;
      const int n = sqlite3_column_count(raw);
      row.cells.resize(static_cast<size_t>(n));
      for (int c = 0; c < n; ++c) {
        SqlValue& cell = row.cells[static_cast<size_t>(c)];
        switch (sqlite3_column_type(raw, c)) {
          case SQLITE_NULL: break;
          case SQLITE_INTEGER: cell = SqlValue(static_cast<int64_t>(sqlite3_column_int64(raw, c))); break;
          case SQLITE_FLOAT: cell = SqlValue(sqlite3_column_double(raw, c)); break;
          default: {
            const unsigned char* t = sqlite3_column_text(raw, c);
            cell = SqlValue(std::string(reinterpret_cast<const char*>(t), static_cast<size_t>(sqlite3_column_bytes(raw, c))));
          }
        }
      }
      rows.push_back(std::move(row));
    }
    return rows;
  }

  void execute_script(const std::string& sql) override {
    const int rc = sqlite3_exec(db_.get(), sql.c_str(), nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) sqlite_fail(db_.get(), rc, sql.c_str(), __FILE__, __LINE__);
  }

  // BEGIN IMMEDIATE takes the write lock up front (waiting under the busy timeout), so a
  // transaction never fails halfway for another writer: no retry is needed.
  void transaction(const std::function<void()>& body) override {
    if (depth_ > 0) return body();
    execute_script("BEGIN IMMEDIATE");
    ++depth_;
    try {
      body();
    } catch (...) {
      --depth_;
      sqlite3_exec(db_.get(), "ROLLBACK", nullptr, nullptr, nullptr);  // nothing to report: the error is already in flight
      throw;
    }
    --depth_;
    execute_script("COMMIT");
  }

  int schema_version() override { return static_cast<int>(query("PRAGMA user_version", {}).at(0).integer(0)); }

  // Creation and every migration in one exclusive transaction, the version read inside it: of many
  // processes opening a new store at once, one creates it and the others find it created. A kill
  // leaves the old schema or the new one.
  void migrate(const std::vector<std::string>& scripts) override {
    const int target = static_cast<int>(scripts.size());
    int version = schema_version();
    if (version > target) throw_newer_schema(path_, version, target);
    if (version == target) return;
    transaction([&] {
      version = schema_version();
      if (version > target) throw_newer_schema(path_, version, target);
      for (int v = version; v < target; ++v) execute_script(scripts[static_cast<size_t>(v)]);
      execute_script("PRAGMA user_version = " + std::to_string(target));
    });
  }

 private:
  // Switches a new store to WAL (a persistent setting). SQLite answers a switch that races another
  // connection with SQLITE_BUSY at once, without its busy handler, so this one retries for as long
  // as the busy timeout would have waited.
  void use_wal() {
    for (int attempt = 0;; ++attempt) {
      if (query("PRAGMA journal_mode", {}).at(0).text(0) == "wal") return;
      const int rc = sqlite3_exec(db_.get(), "PRAGMA journal_mode = WAL", nullptr, nullptr, nullptr);
      if (rc == SQLITE_OK) return;
      if ((rc != SQLITE_BUSY && rc != SQLITE_LOCKED) || attempt >= 500) sqlite_fail(db_.get(), rc, "PRAGMA journal_mode = WAL", __FILE__, __LINE__);
      ::usleep(static_cast<useconds_t>(5000 + (attempt * 7919) % 15000));  // 5-20 ms, staggered
    }
  }

  std::string path_;
  std::unique_ptr<sqlite3, SqliteCloser> db_;
  int depth_ = 0;
};

}  // namespace

std::unique_ptr<Database> open_sqlite_database(const std::string& path) { return std::make_unique<SqliteDatabase>(path); }

}  // namespace dsrun
