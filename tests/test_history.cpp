// Looking at past runs: the --where language (parsing, errors, injection attempts), filters,
// sorting and export formats on a real store; compare; soft delete, restore and gc; watch;
// TensorBoard records against hand-computed bytes; the HTML report rendered in headless Chromium.
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "storage/run_query.hpp"
#include "storage/store.hpp"
#include "storage/tensorboard.hpp"
#include "store_backends.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

using dsrun::test::contains;
using dsrun::test::dsrun_command;
using dsrun::test::error_of;
using dsrun::test::layout;
using dsrun::test::Run;
using dsrun::test::TempDir;
using dsrun::test::train;

namespace {

dsrun::QueryNames names() {
  dsrun::QueryNames n;
  n.is_config_key = [](const std::string& k) { return k == "optimizer.lr" || k == "batch.micro" || k == "run.name" || k == "logging.tensorboard"; };
  n.known_names = {"optimizer.lr", "batch.micro", "run.name", "logging.tensorboard"};
  return n;
}

// A store with five runs of known config, metrics and status.
void fill_store(const std::string& db) {
  dsrun::Store store(db);
  struct R {
    const char* name;
    double lr;
    double val_loss;
    dsrun::RunStatus status;
    const char* model;
  } runs[] = {{"a", 1e-3, 2.1, dsrun::RunStatus::Finished, "deepseek-tiny"},
              {"b", 5e-5, 2.0, dsrun::RunStatus::Finished, "deepseek-tiny"},
              {"c", 3e-3, 2.9, dsrun::RunStatus::Finished, "resnet-18"},
              {"d", 2e-3, 2.3, dsrun::RunStatus::Failed, "deepseek-tiny"},
              {"e", 1e-2, 1.5, dsrun::RunStatus::Finished, "deepseek-7b"}};
  for (const auto& r : runs) {
    dsrun::NewRun n;
    n.name = r.name;
    n.recipe_text = n.config_toml = "x";
    n.model = r.model;
    n.hardware = "cpu";
    const bool tensorboard = r.lr < 2.5e-3;  // a, b and d
    n.config_json = nlohmann::json({{"optimizer.lr", r.lr}, {"batch.micro", 2}, {"run.name", r.name}, {"logging.tensorboard", tensorboard}}).dump();
    const std::string id = store.create_run(n);
    store.set_status(id, dsrun::RunStatus::Running);
    store.add_metrics(id, 10, {{"val_loss", r.val_loss}, {"loss", r.val_loss + 0.1}});
    store.set_status(id, r.status, r.status == dsrun::RunStatus::Failed ? "boom" : "");
  }
}

// Bytes of the regular files under `path`, as the file system reports them.
int64_t disk_bytes(const std::string& path) {
  int64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path))
    if (e.is_regular_file() && !e.is_symlink()) total += static_cast<int64_t>(e.file_size());
  return total;
}

// Three runs recorded as running: `dead`, whose launcher's process on this host has exited;
// `silent`, on another host (not checkable from here) and without a heartbeat for 3 h; `live`,
// this test process.
struct Launchers {
  std::string dead, silent, live;
  pid_t exited = 0;  // dead's launcher
};
Launchers three_launchers(dsrun::Store& store) {
  Launchers l;
  l.exited = dsrun::test::exited_process();
  l.dead = dsrun::test::running_run(store, "dead");
  l.silent = dsrun::test::running_run(store, "silent");
  l.live = dsrun::test::running_run(store, "live");
  const std::string host = dsrun::read_host_facts().hostname;
  store.run_heartbeat(l.dead, host, l.exited);
  store.run_heartbeat(l.silent, "another-host", 1);
  store.database().execute_script("UPDATE runs SET heartbeat_at = heartbeat_at - 3 * 3600 WHERE id = '" + l.silent + "'");
  store.run_heartbeat(l.live, host, ::getpid());
  return l;
}

// `dsrun ARGS --db DB` under a time limit, for commands that would wait forever if they were wrong.
dsrun::test::CommandOutput dsrun_with_timeout(const std::string& db, const std::string& args, int seconds) {
  return dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && timeout " + std::to_string(seconds) + " '" DSRUN_BINARY "' " + args +
                                  " --db '" + db + "'");
}

// The lines of `text` from the one starting with `from` up to (not including) the first empty line.
std::string section(const std::string& text, const std::string& from) {
  const size_t at = text.find("\n" + from + "\n");
  if (at == std::string::npos) return "";
  const size_t end = text.find("\n\n", at + 1);
  return text.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1);
}

std::vector<std::string> names_of(const std::vector<dsrun::RunRecord>& runs) {
  std::vector<std::string> out;
  for (const auto& r : runs) out.push_back(r.name);
  return out;
}

}  // namespace

