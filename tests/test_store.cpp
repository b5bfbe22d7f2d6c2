// The run store: round trip, lifecycle, id prefixes, migration from an old schema, and
// consistency when the writing process is killed with SIGKILL at arbitrary points.
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "storage/store.hpp"
#include "store_backends.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <random>

using namespace dsrun;

namespace {

NewRun sample_run(const std::string& name) {
  NewRun r;
  r.name = name;
  r.recipe_path = "recipes/quickstart.toml";
  r.recipe_text = "[run]\nsteps = 3\n";
  r.config_toml = "[run]\nsteps = 3\n";
  r.plan_json = "{\"fits\": true}";
  r.plan_text = "plan for recipes/quickstart.toml\n";
  r.model = "deepseek-tiny";
  r.hardware = "cpu";
  r.zero_stage = 2;
  r.world_size = 2;
  r.host = "testhost";
  return r;
}

int64_t count(Database& db, const std::string& sql) {
  SqlRows rows = db.query(sql, {});
  REQUIRE(rows.size() == 1);
  return rows[0].integer(0);
}

}  // namespace

TEST_CASE("a run round-trips with its metrics, events and checkpoints", "[store]") {
  dsrun::test::TempDir dir;
  for (const auto& backend : test::store_backends(dir)) {
  INFO(backend.name);
  Store store(backend.location);
  CHECK(store.schema_version() == Store::current_schema_version());
  std::string id = store.create_run(sample_run("first"));
  CHECK(id.size() == 8);

  RunRecord r = store.get_run(id);
  CHECK(r.name == "first");
  CHECK(r.status == RunStatus::Planned);
  CHECK(r.recipe_text == "[run]\nsteps = 3\n");
  CHECK(r.plan_text == "plan for recipes/quickstart.toml\n");
  CHECK(r.zero_stage == 2);
  CHECK(r.parent_step == -1);
  CHECK(r.created_at > 0);

  store.set_status(id, RunStatus::Running);
  store.add_metrics(id, 1, {{"loss", 5.5}, {"lr", 1e-3}});
  store.add_metrics(id, 2, {{"loss", 4.25}, {"lr", 2e-3}});
  store.add_metrics(id, 2, {{"loss", 4.0}});  // the same step again (after a resume) overwrites
  store.add_event(id, "start", 0, "rank 0 up");
  store.add_checkpoint(id, {2, "/tmp/ckpt/2", 1234, "abcd", 0});
  store.set_status(id, RunStatus::Finished);

  r = store.get_run(id);
  CHECK(r.status == RunStatus::Finished);
  CHECK(r.started_at > 0);
  CHECK(r.ended_at >= r.started_at);
  auto latest = store.latest_metrics(id);
  CHECK(latest.at("loss").step == 2);
  CHECK(latest.at("loss").value == 4.0);
  CHECK(store.metric_history(id, "loss").size() == 2);
  REQUIRE(store.events(id).size() == 1);
  CHECK(store.events(id)[0].rank == 0);
  REQUIRE(store.checkpoints(id).size() == 1);
  CHECK(store.checkpoints(id)[0].bytes == 1234);
}
}

TEST_CASE("status changes follow the lifecycle", "[store]") {
  dsrun::test::TempDir dir;
  for (const auto& backend : test::store_backends(dir)) {
  INFO(backend.name);
  Store store(backend.location);
  std::string id = store.create_run(sample_run("x"));
  CHECK_THROWS_WITH(store.set_status(id, RunStatus::Planned), Catch::Contains("cannot go from planned to planned"));
  store.set_status(id, RunStatus::Infeasible, "does not fit");
  CHECK(store.get_run(id).error == "does not fit");
  CHECK_THROWS(store.set_status(id, RunStatus::Running));  // an infeasible plan never runs
  std::string other = store.create_run(sample_run("y"));
  store.set_status(other, RunStatus::Running);
  store.set_status(other, RunStatus::Killed);
  store.set_status(other, RunStatus::Running);  // resume
  CHECK(store.get_run(other).ended_at == 0);
  CHECK_THROWS(run_status_from_string("done"));
  }
}

