// One connection to the run store's database, SQLite file or PostgreSQL server: statements with
// `?` parameters, typed rows, transactions that retry, and schema versions. The Store speaks SQL
// through this and never sees which backend answers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dsrun {

enum class SqlDialect { Sqlite, Postgres };

// A parameter or a cell: null, integer, real or text. PostgreSQL cells arrive as text and are
// read as numbers on demand.
struct SqlValue {
  enum class Kind { Null, Integer, Real, Text } kind = Kind::Null;
  int64_t integer = 0;
  double real = 0;
  std::string text;

  SqlValue() = default;
  SqlValue(int v) : kind(Kind::Integer), integer(v) {}
  SqlValue(int64_t v) : kind(Kind::Integer), integer(v) {}
  SqlValue(double v) : kind(Kind::Real), real(v) {}
  SqlValue(std::string v) : kind(Kind::Text), text(std::move(v)) {}
  SqlValue(const char* v) : kind(Kind::Text), text(v) {}
  static SqlValue text_or_null(const std::string& v) { return v.empty() ? SqlValue() : SqlValue(v); }
  static SqlValue integer_or_null(int64_t v, bool present) { return present ? SqlValue(v) : SqlValue(); }
};

struct SqlRow {
  std::vector<SqlValue> cells;
  bool is_null(size_t col) const { return cells.at(col).kind == SqlValue::Kind::Null; }
  std::string text(size_t col) const;  // "" for null
  int64_t integer(size_t col) const;   // 0 for null
  double real(size_t col) const;       // 0 for null
};
using SqlRows = std::vector<SqlRow>;

class Database {
 public:
  virtual ~Database() = default;
  virtual SqlDialect dialect() const = 0;
  // For messages: the file, or the URL without its password.
  virtual const std::string& location() const = 0;

  // One statement. `?` and `?N` mark parameters (SQLite's numbering: a bare ? is one more than the
  // highest number before it); values never enter the SQL text.
  virtual SqlRows query(const std::string& sql, const std::vector<SqlValue>& params = {}) = 0;
  // Several statements without parameters (schema scripts, tests).
  virtual void execute_script(const std::string& sql) = 0;
  // Runs `body` in one transaction, committed when it returns, rolled back when it throws. When
  // the database refuses to serialize it with another (PostgreSQL's 40001, a deadlock), `body`
  // runs again from the start, so it must only touch the database and its own locals. Nested
  // calls join the outer transaction.
  virtual void transaction(const std::function<void()>& body) = 0;

  // A server store: how long a statement waits for a lost connection to come back before it
  // throws, and whether the last one threw for that (not for what it asked). Files: never lost.
  virtual void set_reconnect_seconds(double) {}
  virtual bool connection_lost() const { return false; }

  virtual int schema_version() = 0;
  // Brings the schema to `scripts.size()`; script i leads from version i to i + 1. Refuses a
  // database newer than that. Safe when many processes open a new database at once.
  virtual void migrate(const std::vector<std::string>& scripts) = 0;
};

// "postgresql://..." or "postgres://..." (libpq's URL) is a server; anything else a SQLite file.
bool is_postgres_location(const std::string& location);
// Opens (and for SQLite creates) the database. Errors name the location and give a way out.
std::unique_ptr<Database> open_database(const std::string& location);
std::unique_ptr<Database> open_sqlite_database(const std::string& path);
std::unique_ptr<Database> open_postgres_database(const std::string& url);
// The URL (or libpq keyword/value string) with any password replaced by ***, for messages and
// the store's recorded location: the user:password@ of a URL, password= in its query or in the
// keyword/value form.
std::string redact_location(const std::string& location);
// Whether the location carries a password (what must not go into a job script or a process list).
bool location_has_password(const std::string& location);
// The error for a schema newer than this dsrun knows.
[[noreturn]] void throw_newer_schema(const std::string& location, int found, int known);

}  // namespace dsrun