TEST_CASE("the --where language parses into parameterised SQL, and errors point at the bad token", "[history][query]") {
  dsrun::SqlFragment f = dsrun::parse_where("optimizer.lr > 1e-4 and metrics.val_loss < 2.5 and status = finished", names());
  CHECK(contains(f.sql, "json_extract(runs.config_json, ?) > ?"));
  CHECK(contains(f.sql, "metrics_latest"));
  CHECK(contains(f.sql, "(runs.status = ?)"));
  REQUIRE(f.params.size() == 5);
  CHECK(f.params[0].text == "$.\"optimizer.lr\"");
  CHECK(f.params[1].number == 1e-4);
  CHECK(f.params[3].number == 2.5);
  CHECK(f.params[4].text == "finished");
  CHECK_FALSE(contains(f.sql, "finished"));  // values never enter the SQL text

  std::string e = error_of([] { dsrun::parse_where("optimizer.lrr > 1e-4", names()); });
  CHECK(contains(e, "unknown name \"optimizer.lrr\" at column 1"));
  CHECK(contains(e, "did you mean optimizer.lr?"));
  e = error_of([] { dsrun::parse_where("status = 'x'; DROP TABLE runs", names()); });
  CHECK(contains(e, "unexpected character \";\" at column 13"));
  CHECK(contains(e, "\n                ^"));  // the caret under the ';'
  CHECK(contains(error_of([] { dsrun::parse_where("status = 'x", names()); }), "unterminated string"));
  CHECK(contains(error_of([] { dsrun::parse_where("(status = x", names()); }), "expected \")\""));
  CHECK(contains(error_of([] { dsrun::parse_where("status finished", names()); }), "expected a comparison"));
  CHECK(contains(error_of([] { dsrun::parse_where("1 = 1", names()); }), "expected a name"));
  CHECK(dsrun::parse_duration("2 days") == 172800);
  CHECK(dsrun::parse_duration("3h") == 10800);
  CHECK(contains(error_of([] { dsrun::parse_duration("soon"); }), "cannot read \"soon\" as a duration"));
}

TEST_CASE("history filters, queries and sorts a real store, and injection attempts stay data", "[history][query]") {
  TempDir dir;
  for (const auto& backend : dsrun::test::store_backends(dir)) {
  INFO(backend.name);
  const std::string db = backend.location;
  fill_store(db);
  dsrun::Store store(db);
  // The query carries the user's text; each store renders it in its own dialect (PostgreSQL reads
  // config values from JSON differently): nothing here says which backend it is.
  dsrun::RunQuery q;
  q.where = "optimizer.lr > 1e-4 and metrics.val_loss < 2.5 and status = finished";
  q.sort = "metrics.val_loss";
  q.names = names();
  q.ascending = true;
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"e", "a"});
  q = {};
  q.model = "tiny";
  q.sort = "optimizer.lr";
  q.names = names();
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"d", "a", "b"});
  q = {};
  q.where = "not (status = finished) or run.name = 'c'";
  q.names = names();
  q.ascending = true;
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"c", "d"});
  q = {};
  q.since_seconds = 3600;
  CHECK(store.query_runs(q).size() == 5);

  // A quote inside a string is a doubled quote and stays inside the value: nothing is injected.
  q = {};
  q.where = "name = 'a'' OR 1=1 --'";
  q.names = names();
  CHECK(store.query_runs(q).empty());
  q.where = "name = \"x\"\" ; DROP TABLE runs; --\"";
  q.names = names();
  CHECK(store.query_runs(q).empty());
  CHECK(store.count_runs() == 5);

  auto csv = dsrun_with_timeout(db, "history --where \"metrics.val_loss < 2.2\" --sort metrics.val_loss --asc --csv", 60);
  INFO(csv.text);
  CHECK(csv.code == 0);
  auto lines = dsrun::split(csv.text, '\n');
  REQUIRE(lines.size() >= 4);
  CHECK(dsrun::starts_with(lines[0], "id,name,status,"));
  CHECK(contains(lines[1], ",e,finished,"));
  CHECK(contains(lines[2], ",b,finished,"));
  auto json = nlohmann::json::parse(dsrun_with_timeout(db, "history --status failed --json", 60).text);
  REQUIRE(json.size() == 1);
  CHECK(json[0]["name"] == "d");
  CHECK(json[0]["error"] == "boom");
  auto bad = dsrun_with_timeout(db, "history --where \"status = 'x'; DROP TABLE runs\"", 60);
  CHECK(bad.code == 1);
  CHECK(contains(bad.text, "--where: unexpected character"));
  // Booleans, text and LIKE on config keys read the same on both backends.
  q = {};
  q.where = "logging.tensorboard = true and run.name like 'A%'";
  q.names = names();
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"a"});
  q.where = "run.name = 'c' or batch.micro > 2";
  q.names = names();
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"c"});
  CHECK(store.count_runs() == 5);
  }
}

TEST_CASE("history --since reads natural phrases and refuses zero, negative and non-finite spans", "[history][query]") {
  CHECK(dsrun::parse_duration("2 days") == 172800);
  CHECK(dsrun::parse_duration("last 2 days") == 172800);
  CHECK(dsrun::parse_duration("2 days ago") == 172800);
  CHECK(dsrun::parse_duration("Last  Day") == 86400);
  CHECK(dsrun::parse_duration("last week") == 604800);
  CHECK(dsrun::parse_duration("1 week") == 604800);
  CHECK(dsrun::parse_duration("30 min") == 1800);
  CHECK(dsrun::parse_duration("3h") == 10800);
  const double yesterday = dsrun::parse_duration("yesterday");  // since yesterday's local midnight
  CHECK(yesterday >= 86400 - 3600);                              // an hour of slack for daylight saving
  CHECK(yesterday <= 2 * 86400 + 3600);
  for (const char* bad : {"0 days", "inf days", "-2 h", "nan days", "1e400 days", "last 0 days"}) {
    INFO(bad);
    const std::string e = error_of([&] { dsrun::parse_duration(bad); });
    CHECK(contains(e, "--since: \"" + std::string(bad) + "\" is not a duration above zero"));
    CHECK(contains(e, "fix: "));
  }
  CHECK(contains(error_of([] { dsrun::parse_duration("last fortnight"); }), "--since: cannot read"));
  CHECK(contains(error_of([] { dsrun::parse_duration("day"); }), "--since: cannot read"));

  TempDir dir;
  fill_store(dir.file("runs.db"));
  auto phrase = dsrun_command(dir, "history --since 'last 2 days' --csv");
  INFO(phrase.text);
  CHECK(phrase.code == 0);
  CHECK(dsrun::split(phrase.text, '\n').size() >= 6);  // the header and five runs
  auto zero = dsrun_command(dir, "history --since '0 days'");
  CHECK(zero.code == 1);
  CHECK(contains(zero.text, "--since"));
}