TEST_CASE("runs are found by id, unique prefix or name, and ambiguity is an error", "[store]") {
  dsrun::test::TempDir dir;
  for (const auto& backend : test::store_backends(dir)) {
  INFO(backend.name);
  Store store(backend.location);
  std::vector<std::string> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(store.create_run(sample_run("run" + std::to_string(i))));
  CHECK(store.resolve_run(ids[7]) == ids[7]);
  CHECK(store.resolve_run(ids[7].substr(0, 7)) == ids[7]);
  CHECK(store.resolve_run("run12") == ids[12]);
  CHECK_THROWS_WITH(store.resolve_run("zzzz-none"), Catch::Contains("no run"));
  // Among 40 ids some first hex digit repeats: that one-character prefix is ambiguous.
  std::map<char, int> first;
  for (const auto& id : ids) ++first[id[0]];
  for (const auto& [c, n] : first)
    if (n > 1) {
      CHECK_THROWS_WITH(store.resolve_run(std::string(1, c)), Catch::Contains("runs match"));
      break;
    }
  RunListOptions o;
  o.limit = 5;
  auto newest = store.list_runs(o);
  REQUIRE(newest.size() == 5);
  CHECK(newest[0].id == ids.back());
  }
}

TEST_CASE("an old store is migrated and keeps its data", "[store][migration]") {
  dsrun::test::TempDir dir;
  std::string path = dir.file("old.db");
  {
    auto db = open_sqlite_database(path);
    migrate_store(*db, 1);
    REQUIRE(count(*db, "PRAGMA user_version") == 1);
    db->execute_script(
        "INSERT INTO runs(id, name, status, created_at, recipe_text, config_toml) VALUES('abcd1234', 'old', 'finished', 1, '', '');"
        "INSERT INTO metrics VALUES('abcd1234', 'loss', 1, 3.0, 1), ('abcd1234', 'loss', 5, 2.0, 2), ('abcd1234', 'lr', 5, 0.1, 2);");
  }
  Store store(path);
  CHECK(store.schema_version() == Store::current_schema_version());
  auto latest = store.latest_metrics("abcd1234");  // metrics_latest was back-filled by migration 2
  CHECK(latest.at("loss").step == 5);
  CHECK(latest.at("loss").value == 2.0);
  CHECK(store.get_run("abcd1234").name == "old");
  // Migration 6's trigger: a step recorded again (an upsert's update) is the latest value too.
  store.add_metrics("abcd1234", 5, {{"loss", 1.5}});
  CHECK(store.latest_metrics("abcd1234").at("loss").value == 1.5);
}

TEST_CASE("a store from a newer dsrun is refused, not damaged", "[store][migration]") {
  dsrun::test::TempDir dir;
  std::string path = dir.file("new.db");
  { Store store(path); }
  open_sqlite_database(path)->execute_script("PRAGMA user_version = 99");
  CHECK_THROWS_WITH(Store(path), Catch::Contains("newer than this dsrun"));
  test::PostgresServer& pg = test::PostgresServer::get();
  if (!pg.available()) {
    WARN(pg.skip_reason());
    return;
  }
  const std::string url = pg.new_database();
  { Store store(url); }
  open_postgres_database(url)->execute_script("UPDATE dsrun_schema SET version = 99");
  CHECK_THROWS_WITH(Store(url), Catch::Contains("newer than this dsrun"));
}

TEST_CASE("the store stays consistent when its writer is killed at any point", "[store][crash]") {
  dsrun::test::TempDir dir;
  std::string path = dir.file("crash.db");
  std::string id;
  { id = Store(path).create_run(sample_run("crash")); }
  std::mt19937 rng(7);
  for (int round = 0; round < 6; ++round) {
    pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // The writer: each step writes two metrics in one transaction, forever.
      try {
        Store store(path);
        for (int64_t step = 0;; ++step) store.add_metrics(id, round * 1000000 + step, {{"loss", 1.0 / (step + 1)}, {"lr", 0.1}});
      } catch (...) {
      }
      _exit(1);
    }
    usleep(20000 + rng() % 80000);
    REQUIRE(kill(child, SIGKILL) == 0);
    int status = 0;
    waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));

    Store store(path);  // opens, recovers the WAL
    Database& db = store.database();
    CHECK(count(db, "SELECT count(*) FROM pragma_integrity_check WHERE integrity_check = 'ok'") == 1);
    int64_t losses = count(db, "SELECT count(*) FROM metrics WHERE key = 'loss'");
    int64_t lrs = count(db, "SELECT count(*) FROM metrics WHERE key = 'lr'");
    CHECK(losses == lrs);  // no half-written step
    CHECK(losses > 0);
    CHECK(store.latest_metrics(id).at("loss").step == count(db, "SELECT max(step) FROM metrics WHERE key = 'loss'"));
  }
}

