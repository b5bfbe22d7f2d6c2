// The run store's backends for tests: a SQLite file, and a fresh database on a real PostgreSQL
// server that the first test to ask starts (tests/servers/postgres_server.sh) and that stops when
// the test process ends. Without PostgreSQL installed the tests say "skipped: ..." and run SQLite.
#pragma once

#include "storage/database.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

namespace dsrun::test {

// A server that a test process starts once through one of tests/servers/*.sh (`available`,
// `start DIR`, `stop DIR`) and stops when the process ends; forked children leave it alone.
class ScriptServer {
 public:
  // `start_env`: variable assignments put before the start command ("SLURM_CLUSTER_CPUS=4 ").
  explicit ScriptServer(const std::string& script, const std::string& start_env = "") : script_(script), owner_(::getpid()) {
    CommandOutput probe = run_command(path() + " available");
    if (probe.code != 0) {
      skip_reason_ = probe.text;
      return;
    }
    CommandOutput started = run_command(start_env + path() + " start " + dir());
    if (started.code != 0) {
      skip_reason_ = "skipped: " + script + " did not start: " + started.text;
      return;
    }
    output_ = started.text;
    running_ = true;
  }
  ~ScriptServer() {
    if (running_ && ::getpid() == owner_) run_command(path() + " stop " + dir());
  }
  ScriptServer(const ScriptServer&) = delete;
  ScriptServer& operator=(const ScriptServer&) = delete;

  bool running() const { return running_; }
  const std::string& skip_reason() const { return skip_reason_; }
  const std::string& output() const { return output_; }  // what `start` printed
  std::string dir() const { return dir_.path() + "/server"; }
  std::string path() const { return source_dir() + "/tests/servers/" + script_; }

 private:

  TempDir dir_;
  std::string script_, skip_reason_, output_;
  bool running_ = false;
  pid_t owner_;
};

// A throwaway PostgreSQL server (tests/servers/postgres_server.sh); DSRUN_TEST_NO_POSTGRES skips it.
class PostgresServer {
 public:
  static PostgresServer& get() {
    static PostgresServer server;
    return server;
  }
  bool available() const { return !url_.empty(); }
  const std::string& skip_reason() const { return skip_reason_; }
  // `pg_ctl -m fast restart`: every client's connection is cut, the server is back within seconds.
  bool restart() { return server_ && run_command(server_->path() + " restart " + server_->dir()).code == 0; }
  // Stopped for `seconds`, then started again: an outage longer than a restart.
  bool away(int seconds) { return server_ && run_command(server_->path() + " away " + server_->dir() + " " + std::to_string(seconds)).code == 0; }
  // A database of its own for each caller: tests never see each other's runs.
  std::string new_database() {
    const std::string name = "t" + std::to_string(++databases_);
    open_postgres_database(url_)->execute_script("CREATE DATABASE " + name);
    return url_.substr(0, url_.rfind('/') + 1) + name;
  }

 private:
  PostgresServer() {
    if (const char* off = std::getenv("DSRUN_TEST_NO_POSTGRES")) {
      skip_reason_ = std::string("skipped: DSRUN_TEST_NO_POSTGRES=") + off;
      return;
    }
    server_ = std::make_unique<ScriptServer>("postgres_server.sh");
    if (!server_->running()) {
      skip_reason_ = server_->skip_reason();
      return;
    }
    // The URL is the last line `start` printed.
    std::string url = server_->output();
    while (!url.empty() && (url.back() == '\n' || url.back() == ' ')) url.pop_back();
    url_ = url.substr(url.rfind('\n') == std::string::npos ? 0 : url.rfind('\n') + 1);
  }

  std::unique_ptr<ScriptServer> server_;
  std::string url_, skip_reason_;
  int databases_ = 0;
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