TEST_CASE("history --where refuses ( and not nested deeper than 64 and more than 256 conditions, at the token", "[history][query]") {
  TempDir dir;
  fill_store(dir.file("runs.db"));
  dsrun::Store store(dir.file("runs.db"));
  auto repeat = [](const std::string& s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += s;
    return out;
  };
  // At the limit the query runs in SQLite (the metrics lookup is the deepest SQL a condition makes).
  for (const std::string& expression : {repeat("(", 64) + "metrics.val_loss < 2.5" + repeat(")", 64), repeat("not ", 64) + "metrics.val_loss < 2.5",
                                        repeat("not (", 32) + "metrics.val_loss < 2.5" + repeat(")", 32)}) {
    INFO(expression);
    dsrun::RunQuery q;
    q.where = expression;
    q.names = names();
    CHECK(store.query_runs(q).size() == 4);  // an even number of nots: val_loss < 2.5
  }
  std::string e = error_of([&] { dsrun::parse_where(repeat("(", 65) + "status = x" + repeat(")", 65), names()); });
  CHECK(contains(e, "--where: nested deeper than 64 levels of ( and not at column 65"));
  CHECK(contains(e, "\n    " + std::string(64, ' ') + "^"));  // the caret under the 65th (
  CHECK(contains(e, "fix: "));
  e = error_of([&] { dsrun::parse_where("status = x and " + repeat("not ", 65) + "status = y", names()); });
  CHECK(contains(e, "nested deeper than 64 levels of ( and not at column " + std::to_string(15 + 64 * 4 + 1)));
  // Far deeper once crashed the parser (stack overflow) or reached SQLite's own "parser stack overflow".
  CHECK(contains(error_of([&] { dsrun::parse_where(repeat("(", 30000) + "status = x", names()); }), "nested deeper than 64"));
  CHECK(contains(error_of([&] { dsrun::parse_where(repeat("not ", 30000) + "status = x", names()); }), "nested deeper than 64"));
  auto cli = dsrun_command(dir, "history --where '" + repeat("(", 1000) + "status = x" + repeat(")", 1000) + "'");
  CHECK(cli.code == 1);
  CHECK(contains(cli.text, "nested deeper than 64"));
  CHECK_FALSE(contains(cli.text, "SQLite"));

  // LIKE patterns SQLite would refuse (too long) or search slowly (many %) are --where errors.
  e = error_of([&] { dsrun::parse_where("name like '" + repeat("%a", 30000) + "'", names()); });
  CHECK(contains(e, "--where: a like pattern of 60000 bytes (at most 1000) at column 11"));
  CHECK(e.size() < 600);  // a window of the expression around the caret, not all of it
  e = error_of([&] { dsrun::parse_where("status = x and name like '" + repeat("%_", 20) + "x'", names()); });
  CHECK(contains(e, "a like pattern with 20 % wildcards (at most 16) at column 26"));
  CHECK(contains(e, "\n    " + std::string(25, ' ') + "^"));
  cli = dsrun_command(dir, "history --where \"name like '" + repeat("%a", 30000) + "'\"");
  CHECK(cli.code == 1);
  CHECK(contains(cli.text, "a like pattern of 60000 bytes"));
  CHECK_FALSE(contains(cli.text, "SQLite"));
  CHECK_FALSE(contains(cli.text, ".cpp"));

  // Long and / or chains nest in SQLite too: 256 conditions run, more are refused.
  dsrun::RunQuery q;
  q.where = "metrics.val_loss < 2.5" + repeat(" or metrics.val_loss < 0", 255);
  q.names = names();
  CHECK(store.query_runs(q).size() == 4);
  e = error_of([&] { dsrun::parse_where("status = x" + repeat(" or status = x", 256), names()); });
  CHECK(contains(e, "--where: more than 256 conditions at column " + std::to_string(10 + 255 * 14 + 5)));
}

TEST_CASE("bare true and false in --where match boolean config keys", "[history][query]") {
  TempDir dir;
  fill_store(dir.file("runs.db"));
  dsrun::Store store(dir.file("runs.db"));
  auto matching = [&](const std::string& expression) {
    dsrun::RunQuery q;
    q.where = expression;
    q.names = names();
    q.ascending = true;
    return names_of(store.query_runs(q));
  };
  CHECK(matching("logging.tensorboard = true") == std::vector<std::string>{"a", "b", "d"});
  CHECK(matching("logging.tensorboard = FALSE") == std::vector<std::string>{"c", "e"});
  CHECK(matching("logging.tensorboard != true and status = finished") == std::vector<std::string>{"c", "e"});
  CHECK(matching("logging.tensorboard = 'true'").empty());  // quoted, it is the text "true"
  auto cli = dsrun_command(dir, "history --where 'logging.tensorboard = true' --csv");
  INFO(cli.text);
  CHECK(cli.code == 0);
  CHECK(dsrun::split(cli.text, '\n').size() >= 4);  // the header and three runs
}