TEST_CASE("any number of processes can create a new store at once", "[store][concurrency]") {
  test::TempDir dir;
  constexpr int kProcesses = 8, kRounds = 15;
  test::PostgresServer& pg = test::PostgresServer::get();
  if (!pg.available()) WARN(pg.skip_reason());
  // SQLite rounds, then (with a server) 5 PostgreSQL rounds, each on an empty database.
  for (int round = 0; round < kRounds + (pg.available() ? 5 : 0); ++round) {
    const std::string path = round < kRounds ? dir.file("new" + std::to_string(round) + ".db") : pg.new_database();
    std::vector<pid_t> children;
    int go[2];
    REQUIRE(::pipe(go) == 0);
    for (int p = 0; p < kProcesses; ++p) {
      pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        ::close(go[1]);
        char c;
        if (::read(go[0], &c, 1) < 0) _exit(3);  // all start together when the pipe closes
        try {
          Store store(path);
          store.create_run(sample_run("p" + std::to_string(p)));
          if (p % 2 == 0) store.list_runs({});
          _exit(0);
        } catch (const Error& e) {
          std::fprintf(stderr, "%s\n", e.describe().c_str());
          _exit(1);
        }
      }
      children.push_back(pid);
    }
    ::close(go[0]);
    ::close(go[1]);
    int failed = 0;
    for (pid_t pid : children) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    INFO("round " << round);
    CHECK(failed == 0);
    Store store(path);
    CHECK(store.list_runs({}).size() == kProcesses);
    CHECK(store.schema_version() == Store::current_schema_version());
  }
}

TEST_CASE("store errors name the store file, never dsrun's source", "[store]") {
  test::TempDir dir;
  const std::string path = dir.file("runs.db");
  { Store store(path); }
  open_sqlite_database(path)->execute_script("DROP TABLE events");
  Store store(path);
  std::string id = store.create_run(sample_run("x"));
  ::unsetenv("DSRUN_DEBUG");
  std::string e = test::error_of([&] { store.add_event(id, "note", -1, "text"); });
  CHECK(test::contains(e, path));
  CHECK(test::contains(e, "no such table: events"));
  CHECK_FALSE(test::contains(e, "store.cpp"));
  CHECK_FALSE(test::contains(e, "INSERT"));
  ::setenv("DSRUN_DEBUG", "1", 1);  // for a bug report: where, and the statement
  e = test::error_of([&] { store.add_event(id, "note", -1, "text"); });
  ::unsetenv("DSRUN_DEBUG");
  CHECK(test::contains(e, "(raised at sqlite_database.cpp:"));
  CHECK(test::contains(e, "INSERT"));
}

