// The run store on a PostgreSQL server (libpq), for stores that several hosts or a team share:
// serializable transactions retried on conflict, the schema version in a table of its own,
// migrations under an advisory lock.
#include "engine/common/error.hpp"
#include "storage/database.hpp"

#ifdef DSRUN_WITH_POSTGRES
#include <libpq-fe.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#endif

namespace dsrun {

#ifdef DSRUN_WITH_POSTGRES
namespace {

struct ConnectionCloser {
  void operator()(PGconn* c) const { PQfinish(c); }
};
struct ResultClearer {
  void operator()(PGresult* r) const { PQclear(r); }
};
using Result = std::unique_ptr<PGresult, ResultClearer>;

// PostgreSQL's own words for a conflict that a retry resolves: serialization failure, deadlock.
bool is_retryable(const std::string& sqlstate) { return sqlstate == "40001" || sqlstate == "40P01"; }

// Thrown inside transaction() so that it can run the body again; never escapes it.
struct RetryableConflict {
  std::string message;
};

// The connection dropped (a server restart, a network cut): query() and transaction() reconnect
// and run the statement or the whole transaction again; escapes only as an Error, once the
// server stays away past kReconnectSeconds.
struct LostConnection {
  std::string message, sqlstate, sql;
};

// How long a store write waits for its server to come back (a restart takes a second or two);
// a launcher that journals its writes (Store::journal_writes_to) waits less.
constexpr double kReconnectSeconds = 120;

// SQLite's ? and ?N become $N (a bare ? is one more than the highest number so far); quoted text
// and identifiers are left alone.
std::string numbered_placeholders(const std::string& sql) {
  std::string out;
  out.reserve(sql.size() + 16);
  int highest = 0;
  char quote = 0;
  for (size_t i = 0; i < sql.size(); ++i) {
    const char c = sql[i];
    if (quote) {
      out += c;
      if (c == quote) quote = 0;  // '' inside a string closes and reopens: same result
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = c;
      out += c;
      continue;
    }
    if (c != '?') {
      out += c;
      continue;
    }
    size_t j = i + 1;
    while (j < sql.size() && std::isdigit(static_cast<unsigned char>(sql[j]))) ++j;
    const int n = j > i + 1 ? std::stoi(sql.substr(i + 1, j - i - 1)) : highest + 1;
    highest = std::max(highest, n);
    out += "$" + std::to_string(n);
    i = j - 1;
  }
  return out;
}

std::string real_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

class PostgresDatabase final : public Database {
 public:
  explicit PostgresDatabase(const std::string& url) : location_(redact_location(url)) {
    // The URL comes last so that its own settings win over these defaults.
    const char* keys[] = {"connect_timeout", "application_name", "dbname", nullptr};
    const char* values[] = {"10", "dsrun", url.c_str(), nullptr};
    conn_.reset(PQconnectdbParams(keys, values, /*expand_dbname=*/1));
    if (!conn_) fail_connect("libpq could not allocate a connection");
    if (PQstatus(conn_.get()) != CONNECTION_OK) fail_connect(trimmed(PQerrorMessage(conn_.get())));
    // NOTICEs (CREATE TABLE IF NOT EXISTS ... skipping) are not the user's business.
    PQsetNoticeProcessor(conn_.get(), [](void*, const char*) {}, nullptr);
    query("SET client_min_messages = warning", {});
  }

  SqlDialect dialect() const override { return SqlDialect::Postgres; }
  void set_reconnect_seconds(double seconds) override { reconnect_seconds_ = seconds; }
  bool connection_lost() const override { return lost_; }
  const std::string& location() const override { return location_; }

  SqlRows query(const std::string& sql, const std::vector<SqlValue>& params) override {
    if (depth_ > 0) return run(sql, params);
    // Outside a transaction a statement is its own: a deadlock or a dropped connection is retried.
    for (int attempt = 0;; ++attempt) {
      try {
        return run(sql, params);
      } catch (const RetryableConflict& conflict) {
        if (attempt >= kRetries) fail_conflict(conflict, kRetries);
        back_off(attempt);
      } catch (const LostConnection& lost) {
        reconnect(lost);
      }
    }
  }

  void execute_script(const std::string& sql) override {
    if (depth_ > 0) return exec(sql);
    while (true) {
      try {
        return exec(sql);
      } catch (const LostConnection& lost) {
        reconnect(lost);
      }
    }
  }