TEST_CASE("history --sort errors name --sort, and history says when filters match nothing", "[history][query][cli]") {
  const std::string e = error_of([] { dsrun::sort_expression("bogus", names()); });
  CHECK(contains(e, "--sort: unknown name \"bogus\""));
  CHECK_FALSE(contains(e, "--where"));
  TempDir dir;
  fill_store(dir.file("runs.db"));
  auto sort = dsrun_command(dir, "history --sort bogus");
  CHECK(sort.code == 1);
  CHECK(contains(sort.text, "--sort: unknown name \"bogus\""));
  for (const char* filter : {"--model nosuch", "--where 'metrics.val_loss < 0'", "--status killed", "--deleted", "--since '1 s' --recipe x"}) {
    auto none = dsrun_command(dir, std::string("history ") + filter);
    INFO(filter << "\n" << none.text);
    CHECK(none.code == 0);
    CHECK(contains(none.text, "no runs match"));
    CHECK_FALSE(contains(none.text, "no runs yet"));
  }
  TempDir empty;
  dsrun::Store{empty.file("runs.db")};
  CHECK(contains(dsrun_command(empty, "history").text, "no runs yet"));
}

TEST_CASE("soft delete hides a run, restore brings it back, gc frees the files of deleted runs", "[history][gc]") {
  TempDir dir;
  Run run = train(dir, layout(0, 1) + " --set run.steps=4 --set checkpoint.every=2");
  REQUIRE(run.code == 0);
  CHECK(dsrun::is_directory(dir.file(run.id)));
  CHECK(dsrun_command(dir, "delete " + run.id).code == 0);
  CHECK_FALSE(contains(dsrun_command(dir, "history").text, run.id));
  CHECK(contains(dsrun_command(dir, "history --deleted").text, run.id));
  CHECK(dsrun_command(dir, "restore " + run.id).code == 0);
  CHECK(contains(dsrun_command(dir, "history").text, run.id));
  auto running = dsrun_command(dir, "gc --dry-run");
  CHECK(contains(running.text, "gc would free 0 B"));  // nothing deleted any more
  REQUIRE(dsrun_command(dir, "delete " + run.id).code == 0);
  auto gc = dsrun_command(dir, "gc");
  INFO(gc.text);
  CHECK(gc.code == 0);
  CHECK(contains(gc.text, "freed"));
  CHECK_FALSE(contains(gc.text, "gc freed 0 B"));
  CHECK_FALSE(dsrun::is_directory(dir.file(run.id)));
  CHECK(dsrun::Store(dir.file("runs.db")).checkpoints(run.id).empty());
}

TEST_CASE("gc reports the bytes it frees exactly once, checkpoints inside the run directory or elsewhere", "[history][gc]") {
  TempDir dir;
  Run inside = train(dir, layout(0, 1) + " --set run.steps=4 --set checkpoint.every=2");
  Run outside = train(dir, layout(0, 1) + " --set run.steps=4 --set checkpoint.every=2 --set checkpoint.dir='" + dir.file("elsewhere") + "'");
  REQUIRE(inside.code == 0);
  REQUIRE(outside.code == 0);
  REQUIRE_FALSE(dsrun::Store(dir.file("runs.db")).checkpoints(inside.id).empty());
  REQUIRE(dsrun::is_directory(dir.file("elsewhere/" + outside.id)));
  const int64_t on_disk = disk_bytes(dir.file(inside.id)) + disk_bytes(dir.file(outside.id)) + disk_bytes(dir.file("elsewhere/" + outside.id));
  REQUIRE(dsrun_command(dir, "delete " + inside.id + " " + outside.id).code == 0);
  const std::string expected = "(" + std::to_string(on_disk) + " bytes) from 2 deleted run(s)";
  auto dry = dsrun_command(dir, "gc --dry-run");
  INFO(dry.text);
  CHECK(contains(dry.text, "gc would free " + dsrun::format_bytes(static_cast<double>(on_disk)) + " " + expected));
  auto gc = dsrun_command(dir, "gc");
  INFO(gc.text);
  CHECK(gc.code == 0);
  CHECK(contains(gc.text, expected));
  CHECK_FALSE(dsrun::is_directory(dir.file(inside.id)));
  CHECK_FALSE(dsrun::is_directory(dir.file(outside.id)));
  CHECK_FALSE(dsrun::is_directory(dir.file("elsewhere/" + outside.id)));
}