TEST_CASE("a store password is masked wherever libpq takes one: the URL's user part, its query, the keyword/value form", "[store]") {
  CHECK(redact_location("postgresql://dsrun:secret@db:5432/runs") == "postgresql://dsrun:***@db:5432/runs");
  CHECK(redact_location("postgresql://dsrun@db/runs?password=secret&sslmode=require") == "postgresql://dsrun@db/runs?password=***&sslmode=require");
  CHECK(redact_location("postgres://db/runs?sslmode=require&password=secret") == "postgres://db/runs?sslmode=require&password=***");
  CHECK(redact_location("host=db dbname=runs password=secret user=me") == "host=db dbname=runs password=*** user=me");
  CHECK(redact_location("host=db password='se cr\\'et' dbname=runs") == "host=db password=*** dbname=runs");
  CHECK(redact_location("runs/dsrun.db") == "runs/dsrun.db");
  // Blanks around '=' (libpq takes them) and a bare value with escaped blanks: all of it masked.
  CHECK(redact_location("host=db password = 'pw with space' user=me") == "host=db password = *** user=me");
  CHECK(redact_location("host=db password=pw\\ with\\ space user=me") == "host=db password=*** user=me");
  CHECK(redact_location("host=db sslpassword  =  k3y dbname=runs") == "host=db sslpassword  =  *** dbname=runs");
  CHECK(location_has_password("host=db password = 'pw with space'"));
  CHECK(location_has_password("dbname=runs password=x"));
  CHECK_FALSE(location_has_password("postgresql://dsrun@db/runs"));
  // libpq's keyword/value form is a server, not a SQLite file of that name.
  CHECK(is_postgres_location("host=127.0.0.1 port=1 dbname=runs"));
  CHECK(is_postgres_location("  dbname=runs"));
  CHECK_FALSE(is_postgres_location("runs/host=1.db"));
  const std::string e = test::error_of([] { Store("host=127.0.0.1 port=1 dbname=runs password=secret connect_timeout=2"); });
  CHECK(test::contains(e, "cannot connect to the run store"));
  CHECK_FALSE(test::contains(e, "secret"));
  const std::string q = test::error_of([] { Store("postgresql://dsrun@127.0.0.1:1/runs?password=secret"); });
  CHECK(test::contains(q, "password=***"));
  CHECK_FALSE(test::contains(q, "secret"));
}

TEST_CASE("PostgreSQL store errors: no server, wrong user, no database, a broken schema, the password never shown", "[store][postgresql]") {
  test::PostgresServer& pg = test::PostgresServer::get();
  // No server needed: nothing listens on port 1.
  std::string e = test::error_of([] { Store("postgresql://dsrun:secret@127.0.0.1:1/runs"); });
  CHECK(test::contains(e, "cannot connect to the run store"));
  CHECK(test::contains(e, "postgresql://dsrun:***@127.0.0.1:1/runs"));
  CHECK_FALSE(test::contains(e, "secret"));
  CHECK(test::contains(e, "check that the server runs"));
  if (!pg.available()) {
    WARN(pg.skip_reason());
    return;
  }
  const std::string url = pg.new_database();
  const std::string server = url.substr(0, url.rfind('/'));
  const std::string port = server.substr(server.rfind(':') + 1);
  e = test::error_of([&] { Store("postgresql://nobody@127.0.0.1:" + port + "/dsrun"); });
  CHECK(test::contains(e, "role \"nobody\" does not exist"));
  CHECK(test::contains(e, "check the user and password"));
  e = test::error_of([&] { Store(server + "/nosuchdb"); });
  CHECK(test::contains(e, "does not exist"));
  CHECK(test::contains(e, "createdb"));
  Store store(url);
  const std::string id = store.create_run(sample_run("x"));
  store.database().execute_script("DROP TABLE events");
  ::unsetenv("DSRUN_DEBUG");
  e = test::error_of([&] { store.add_event(id, "note", -1, "text"); });
  CHECK(test::contains(e, url));
  CHECK(test::contains(e, "PostgreSQL 42P01"));
  CHECK_FALSE(test::contains(e, "INSERT"));
  // The connection survives an error: the next statement works.
  CHECK(store.get_run(id).name == "x");
}