  void transaction(const std::function<void()>& body) override {
    if (depth_ > 0) return body();
    for (int attempt = 0;; ++attempt) {
      try {
        exec("BEGIN ISOLATION LEVEL SERIALIZABLE");
      } catch (const LostConnection& lost) {
        reconnect(lost);
        continue;
      }
      ++depth_;
      try {
        body();
        exec("COMMIT");  // a conflict, or a lost connection (the body then runs again), may surface here too
        --depth_;
        return;
      } catch (const RetryableConflict& conflict) {
        if (depth_ > 0) --depth_;
        Result(PQexec(conn_.get(), "ROLLBACK"));
        if (attempt >= kRetries) fail_conflict(conflict, kRetries);
        back_off(attempt);
      } catch (const LostConnection& lost) {  // the server rolled it back: the whole body runs again
        depth_ = 0;
        reconnect(lost);
      } catch (...) {
        if (depth_ > 0) --depth_;
        Result(PQexec(conn_.get(), "ROLLBACK"));  // nothing to report: the error is already in flight
        throw;
      }
    }
  }

  int schema_version() override {
    if (query("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'dsrun_schema'", {}).at(0).integer(0) == 0) return 0;
    SqlRows rows = query("SELECT max(version) FROM dsrun_schema", {});
    return rows.empty() ? 0 : static_cast<int>(rows[0].integer(0));
  }

  // Under read committed, behind an advisory lock: every statement after the lock sees what the
  // process before it committed, so of many processes opening a new database one creates it.
  void migrate(const std::vector<std::string>& scripts) override {
    const int target = static_cast<int>(scripts.size());
    int version = schema_version();
    if (version > target) throw_newer_schema(location_, version, target);
    if (version == target) return;
    execute_script("BEGIN");
    ++depth_;
    try {
      query("SELECT pg_advisory_xact_lock(7271930111)", {});
      execute_script("CREATE TABLE IF NOT EXISTS dsrun_schema(version INTEGER NOT NULL)");
      version = schema_version();
      if (version > target) throw_newer_schema(location_, version, target);
      for (int v = version; v < target; ++v) execute_script(scripts[static_cast<size_t>(v)]);
      execute_script("DELETE FROM dsrun_schema");
      query("INSERT INTO dsrun_schema(version) VALUES(?)", {target});
      exec("COMMIT");
      --depth_;
    } catch (const RetryableConflict& conflict) {  // a deadlock with another migrating process: reported, never retried half-done
      if (depth_ > 0) --depth_;
      Result(PQexec(conn_.get(), "ROLLBACK"));
      fail_conflict(conflict, 0);
    } catch (const LostConnection& lost) {  // the server rolled it back: start again on a new connection
      depth_ = 0;
      reconnect(lost);
      return migrate(scripts);
    } catch (...) {
      if (depth_ > 0) --depth_;
      Result(PQexec(conn_.get(), "ROLLBACK"));
      throw;
    }
  }

 private:
  static constexpr int kRetries = 30;

  SqlRows run(const std::string& sql, const std::vector<SqlValue>& params) {
    const std::string numbered = numbered_placeholders(sql);
    // Numbers travel as text with their type (int8, float8); text with type unknown, so the
    // server reads it as whatever the column or comparison needs.
    std::vector<std::string> texts(params.size());
    std::vector<const char*> values(params.size(), nullptr);
    std::vector<Oid> types(params.size(), 0);
    for (size_t i = 0; i < params.size(); ++i) {
      const SqlValue& v = params[i];
      switch (v.kind) {
        case SqlValue::Kind::Null: continue;
        case SqlValue::Kind::Integer: texts[i] = std::to_string(v.integer); types[i] = 20; break;
        case SqlValue::Kind::Real: texts[i] = real_text(v.real); types[i] = 701; break;
        case SqlValue::Kind::Text: texts[i] = v.text; break;
      }
      values[i] = texts[i].c_str();
    }
    Result r(PQexecParams(conn_.get(), numbered.c_str(), static_cast<int>(params.size()), types.data(), values.data(), nullptr, nullptr, 0));
    check(r.get(), sql);
    SqlRows rows;
    const int n = PQntuples(r.get()), fields = PQnfields(r.get());
    rows.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      SqlRow row;
      row.cells.resize(static_cast<size_t>(fields));
      for (int f = 0; f < fields; ++f)
        if (!PQgetisnull(r.get(), i, f))
          row.cells[static_cast<size_t>(f)] = SqlValue(std::string(PQgetvalue(r.get(), i, f), static_cast<size_t>(PQgetlength(r.get(), i, f))));
      rows.push_back(std::move(row));
    }
    return rows;
  }

  void exec(const std::string& sql) {
    Result r(PQexec(conn_.get(), sql.c_str()));
    check(r.get(), sql);
  }