TEST_CASE("watch and delete tell a run whose launcher is gone from a live one", "[history][watch]") {
  TempDir dir;
  const std::string db = dir.file("runs.db");
  dsrun::Store store(db);
  const Launchers l = three_launchers(store);
  const std::string &dead = l.dead, &silent = l.silent, &live = l.live;
  const pid_t exited = l.exited;

  auto watch_dead = dsrun_with_timeout(db, "watch " + dead + " --interval 0.1", 20);
  INFO(watch_dead.text);
  CHECK(watch_dead.code == 1);  // not 124: it did not wait for the time limit
  CHECK(contains(watch_dead.text, "marked running, but its launcher, process " + std::to_string(exited) + " on this host, has exited"));
  CHECK(contains(watch_dead.text, "dsrun resume " + dead + " --force"));
  auto watch_silent = dsrun_with_timeout(db, "watch " + silent + " --interval 0.1", 20);
  INFO(watch_silent.text);
  CHECK(watch_silent.code == 1);
  CHECK(contains(watch_silent.text, "no heartbeat from its launcher on another-host for 3.0 h"));
  CHECK(dsrun_with_timeout(db, "watch " + live + " --interval 0.1", 2).code == 124);  // still following

  auto delete_live = dsrun_with_timeout(db, "delete " + live, 20);
  CHECK(delete_live.code == 1);
  CHECK(contains(delete_live.text, "is running"));
  CHECK_FALSE(contains(delete_live.text, "--force"));  // it would not help: the launcher is alive
  CHECK(dsrun_with_timeout(db, "delete " + live + " --force", 20).code == 1);
  auto delete_dead = dsrun_with_timeout(db, "delete " + dead, 20);
  CHECK(delete_dead.code == 1);
  CHECK(contains(delete_dead.text, "pass --force"));
  CHECK(dsrun_with_timeout(db, "delete " + dead + " " + silent + " --force", 20).code == 0);
  CHECK(store.get_run(dead).status == dsrun::RunStatus::Killed);
  CHECK(contains(store.get_run(silent).error, "deleted with --force"));
  CHECK(store.get_run(live).status == dsrun::RunStatus::Running);
  auto deleted = dsrun_with_timeout(db, "history --deleted", 20).text;
  CHECK(contains(deleted, dead));
  CHECK(contains(deleted, silent));
}

TEST_CASE("compare: peak memory row per rank with a stable JSON key, no best for lr, plan bytes readable", "[history][compare]") {
  TempDir dir;
  Run a = train(dir, layout(0, 1) + " --set run.steps=3");
  Run b = train(dir, layout(1, 2) + " --set run.steps=3");
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  auto out = dsrun_command(dir, "compare " + a.id + " " + b.id);
  INFO(out.text);
  CHECK(out.code == 0);
  CHECK(contains(out.text, "peak memory rank 0 (CPU RSS)"));
  CHECK(contains(out.text, "peak memory rank 1 (CPU RSS)"));
  CHECK(std::regex_search(out.text, std::regex("\n  lr best +- +-\n")));  // no best for a setting
  CHECK(std::regex_search(out.text, std::regex("\n  loss best +[0-9.]+ @[0-9]+ ")));
  const std::string plan = section(out.text, "plan differences");
  CHECK(contains(plan, "memory_per_rank."));
  CHECK(contains(plan, "iB"));          // KiB, MiB or GiB
  CHECK_FALSE(contains(plan, "e+0"));   // not 3.47158e+06

  auto j = nlohmann::json::parse(dsrun_command(dir, "compare " + a.id + " " + b.id + " --json").text);
  const auto& peaks = j["predicted_vs_measured"][b.id]["peak memory per rank"];
  REQUIRE(peaks.is_array());
  REQUIRE(peaks.size() == 2);
  for (int rank = 0; rank < 2; ++rank) {
    CHECK(peaks[rank]["rank"] == rank);
    CHECK(peaks[rank]["kind"] == "CPU RSS");
    const double measured = peaks[rank]["measured"], predicted = peaks[rank]["predicted"], error = peaks[rank]["error_pct"];
    CHECK(measured > 0);
    CHECK(error == Approx((measured - predicted) / predicted * 100));
  }
  CHECK(j["predicted_vs_measured"][a.id]["peak memory per rank"].size() == 1);
  CHECK(j["predicted_vs_measured"][a.id]["model states per rank"].contains("error_pct"));
  CHECK(j["metrics"][a.id]["lr"]["best"].is_null());
  CHECK(j["metrics"][a.id]["loss"]["best"].is_number());
}

TEST_CASE("compare shows config and plan differences, metrics, and predictions beside measurements", "[history][compare]") {
  TempDir dir;
  Run a = train(dir, layout(0, 1) + " --set run.steps=4");
  Run b = train(dir, layout(1, 2) + " --set run.steps=4 --set optimizer.lr=1e-3");
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  auto out = dsrun_command(dir, "compare " + a.id + " " + b.id + " --at-step 2");
  INFO(out.text);
  CHECK(out.code == 0);
  CHECK(contains(out.text, "config differences"));
  CHECK(contains(out.text, "optimizer.lr"));
  CHECK(contains(out.text, "parallel.zero_stage"));
  CHECK_FALSE(contains(out.text, "  model.hidden "));  // equal keys are left out
  CHECK(contains(out.text, "plan differences"));
  CHECK(contains(out.text, "loss final"));
  CHECK(contains(out.text, "loss at step 2"));
  CHECK(contains(out.text, "predicted vs measured"));
  CHECK(contains(out.text, "model states per rank"));
  CHECK(contains(out.text, "step seconds"));
  CHECK(contains(out.text, "%"));
  auto j = nlohmann::json::parse(dsrun_command(dir, "compare " + a.id + " " + b.id + " --json").text);
  CHECK(j["metrics"][a.id]["loss"]["final_step"] == 4);
  const double measured = j["predicted_vs_measured"][b.id]["model states per rank"]["measured"];
  CHECK(measured > 0);
}

TEST_CASE("watch follows a run from the store until it ends", "[history][watch]") {
  TempDir dir;
  Run run = train(dir, layout(0, 1) + " --set run.steps=3");
  REQUIRE(run.code == 0);
  auto out = dsrun_command(dir, "watch " + run.id + " --interval 0.1");
  INFO(out.text);
  CHECK(out.code == 0);
  CHECK(contains(out.text, "step 3  loss"));
  CHECK(contains(out.text, "run " + run.id + " finished"));
  // What tells a live launcher from a dead one (launcher_gone): its host, process and heartbeat.
  const dsrun::RunRecord r = dsrun::Store(dir.file("runs.db")).get_run(run.id);
  CHECK(r.host == dsrun::read_host_facts().hostname);
  CHECK(r.pid > 0);
  CHECK(r.heartbeat_at >= r.started_at);
}