TEST_CASE("store copy moves every record between backends, and copying again adds nothing", "[store][copy]") {
  test::TempDir dir;
  test::PostgresServer& pg = test::PostgresServer::get();
  Store sqlite(dir.file("a.db"));
  SweepRecord sweep;
  sweep.name = "lr";
  sweep.recipe_path = "r.toml";
  sweep.recipe_text = sweep.spec_json = "{}";
  const std::string sweep_id = sqlite.create_sweep(sweep);
  NewRun parent = sample_run("parent");
  parent.sweep_id = sweep_id;
  parent.trial_index = 0;
  parent.config_json = "{\"optimizer.lr\": 0.001}";
  const std::string a = sqlite.create_run(parent);
  sqlite.set_status(a, RunStatus::Running);
  for (int step = 1; step <= 20; ++step) sqlite.add_metrics(a, step, {{"loss", 3.0 / step}, {"lr", 1e-3 * step}});
  sqlite.add_event(a, "start", 0, "rank 0 up", "detail");
  sqlite.add_event(a, "note", -1, "no rank");
  sqlite.add_checkpoint(a, {10, "/ckpt/10", 99, "cafe", 0});
  sqlite.report_node(a, {1, "node-b", 42, "finished", 1, ""});
  sqlite.set_job(a, "1234", "COMPLETED", "node-[a-b]", "");
  sqlite.set_status(a, RunStatus::Finished);
  NewRun child = sample_run("child");
  child.parent_run = a;
  child.parent_step = 10;
  const std::string b = sqlite.create_run(child);

  auto same = [&](const Store& x, const Store& y) {
    CHECK(x.count_runs() == y.count_runs());
    for (const std::string& id : {a, b}) {
      const RunRecord rx = x.get_run(id), ry = y.get_run(id);
      CHECK(rx.name == ry.name);
      CHECK(rx.status == ry.status);
      CHECK(rx.created_at == ry.created_at);
      CHECK(rx.ended_at == ry.ended_at);
      CHECK(rx.parent_run == ry.parent_run);
      CHECK(rx.parent_step == ry.parent_step);
      CHECK(rx.trial_index == ry.trial_index);
      CHECK(rx.job_id == ry.job_id);
      CHECK(rx.config_json == ry.config_json);
      CHECK(x.metric_history(id, "loss").size() == y.metric_history(id, "loss").size());
      CHECK(x.events(id).size() == y.events(id).size());
      CHECK(x.checkpoints(id).size() == y.checkpoints(id).size());
      CHECK(x.nodes(id).size() == y.nodes(id).size());
    }
    CHECK(x.latest_metrics(a).at("loss").value == y.latest_metrics(a).at("loss").value);
    CHECK(x.metric_history(a, "lr").back().value == y.metric_history(a, "lr").back().value);
    CHECK(x.events(a).at(0).detail == y.events(a).at(0).detail);
    CHECK(x.events(a).at(1).rank == -1);
    CHECK(y.events(a).at(1).rank == -1);
    CHECK(x.get_sweep(sweep_id).name == y.get_sweep(sweep_id).name);
  };
  // Through a server when there is one; SQLite to SQLite otherwise.
  const std::string middle = pg.available() ? pg.new_database() : dir.file("b.db");
  if (!pg.available()) WARN(pg.skip_reason());
  Store server(middle);
  const StoreCopy first = copy_store(sqlite, server);
  CHECK(first.runs == 2);
  CHECK(first.metrics == 40);
  CHECK(first.events == 2);
  CHECK(first.checkpoints == 1);
  CHECK(first.nodes == 1);
  CHECK(first.sweeps == 1);
  const StoreCopy again = copy_store(sqlite, server);  // idempotent
  CHECK(again.runs + again.metrics + again.events + again.checkpoints + again.nodes + again.sweeps == 0);
  same(sqlite, server);
  Store back(dir.file("c.db"));
  CHECK(copy_store(server, back).runs == 2);
  CHECK(copy_store(server, back).runs == 0);
  same(sqlite, back);
  CHECK(back.events(a).size() == 2);
  // What a user sees is the same: history --json of the original and of the round trip.
  auto history = [](const std::string& db) { return test::run_command("'" DSRUN_BINARY "' history --json --db '" + db + "'"); };
  const test::CommandOutput before = history(dir.file("a.db")), after = history(dir.file("c.db"));
  REQUIRE(before.code == 0);
  CHECK(before.text == after.text);
  CHECK(test::contains(after.text, "\"parent_run\": \"" + a + "\""));
  CHECK(test::contains(after.text, "\"job_state\": \"COMPLETED\""));
  // The command: copying into a new file, then again (nothing new).
  test::CommandOutput copy = test::run_command("'" DSRUN_BINARY "' store copy '" + dir.file("a.db") + "' '" + dir.file("d.db") + "'");
  CHECK(copy.code == 0);
  CHECK(test::contains(copy.text, "copied 2 new run(s) of 2"));
  copy = test::run_command("'" DSRUN_BINARY "' store copy '" + dir.file("a.db") + "' '" + dir.file("d.db") + "'");
  CHECK(test::contains(copy.text, "copied 0 new run(s) of 2"));
  CHECK(test::contains(copy.text, "rows added: 0 metric(s), 0 event(s)"));
  // Another store with a different run under the same id: refused, naming it; nothing merged.
  {
    Store other(dir.file("e.db"));
    NewRun stranger = sample_run("stranger");
    stranger.recipe_text = "something else";
    const std::string id = other.create_run(stranger);
    other.database().query("UPDATE runs SET id = ? WHERE id = ?", {a, id});
    other.add_metrics(a, 1, {{"loss", 9.0}});
  }
  const int64_t metrics_before = Store(dir.file("d.db")).metric_history(a, "loss").size();
  copy = test::run_command("'" DSRUN_BINARY "' store copy '" + dir.file("e.db") + "' '" + dir.file("d.db") + "'");
  INFO(copy.text);
  CHECK(copy.code == 1);
  CHECK(test::contains(copy.text, "store copy refused"));
  CHECK(test::contains(copy.text, "run " + a + " (\"stranger\""));
  CHECK(Store(dir.file("d.db")).metric_history(a, "loss").size() == static_cast<size_t>(metrics_before));
  CHECK(Store(dir.file("d.db")).get_run(a).name == "parent");
}