  // Anything but success throws: a conflict as RetryableConflict (for transaction()), the rest as
  // an Error naming the store and PostgreSQL's reason, the statement in the origin.
  void check(PGresult* r, const std::string& sql) {
    const ExecStatusType status = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
    if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK) return;
    const char* state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
    const std::string sqlstate = state ? state : "";
    // The primary message (and detail): the full text quotes the statement, which is dsrun's, not the user's.
    const char* primary = r ? PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY) : nullptr;
    const char* detail = r ? PQresultErrorField(r, PG_DIAG_MESSAGE_DETAIL) : nullptr;
    std::string message = primary ? std::string(primary) + (detail ? std::string(" (") + detail + ")" : "") : trimmed(PQerrorMessage(conn_.get()));
    if (is_retryable(sqlstate)) throw RetryableConflict{message};
    // A server restart (57P01: terminated by the administrator) or a network cut: the caller
    // reconnects and runs it again. Inside migrate() (depth_ set by it) the same holds: nothing
    // half-done survives a dropped connection.
    if (PQstatus(conn_.get()) == CONNECTION_BAD || sqlstate == "57P01" || sqlstate == "57P02" || sqlstate == "57P03")
      throw LostConnection{message, sqlstate, sql};
    ErrorContext c;
    c.file = location_;
    c.hint = sqlstate.rfind("08", 0) == 0 || PQstatus(conn_.get()) == CONNECTION_BAD ? "the connection to the server was lost; run the command again" :
             sqlstate == "53100" ? "the server's disk is full" :
             sqlstate.rfind("42", 0) == 0 ? "the store's schema is not what this dsrun expects: is --db the right database?" : "";
    throw Error("run store: " + message + (sqlstate.empty() ? "" : " (PostgreSQL " + sqlstate + ")"), c)
        .with_origin(source_origin(__FILE__, __LINE__) + ": " + sql);
  }

  // Back to the server after a lost connection, trying every half second for kReconnectSeconds;
  // then the loss is an Error naming the store. Each outage is said once on stderr.
  void reconnect(const LostConnection& lost) {
    if (!lost_) std::fprintf(stderr, "dsrun: warning: run store %s: connection lost (%s); reconnecting for up to %.0f s\n", location_.c_str(), lost.message.c_str(), reconnect_seconds_);
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      PQreset(conn_.get());
      if (PQstatus(conn_.get()) == CONNECTION_OK) {
        PQsetNoticeProcessor(conn_.get(), [](void*, const char*) {}, nullptr);
        Result r(PQexec(conn_.get(), "SET client_min_messages = warning"));
        if (r.get() && PQresultStatus(r.get()) == PGRES_COMMAND_OK) {
          std::fprintf(stderr, "dsrun: run store %s: reconnected\n", location_.c_str());
          lost_ = false;
          return;
        }
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > reconnect_seconds_) break;
      ::usleep(500000);
    }
    lost_ = true;
    ErrorContext c;
    c.file = location_;
    c.hint = "the server stayed away for " + std::to_string(static_cast<int>(reconnect_seconds_)) + " s: check that it runs, then `dsrun resume` the run";
    throw Error("run store: the connection to the server was lost: " + lost.message + (lost.sqlstate.empty() ? "" : " (PostgreSQL " + lost.sqlstate + ")"), c)
        .with_origin(source_origin(__FILE__, __LINE__) + ": " + lost.sql);
  }

  [[noreturn]] void fail_connect(const std::string& reason) const {
    ErrorContext c;
    c.file = location_;
    const bool auth = reason.find("authentication") != std::string::npos || reason.find("password") != std::string::npos ||
                      reason.find("role") != std::string::npos;
    const bool no_db = reason.find("database") != std::string::npos && reason.find("does not exist") != std::string::npos;
    c.hint = auth  ? "check the user and password in the URL (postgresql://USER:PASSWORD@HOST/DB), ~/.pgpass or PGPASSWORD" :
             no_db ? "create the database first (createdb NAME), or name another in the URL" :
                     "check that the server runs and that host and port in the URL are right (postgresql://USER@HOST:PORT/DB)";
    throw Error("cannot connect to the run store: " + reason, c);
  }

  [[noreturn]] void fail_conflict(const RetryableConflict& conflict, int retries) const {
    ErrorContext c;
    c.file = location_;
    c.hint = "other writers kept conflicting with this one; run the command again";
    throw Error("run store: " + conflict.message + " (after " + std::to_string(retries) + " retries)", c);
  }

  void back_off(int attempt) {
    std::uniform_int_distribution<int> jitter(1000, 4000);
    ::usleep(static_cast<useconds_t>(jitter(rng_) * std::min(attempt + 1, 25)));  // 1-4 ms, growing
  }

  std::string location_;
  double reconnect_seconds_ = kReconnectSeconds;
  bool lost_ = false;  // the last reconnect gave up (cleared by the next that succeeds)
  std::unique_ptr<PGconn, ConnectionCloser> conn_;
  int depth_ = 0;
  std::mt19937 rng_{std::random_device{}()};
};

}  // namespace