TEST_CASE("TensorBoard records: CRC-32C, masking and Event bytes as computed by hand", "[history][tensorboard]") {
  CHECK(dsrun::crc32c("123456789", 9) == 0xE3069283u);  // the standard CRC-32C check value
  const uint32_t c = dsrun::crc32c("abc", 3);
  CHECK(dsrun::masked_crc32c("abc", 3) == ((c >> 15 | c << 17) + 0xa282ead8u));
  // Event{wall_time: 1.0, step: 5, summary {value {tag: "loss", simple_value: 0.5}}}
  const unsigned char expected[] = {0x09, 0, 0, 0, 0, 0, 0, 0xF0, 0x3F,  // field 1, fixed64: 1.0
                                    0x10, 0x05,                           // field 2, varint: 5
                                    0x2a, 0x0d,                           // field 5, 13 bytes: Summary
                                    0x0a, 0x0b,                           //   field 1, 11 bytes: Value
                                    0x0a, 0x04, 'l', 'o', 's', 's',       //     tag "loss"
                                    0x15, 0, 0, 0, 0x3F};                 //     simple_value 0.5f
  const std::string event = dsrun::event_scalars(1.0, 5, {{"loss", 0.5}});
  CHECK(event == std::string(reinterpret_cast<const char*>(expected), sizeof expected));
  const std::string record = dsrun::tfrecord(event);
  REQUIRE(record.size() == 8 + 4 + event.size() + 4);
  uint64_t length = 0;
  std::memcpy(&length, record.data(), 8);
  CHECK(length == event.size());
  uint32_t length_crc = 0, data_crc = 0;
  std::memcpy(&length_crc, record.data() + 8, 4);
  std::memcpy(&data_crc, record.data() + 12 + event.size(), 4);
  CHECK(length_crc == dsrun::masked_crc32c(record.data(), 8));
  CHECK(data_crc == dsrun::masked_crc32c(event.data(), event.size()));
  CHECK(dsrun::event_file_version(0.0).substr(9) == std::string("\x1a\x0d") + "brain.Event:2");
}

TEST_CASE("a run writes TensorBoard event files whose every record checks out", "[history][tensorboard]") {
  TempDir dir;
  Run run = train(dir, layout(0, 1) + " --set run.steps=3");
  REQUIRE(run.code == 0);
  auto files = dsrun::list_directory(dir.file(run.id + "/tensorboard"));
  REQUIRE(files.size() == 1);
  CHECK(dsrun::starts_with(files[0], "events.out.tfevents."));
  std::string bytes = dsrun::read_file(dir.file(run.id + "/tensorboard/" + files[0]));
  size_t at = 0;
  int records = 0, losses = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    uint64_t length = 0;
    uint32_t crc = 0;
    std::memcpy(&length, bytes.data() + at, 8);
    std::memcpy(&crc, bytes.data() + at + 8, 4);
    CHECK(crc == dsrun::masked_crc32c(bytes.data() + at, 8));
    REQUIRE(at + 12 + length + 4 <= bytes.size());
    const std::string data = bytes.substr(at + 12, length);
    std::memcpy(&crc, bytes.data() + at + 12 + length, 4);
    CHECK(crc == dsrun::masked_crc32c(data.data(), data.size()));
    losses += contains(data, std::string("\x0a\x04", 2) + "loss");
    at += 12 + length + 4;
    ++records;
  }
  CHECK(records == 1 + 3);  // the file version, then one event per step
  CHECK(losses == 3);
}

TEST_CASE("the HTML report renders in headless Chromium with a chart per metric and one line per run", "[history][report]") {
  TempDir dir;
  Run a = train(dir, layout(0, 1) + " --set run.steps=5");
  Run b = train(dir, layout(0, 1) + " --set run.steps=5 --set optimizer.lr=1e-3");
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  auto out = dsrun_command(dir, "report " + a.id + " " + b.id + " -o '" + dir.file("report.html") + "'");
  REQUIRE(out.code == 0);
  const std::string html = dsrun::read_file(dir.file("report.html"));
  CHECK_FALSE(contains(html, "<script"));  // self-contained, no scripts
  const bool fetches = contains(html, "src=\"http") || contains(html, "href=\"http");
  CHECK_FALSE(fetches);  // nothing fetched from the network

  auto chromium = dsrun::test::run_command("command -v chromium");
  INFO("Chromium is needed for this test: ./setup.sh --with-test-tools installs Debian's chromium");
  REQUIRE(chromium.code == 0);
  const std::string flags = "--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir='" + dir.file("chrome") + "'";
  auto dom = dsrun::test::run_command("chromium " + flags + " --dump-dom 'file://" + dir.file("report.html") + "' 2>/dev/null");
  REQUIRE(dom.code == 0);
  CHECK(contains(dom.text, "data-metric=\"loss\""));
  CHECK(contains(dom.text, "data-metric=\"lr\""));
  CHECK(contains(dom.text, "data-metric=\"tokens_per_second\""));
  CHECK(contains(dom.text, "data-metric=\"model states per rank\""));  // memory: measured beside the plan
  size_t lines = 0;
  for (size_t at = dom.text.find("data-metric=\"loss\""); at != std::string::npos && at < dom.text.find("</svg>", dom.text.find("data-metric=\"loss\"")); at = dom.text.find("<polyline", at + 1))
    lines += dom.text.compare(at, 9, "<polyline") == 0;
  CHECK(lines == 2);  // both runs overlaid on the loss chart
  CHECK(contains(dom.text, a.id));
  CHECK(contains(dom.text, b.id));

  const std::string shot = dsrun::test::source_dir() + "/build/tests/report_screenshot.png";
  auto png = dsrun::test::run_command("chromium " + flags + " --window-size=1280,1600 --screenshot='" + shot + "' 'file://" + dir.file("report.html") + "' 2>&1");
  REQUIRE(png.code == 0);
  const std::string image = dsrun::read_file(shot);
  REQUIRE(image.size() > 10000);
  CHECK(image.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);
  WARN("report screenshot: " << shot << " (" << image.size() << " bytes)");
}