namespace {

// A 150-step run into a fresh database of the test server, with `outage` done to the server once
// it has trained 5 steps (after `before_outage(run directory)`): the run must finish, every step's
// metrics recorded once. Returns the launcher's output.
std::string run_through_outage(test::PostgresServer& pg, const std::string& env, const std::function<bool()>& outage,
                               const std::function<void(const std::string&)>& before_outage = {}) {
  test::TempDir dir;
  const std::string db = pg.new_database();
  const int steps = 150;
  test::run_command("cd '" + test::source_dir() + "' && (" + env + " DSRUN_RUNS_DIR='" + dir.path() + "' '" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --db '" + db +
                    "' --set run.steps=" + std::to_string(steps) + " --set checkpoint.at_end=false --set logging.tensorboard=false > '" + dir.file("out.txt") +
                    "' 2>&1; echo $? > '" + dir.file("code") + "') > /dev/null 2>&1 &");
  std::string id;
  int64_t reached = 0;
  for (int i = 0; i < 1200 && reached < 5; ++i) {
    ::usleep(50000);
    Store store(db);
    for (const auto& r : store.list_runs({})) {
      id = r.id;
      const auto latest = store.latest_metrics(r.id);
      reached = latest.count("loss") ? latest.at("loss").step : 0;
    }
  }
  REQUIRE(reached >= 5);
  if (before_outage) before_outage(dir.file(id));
  REQUIRE(outage());
  test::run_command("for i in $(seq 2400); do [ -f '" + dir.file("code") + "' ] && break; sleep 0.25; done");
  const std::string out = dsrun::read_file(dir.file("out.txt"));
  INFO(out);
  REQUIRE(dsrun::file_exists(dir.file("code")));
  CHECK(dsrun::trim(dsrun::read_file(dir.file("code"))) == "0");
  Store store(db);
  const RunRecord r = store.get_run(id);
  CHECK(r.status == RunStatus::Finished);
  CHECK(r.error.empty());
  const auto losses = store.metric_history(id, "loss");
  CHECK(losses.size() == static_cast<size_t>(steps));  // none lost; the store keeps one row a step
  CHECK(losses.back().step == steps);
  if (!before_outage) CHECK_FALSE(dsrun::file_exists(dir.file(id + "/store_journal-node0.jsonl")));  // replayed and removed
  return out;
}

}  // namespace

TEST_CASE("a PostgreSQL restart mid-run: the launcher reconnects, training goes on, every metric row is recorded once and the run ends finished", "[store][postgresql][reliability]") {
  test::PostgresServer& pg = test::PostgresServer::get();
  if (!pg.available()) {
    WARN(pg.skip_reason());
    return;
  }
  CHECK(test::contains(run_through_outage(pg, "", [&] { return pg.restart(); }), "reconnected"));
}

TEST_CASE("a PostgreSQL server away longer than the reconnect window: the launcher journals its writes beside the run, training goes on, and they are replayed in order", "[store][postgresql][reliability]") {
  test::PostgresServer& pg = test::PostgresServer::get();
  if (!pg.available()) {
    WARN(pg.skip_reason());
    return;
  }
  const std::string out = run_through_outage(pg, "DSRUN_STORE_RECONNECT_S=1", [&] { return pg.away(6); });
  CHECK(test::contains(out, "its writes go to"));
  CHECK(test::contains(out, "journaled write(s) replayed in order"));
}

