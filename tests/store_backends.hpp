// The run store's backends for tests: a SQLite file, and a fresh database on a real PostgreSQL
// server that the first test to ask starts (tests/servers/postgres_server.sh) and that stops when
// the test process ends. Without PostgreSQL installed the tests say "skipped: ..." and run SQLite.
#pragma once

#include "storage/database.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <unistd.h>

#include <string>
#include <vector>

namespace dsrun::test {

class PostgresServer {
 public:
  static PostgresServer& get() {
    static PostgresServer server;
    return server;
  }
  bool available() const { return !url_.empty(); }
  const std::string& skip_reason() const { return skip_reason_; }
  // A database of its own for each caller: tests never see each other's runs.
  std::string new_database() {
    const std::string name = "t" + std::to_string(++databases_);
    open_postgres_database(url_)->execute_script("CREATE DATABASE " + name);
    return url_.substr(0, url_.rfind('/') + 1) + name;
  }
  std::string server_url() const { return url_; }

  ~PostgresServer() {
    if (available() && ::getpid() == owner_) run_command(script() + " stop " + dir_.path());  // forked children leave it alone
  }

 private:
  PostgresServer() : owner_(::getpid()) {
    if (const char* off = std::getenv("DSRUN_TEST_NO_POSTGRES")) {
      skip_reason_ = std::string("skipped: DSRUN_TEST_NO_POSTGRES=") + off;
      return;
    }
    CommandOutput probe = run_command(script() + " available");
    if (probe.code != 0) {
      skip_reason_ = probe.text;
      return;
    }
    CommandOutput started = run_command(script() + " start " + dir_.path() + "/pg");
    if (started.code != 0) {
      skip_reason_ = "skipped: the PostgreSQL server did not start: " + started.text;
      return;
    }
    std::string url = started.text;
    while (!url.empty() && (url.back() == '\n' || url.back() == ' ')) url.pop_back();
    url_ = url.substr(url.rfind('\n') == std::string::npos ? 0 : url.rfind('\n') + 1);
  }
  static std::string script() { return source_dir() + "/tests/servers/postgres_server.sh"; }

  TempDir dir_;
  std::string url_, skip_reason_;
  int databases_ = 0;
  pid_t owner_;
};

struct StoreBackend {
  std::string name;      // sqlite, postgresql
  std::string location;  // a file under `dir`, or a URL
};

// SQLite always; PostgreSQL when a server could start (otherwise a warning says why it was skipped).
inline std::vector<StoreBackend> store_backends(const TempDir& dir, const std::string& file = "runs.db") {
  std::vector<StoreBackend> out{{"sqlite", dir.file(file)}};
  PostgresServer& pg = PostgresServer::get();
  if (pg.available()) out.push_back({"postgresql", pg.new_database()});
  else WARN(pg.skip_reason());
  return out;
}

}  // namespace dsrun::test