std::unique_ptr<Database> open_postgres_database(const std::string& url) { return std::make_unique<PostgresDatabase>(url); }
#else
// Built without libpq (GPU builds against PyTorch's libtorch: scripts/gpu_build.sh carries no libpq).
std::unique_ptr<Database> open_postgres_database(const std::string& url) {
  ErrorContext c;
  c.key = "--db";
  c.hint = "use a SQLite store (a file path) with this build, or build dsrun where libpq-dev is installed (./setup.sh)";
  throw Error("this dsrun was built without PostgreSQL support (libpq): cannot open " + redact_location(url), c);
}
#endif

namespace {

// libpq's keyword/value form, parsed as libpq does: "keyword = value" with blanks allowed around
// '=', a value bare (a backslash escapes the next character, blanks included) or single-quoted
// (backslash escapes inside). The values of password and sslpassword become ***.
std::string redact_keyword_values(const std::string& conninfo) {
  std::string out;
  size_t i = 0;
  const auto blank = [](char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r'; };
  while (i < conninfo.size()) {
    const size_t start = i;
    while (i < conninfo.size() && blank(conninfo[i])) ++i;
    size_t k = i;
    while (k < conninfo.size() && !blank(conninfo[k]) && conninfo[k] != '=') ++k;
    const std::string keyword = conninfo.substr(i, k - i);
    size_t eq = k;
    while (eq < conninfo.size() && blank(conninfo[eq])) ++eq;
    if (eq >= conninfo.size() || conninfo[eq] != '=') {  // not keyword=value: kept as written
      out += conninfo.substr(start);
      break;
    }
    size_t v = eq + 1;
    while (v < conninfo.size() && blank(conninfo[v])) ++v;
    size_t end = v;
    if (end < conninfo.size() && conninfo[end] == '\'') {
      for (++end; end < conninfo.size() && conninfo[end] != '\''; ++end)
        if (conninfo[end] == '\\') ++end;
      end = std::min(end + 1, conninfo.size());
    } else {
      for (; end < conninfo.size() && !blank(conninfo[end]); ++end)
        if (conninfo[end] == '\\') ++end;
      end = std::min(end, conninfo.size());
    }
    out += conninfo.substr(start, v - start);
    out += keyword == "password" || keyword == "sslpassword" ? "***" : conninfo.substr(v, end - v);
    i = end;
  }
  return out;
}

}  // namespace

std::string redact_location(const std::string& location) {
  if (!is_postgres_location(location)) return location;
  std::string out = location;
  // A password value, wherever libpq takes one: "password=..." (and sslpassword=) in the
  // keyword/value form, up to the next space or a quoted value's end, and in a URL's query.
  auto mask_values = [&](char end) {
    for (size_t at = out.find("password="); at != std::string::npos; at = out.find("password=", at + 1)) {
      const size_t begin = at + 9;
      size_t stop = begin;
      if (stop < out.size() && out[stop] == '\'') {
        for (++stop; stop < out.size() && out[stop] != '\''; ++stop)
          if (out[stop] == '\\') ++stop;
        if (stop < out.size()) ++stop;
      } else {
        while (stop < out.size() && out[stop] != end && out[stop] != ' ' && out[stop] != '&') ++stop;
      }
      out.replace(begin, stop - begin, "***");
    }
  };
  const size_t scheme = out.find("://");
  if (scheme == std::string::npos) return redact_keyword_values(out);
  // scheme://user:password@host... -> scheme://user:***@host...
  const size_t scheme_end = scheme + 3;
  const size_t at = out.find('@', scheme_end);
  const size_t colon = out.find(':', scheme_end);
  if (at != std::string::npos && colon != std::string::npos && colon < at) out = out.substr(0, colon + 1) + "***" + out.substr(at);
  const size_t query = out.find('?');
  if (query != std::string::npos) {
    std::string head = out.substr(0, query), tail = out.substr(query);
    out = tail;
    mask_values('&');
    out = head + out;
  }
  return out;
}

bool location_has_password(const std::string& location) { return redact_location(location) != location; }

}  // namespace dsrun