TEST_CASE("the HTML report's labels fit inside their charts, a run named twice is drawn once, a MoE run's expert load by layer", "[history][report]") {
  TempDir dir;
  // A MoE run with a capacity (3 MoE layers of 4 experts): its load and dropped tokens are charted too.
  Run a = train(dir, layout(1, 2) + " --set run.steps=3 --set model.moe.routed_experts=4 --set model.moe.top_k=2 --set model.moe.intermediate=64 --set model.moe.capacity_factor=1");
  REQUIRE(a.code == 0);
  auto out = dsrun_command(dir, "report " + a.id + " " + a.id.substr(0, 6) + " -o '" + dir.file("report.html") + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "(1 run(s))"));
  std::string html = dsrun::read_file(dir.file("report.html"));
  const size_t chart = html.find("data-metric=\"loss\"");
  REQUIRE(chart != std::string::npos);
  size_t lines = 0;
  for (size_t at = html.find("<polyline", chart); at != std::string::npos && at < html.find("</svg>", chart); at = html.find("<polyline", at + 1)) ++lines;
  CHECK(lines == 1);
  CHECK(contains(html, "data-metric=\"expert_load_max\""));
  CHECK(contains(html, "data-metric=\"dropped_tokens\""));
  const size_t layers = html.find("data-metric=\"expert load by layer");
  REQUIRE(layers != std::string::npos);
  lines = 0;
  for (size_t at = html.find("<polyline", layers); at != std::string::npos && at < html.find("</svg>", layers); at = html.find("<polyline", at + 1)) ++lines;
  CHECK(lines == 3);  // one per MoE layer

  // Chromium measures every label: the test's own copy of the page gets a script that lists the
  // texts reaching past their chart's edges (the report itself has no scripts).
  const std::string measure =
      "<script>const out=[];for(const svg of document.querySelectorAll('svg.chart')){const w=svg.width.baseVal.value;"
      "for(const t of svg.querySelectorAll('text')){const b=t.getBBox();if(b.x<0||b.x+b.width>w)out.push(svg.dataset.metric+': '+t.textContent);}}"
      "document.body.insertAdjacentHTML('beforeend','<pre id=\"clipped\">['+out.join('|')+']</pre>');</script>";
  html.insert(html.rfind("</body>"), measure);
  dsrun::write_file_atomic(dir.file("measure.html"), html);
  auto chromium = dsrun::test::run_command("command -v chromium");
  INFO("Chromium is needed for this test: ./setup.sh --with-test-tools installs Debian's chromium");
  REQUIRE(chromium.code == 0);
  const std::string flags = "--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir='" + dir.file("chrome") + "'";
  auto dom = dsrun::test::run_command("chromium " + flags + " --dump-dom 'file://" + dir.file("measure.html") + "' 2>/dev/null");
  REQUIRE(dom.code == 0);
  CHECK(contains(dom.text, "data-metric=\"model states per rank\""));
  CHECK(contains(dom.text, "<pre id=\"clipped\">[]</pre>"));
}

TEST_CASE("history and show mark a run lost whose launcher is gone, at its last step, and a launcher heard from again takes it back", "[history][store]") {
  TempDir dir;
  const std::string db = dir.file("runs.db");
  dsrun::Store store(db);
  const Launchers l = three_launchers(store);
  const std::string &dead = l.dead, &silent = l.silent, &live = l.live;
  const pid_t exited = l.exited;
  store.add_metrics(dead, 7, {{"loss", 1.0}});

  auto history = dsrun_with_timeout(db, "history", 20);
  INFO(history.text);
  CHECK(history.code == 0);
  CHECK(store.get_run(dead).status == dsrun::RunStatus::Lost);
  CHECK(contains(store.get_run(dead).error, "process " + std::to_string(exited) + " on this host, has exited; last known at step 7"));
  CHECK(store.get_run(silent).status == dsrun::RunStatus::Lost);
  CHECK(contains(store.get_run(silent).error, "no heartbeat from its launcher on another-host"));
  CHECK(store.get_run(live).status == dsrun::RunStatus::Running);
  int lost_events = 0;
  for (const auto& e : store.events(dead)) lost_events += e.kind == "lost";
  CHECK(lost_events == 1);
  CHECK(dsrun_with_timeout(db, "show " + dead, 20).code == 0);  // a second reader changes nothing more
  lost_events = 0;
  for (const auto& e : store.events(dead)) lost_events += e.kind == "lost";
  CHECK(lost_events == 1);
  // The silent launcher was only cut off from the store: its next heartbeat makes the run running again.
  store.run_heartbeat(silent, "another-host", 1);
  CHECK(store.get_run(silent).status == dsrun::RunStatus::Running);
  // A lost run resumes without --force (its launcher is known gone).
  auto resume = dsrun_with_timeout(db, "resume " + dead, 20);
  CHECK_FALSE(contains(resume.text, "--force"));
}