TEST_CASE("a journal the launcher cannot write (its path taken by a directory) does not end training: the writes wait in memory and reach the store", "[store][postgresql][reliability]") {
  test::PostgresServer& pg = test::PostgresServer::get();
  if (!pg.available()) {
    WARN(pg.skip_reason());
    return;
  }
  // A directory where the journal goes: open() fails (EISDIR) for root too, as a full disk or a
  // read-only run directory would. Before, the launcher died at the first journaled write.
  const std::string out = run_through_outage(pg, "DSRUN_STORE_RECONNECT_S=1", [&] { return pg.away(6); },
                                             [](const std::string& run_dir) { dsrun::make_directories(run_dir + "/store_journal-node0.jsonl"); });
  CHECK(test::contains(out, "cannot write the store journal"));
  CHECK(test::contains(out, "the run's writes wait in memory until the store is back"));
  CHECK(test::contains(out, "journaled write(s) replayed in order"));
}

TEST_CASE("a run deleted from its store while it trains (the database dropped and made again): training goes on, its record waits in the journal and store replay brings it back", "[store][reliability][journal]") {
  test::TempDir dir;
  const std::string db = dir.file("runs.db");
  test::run_command("cd '" + test::source_dir() + "' && ('" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --db '" + db +
                    "' --set run.steps=150 --set checkpoint.at_end=false --set logging.tensorboard=false > '" + dir.file("out.txt") + "' 2>&1; echo $? > '" +
                    dir.file("code") + "') > /dev/null 2>&1 &");
  std::string id;
  for (int i = 0; i < 600 && id.empty(); ++i) {
    ::usleep(50000);
    if (!dsrun::file_exists(db)) continue;
    Store store(db);
    for (const auto& r : store.list_runs({}))
      if (store.latest_metrics(r.id).count("loss") && store.latest_metrics(r.id).at("loss").step >= 5) id = r.id;
  }
  REQUIRE_FALSE(id.empty());
  // A copy kept aside (as a backup would be), then the run gone from the store.
  const std::string sql = "sqlite3 '" + db + "' \"PRAGMA foreign_keys=ON; CREATE TABLE runs_copy AS SELECT * FROM runs WHERE id='" + id +
                          "'; CREATE TABLE metrics_copy AS SELECT * FROM metrics WHERE run_id='" + id + "'; ";
  std::string drop;
  for (const char* table : {"metrics", "metrics_latest", "events", "checkpoints", "run_nodes"}) drop += std::string("DELETE FROM ") + table + " WHERE run_id='" + id + "'; ";
  REQUIRE(test::run_command(sql + drop + "DELETE FROM runs WHERE id='" + id + "';\"").code == 0);
  test::run_command("for i in $(seq 1200); do [ -f '" + dir.file("code") + "' ] && break; sleep 0.1; done");
  const std::string out = dsrun::read_file(dir.file("out.txt"));
  INFO(out);
  REQUIRE(dsrun::file_exists(dir.file("code")));
  CHECK(dsrun::trim(dsrun::read_file(dir.file("code"))) == "0");  // before: the launcher died at its next write
  CHECK(test::contains(out, "is not in the run store"));
  CHECK(test::contains(out, "its record (status, metrics, events) is only in its journal"));
  REQUIRE(dsrun::file_exists(dir.file(id + "/store_journal-node0.jsonl")));
  // Brought back from the copy, then replayed: every step, and the end.
  REQUIRE(test::run_command("sqlite3 '" + db + "' \"INSERT INTO runs SELECT * FROM runs_copy; INSERT INTO metrics SELECT * FROM metrics_copy;\"").code == 0);
  const auto replay = test::run_command("'" DSRUN_BINARY "' store replay " + id + " --db '" + db + "'");
  INFO(replay.text);
  CHECK(replay.code == 0);
  Store store(db);
  CHECK(store.get_run(id).status == RunStatus::Finished);
  CHECK(store.metric_history(id, "loss").size() == 150);
  CHECK_FALSE(dsrun::file_exists(dir.file(id + "/store_journal-node0.jsonl")));
}