TEST_CASE("names written into a shared store with terminal escapes print as escapes, and a lost run's status reads once", "[history][terminal]") {
  TempDir dir;
  const std::string db = dir.file("runs.db");
  dsrun::Store store(db);
  const Launchers l = three_launchers(store);
  // Another writer of the store names a run with an OSC title change, a bell, a carriage return,
  // a newline, a C1 control and an erase of the line.
  const std::string evil = "evil\x1b]0;pwned\x07\rfake\nline\xc2\x9b" "2K";
  store.database().execute_script("UPDATE runs SET name = '" + evil + "' WHERE id = '" + l.dead + "'");
  for (const std::string& args : {std::string("history"), "show " + l.dead}) {
    INFO(args);
    const auto out = dsrun_with_timeout(db, args, 20);
    CHECK(out.code == 0);
    for (const char raw : {'\x1b', '\x07', '\r'}) CHECK(out.text.find(raw) == std::string::npos);
    CHECK_FALSE(contains(out.text, "\xc2\x9b"));
    CHECK(contains(out.text, "evil\\x1b]0;pwned\\x07\\x0dfake\\x0aline\\u009b2K"));
  }
  // history marked the dead launcher's run lost; show says "lost" once.
  CHECK(store.get_run(l.dead).status == dsrun::RunStatus::Lost);
  const auto shown = dsrun_with_timeout(db, "show " + l.dead, 20);
  CHECK(contains(shown.text, "status      lost: its launcher, process"));
  CHECK_FALSE(contains(shown.text, "lost: lost:"));
}

TEST_CASE("a run whose launcher journaled its finish: show and resume replay the journal first, and resume then trains nothing", "[history][journal]") {
  TempDir dir;
  const std::string db = dir.file("runs.db");
  const std::string id = [&] {
    dsrun::Store store(db);
    const Launchers l = three_launchers(store);
    store.add_metrics(l.dead, 1, {{"loss", 5.0}});
    // What a launcher leaves when the store is away as the run ends: its last steps and its end.
    dsrun::make_directories(dir.file(l.dead));
    // Written an hour ago: replayed now, the rows keep their own times.
    const double then = dsrun::unix_now() - 3600;
    std::string journal;
    for (int step = 2; step <= 4; ++step)
      journal += nlohmann::json({{"op", "metrics"}, {"run", l.dead}, {"step", step}, {"values", nlohmann::json::array({nlohmann::json::array({"loss", 5.0 - step})})},
                                 {"time", then + step}}).dump() + "\n";
    journal += nlohmann::json({{"op", "status"}, {"run", l.dead}, {"status", "finished"}, {"error", ""}, {"time", then + 10}}).dump() + "\n";
    dsrun::write_file_atomic(dir.file(l.dead + "/store_journal-node0.jsonl"), journal);
    return l.dead;
  }();
  // Before, resume marked nothing, started the ranks on the run and failed ("cannot go from finished to finished").
  const auto resumed = dsrun_with_timeout(db, "resume " + id + " --force", 60);
  INFO(resumed.text);
  CHECK(resumed.code == 0);
  CHECK(contains(resumed.text, "journaled write(s) replayed in order"));
  CHECK(contains(resumed.text, "run " + id + " finished: its journaled writes are now in the store; nothing to resume"));
  dsrun::Store store(db);
  CHECK(store.get_run(id).status == dsrun::RunStatus::Finished);
  const auto losses = store.metric_history(id, "loss");
  REQUIRE(losses.size() == 4);
  CHECK(losses.back().time == Approx(store.get_run(id).ended_at - 6).margin(1e-3));  // step 4 at then + 4, the end at then + 10
  CHECK(store.get_run(id).ended_at < dsrun::unix_now() - 3000);                      // not the replay's time
  CHECK_FALSE(dsrun::file_exists(dir.file(id + "/store_journal-node0.jsonl")));
  // show of a run whose journal waits: replayed (not marked lost first).
  const Launchers more = three_launchers(store);
  dsrun::make_directories(dir.file(more.dead));
  dsrun::write_file_atomic(dir.file(more.dead + "/store_journal-node0.jsonl"),
                           nlohmann::json({{"op", "status"}, {"run", more.dead}, {"status", "failed"}, {"error", "rank 1: out of memory"}}).dump() + "\n");
  const auto shown = dsrun_with_timeout(db, "show " + more.dead, 60);
  CHECK(shown.code == 0);
  CHECK(contains(shown.text, "status      failed: rank 1: out of memory"));
  // history replays every journal left in the runs' directories; store replay one run's.
  const Launchers third = three_launchers(store);
  dsrun::make_directories(dir.file(third.dead));
  dsrun::write_file_atomic(dir.file(third.dead + "/store_journal-node0.jsonl"),
                           nlohmann::json({{"op", "status"}, {"run", third.dead}, {"status", "finished"}, {"error", ""}}).dump() + "\n");
  CHECK(dsrun_with_timeout(db, "history", 60).code == 0);
  CHECK(store.get_run(third.dead).status == dsrun::RunStatus::Finished);  // (not lost)
  const auto again = dsrun_with_timeout(db, "store replay " + third.dead, 60);
  CHECK(again.code == 0);
  CHECK(contains(again.text, "no journal waits beside it; it is finished"));
  const auto live = dsrun_with_timeout(db, "store replay " + third.live, 60);
  CHECK(contains(live.text, "its launcher is alive and replays its own journal"));
}
