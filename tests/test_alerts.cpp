// Alerts ([[alerts]]): rules checked where they are written, and a real run's alerts fired once each
// to a real HTTP receiver (down at first) and to a program, recorded as events; a sweep's
// sweep_finished; a run whose launcher was killed, alerted by the command that finds it lost.
#include "storage/store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <thread>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

using namespace dsrun;
using dsrun::test::contains;
using dsrun::test::load_text;
using dsrun::test::only_error;

namespace {

int count_lines_with(const std::string& path, const std::string& needle) {
  std::ifstream in(path);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += contains(line, needle) ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("alert rules are checked where they are written: file, line, key and a fix", "[alerts][recipe]") {
  const LoadedRecipe good = load_text("[[alerts]]\non = \"nan\"\nurl = \"https://hooks.example/x\"\n\n[[alerts]]\non = \"metric\"\nwhen = \"val_loss > 3.0\"\n"
                                      "run = [\"notify-send\", \"dsrun\"]\n\n[[alerts]]\non = \"stalled\"\nminutes = 10\nrun = [\"true\"]\n");
  INFO(good.report());
  REQUIRE(good.ok());
  REQUIRE(good.alerts.size() == 3);
  CHECK(good.alerts[0].on == AlertOn::NanLoss);
  CHECK(good.alerts[0].url == "https://hooks.example/x");
  CHECK(good.alerts[1].when == "val_loss > 3.0");
  CHECK(good.alerts[1].name == "val_loss > 3.0");
  CHECK(good.alerts[1].command == std::vector<std::string>{"notify-send", "dsrun"});
  CHECK(good.alerts[2].minutes == 10);
  CHECK(contains(good.alerts[2].written_at, "test.toml:"));

  const Diagnostic& typo = only_error(load_text("[[alerts]]\non = \"nan\"\nurl = \"http://x\"\nmniutes = 3\n"));
  CHECK(typo.key == "alerts.mniutes");
  CHECK(typo.source.line == 4);
  CHECK(contains(typo.fix, "did you mean minutes?"));
  const Diagnostic& on = only_error(load_text("[[alerts]]\non = \"stalle\"\nrun = [\"true\"]\n"));
  CHECK(on.key == "alerts.on");
  CHECK(contains(on.fix, "did you mean stalled?"));
  CHECK(only_error(load_text("[[alerts]]\non = \"metric\"\nrun = [\"true\"]\n")).key == "alerts.when");
  CHECK(only_error(load_text("[[alerts]]\non = \"stalled\"\nrun = [\"true\"]\n")).key == "alerts.minutes");
  CHECK(contains(only_error(load_text("[[alerts]]\non = \"failed\"\n")).message, "somewhere to go"));
  CHECK(only_error(load_text("[[alerts]]\non = \"failed\"\nurl = \"ftp://x\"\n")).key == "alerts.url");
  const Diagnostic& shell = only_error(load_text("[[alerts]]\non = \"failed\"\nrun = \"notify-send dsrun\"\n"));
  CHECK(shell.key == "alerts.run");
  CHECK(contains(shell.message, "without a shell"));
  CHECK(only_error(load_text("[alerts]\non = \"failed\"\n")).key == "alerts");
}

TEST_CASE("a run's alerts fire once each, to a webhook that is down at first and to a program, and are recorded, and training goes on", "[alerts][slow]") {
  dsrun::test::TempDir dir;
  const int port = 20000 + static_cast<int>(std::random_device{}() % 10000);
  const std::string hook = "http://127.0.0.1:" + std::to_string(port) + "/hook";
  std::ofstream(dir.file("alerts.toml")) << "base = [\"" << dsrun::test::source_dir() << "/tests/recipes/tiny_train.toml\"]\n"
                                         << "[[alerts]]\non = \"nan\"\nurl = \"" << hook << "\"\nrun = [\"tee\", \"-a\", \"" << dir.file("command.jsonl") << "\"]\n\n"
                                         << "[[alerts]]\non = \"stalled\"\nminutes = 0.05\nurl = \"" << hook << "\"\n\n"
                                         << "[[alerts]]\nname = \"never\"\non = \"metric\"\nwhen = \"loss > 1000\"\nurl = \"" << hook << "\"\n";
  // The receiver listens 8 s from now: the NaN alert (step 5, a few seconds in) finds it down.
  const std::string receiver = "python3 '" + dsrun::test::source_dir() + "/tests/alert_receiver.py' " + std::to_string(port) + " '" + dir.file("received.jsonl") + "' 8";
  const std::string pid_file = dir.file("receiver.pid");
  REQUIRE(std::system(("(" + receiver + " & echo $! > '" + pid_file + "')").c_str()) == 0);
  // Rank 0 reports a NaN loss at step 5 (training itself goes on); rank 1 stops at step 10: no step
  // completes after it (the stalled alert after 3 s), and run.step_timeout_s fails the run.
  dsrun::test::Run run = dsrun::test::train(dir, "--set run.steps=60 --set run.step_timeout_s=7 --set parallel.data_parallel=2 --set checkpoint.every=0",
                                            "HOME='" + dir.file("home") + "' DSRUN_TEST_NAN_LOSS_AT=0:5 DSRUN_TEST_STOP_AT=1:10", dir.file("alerts.toml"));
  std::system(("kill $(cat '" + pid_file + "') 2>/dev/null").c_str());
  INFO(run.text);
  CHECK(run.code != 0);
  CHECK(contains(run.text, "rank 1"));  // the stopped rank is named: the run failed for it, not for its alerts
  REQUIRE_FALSE(run.id.empty());
  // Training went on past the NaN while the receiver was down: steps 1-9 but 5, whose NaN is an
  // event, not a value (rank 1 stops at the start of step 10).
  CHECK(run.losses.size() >= 8);

  CHECK(count_lines_with(dir.file("received.jsonl"), "\"on\":\"nan\"") == 1);
  CHECK(count_lines_with(dir.file("received.jsonl"), "\"on\":\"stalled\"") == 1);
  CHECK(count_lines_with(dir.file("received.jsonl"), "never") == 0);
  CHECK(count_lines_with(dir.file("received.jsonl"), "\"text\":\"dsrun: run " + run.id) == 2);  // Slack's field
  CHECK(count_lines_with(dir.file("command.jsonl"), "\"on\":\"nan\"") == 1);
  CHECK(count_lines_with(dir.file("command.jsonl"), "loss is NaN at step 5") == 1);

  Store store(dir.file("runs.db"));
  int alerts = 0, retried = 0, delivered_later = 0, nan_named = 0;
  for (const EventRecord& e : store.events(run.id)) {
    nan_named += e.kind == "metric" && e.message == "loss is not a finite number at step 5" ? 1 : 0;
    alerts += e.kind == "alert" ? 1 : 0;
    retried += e.kind == "alert_delivery" && contains(e.message, "not delivered yet") ? 1 : 0;
    delivered_later += e.kind == "alert_delivery" && contains(e.message, "delivered to") && contains(e.message, "at attempt") ? 1 : 0;
  }
  CHECK(nan_named == 1);
  CHECK(alerts == 2);
  CHECK(retried >= 1);          // the receiver was down: said so, and retried
  CHECK(delivered_later >= 1);  // and got them once it answered
}

TEST_CASE("a sweep's sweep_finished alert fires once when every trial has ended, with the best run, and its trials do not fire it", "[alerts][sweep][slow]") {
  dsrun::test::TempDir dir;
  const std::string sweep = dir.write("sweep.toml", "base = \"" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml\"\n"
                                      "[run]\nsteps = 4\n[checkpoint]\nat_end = false\n[parallel]\ndata_parallel = 1\n"
                                      "[[alerts]]\non = \"sweep_finished\"\nrun = [\"tee\", \"-a\", \"" + dir.file("sweep.jsonl") + "\"]\n"
                                      "[sweep]\nmethod = \"grid\"\n[sweep.objective]\nmetric = \"loss\"\n[sweep.parameters]\n\"optimizer.lr\" = [1e-3, 3e-3]\n");
  const auto out = dsrun::test::run_command("HOME='" + dir.file("home") + "' '" + std::string(DSRUN_BINARY) + "' sweep '" + sweep + "' --db '" + dir.file("runs.db") + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  const size_t at = out.text.find("sweep s");
  REQUIRE(at != std::string::npos);
  const std::string sweep_id = out.text.substr(at + 6, 8);
  Store store(dir.file("runs.db"));
  const std::string best = store.get_sweep(sweep_id).best_run;
  REQUIRE(!best.empty());
  CHECK(count_lines_with(dir.file("sweep.jsonl"), "\"on\":\"sweep_finished\"") == 1);
  CHECK(count_lines_with(dir.file("sweep.jsonl"), "\"sweep_id\":\"" + sweep_id + "\"") == 1);
  CHECK(count_lines_with(dir.file("sweep.jsonl"), "finished: 2 trial(s) (2 finished); best run " + best) == 1);
  int alerts = 0;
  for (const auto& trial : store.sweep_trials(sweep_id))
    for (const EventRecord& e : store.events(trial.id)) alerts += e.kind == "alert" && contains(e.message, "sweep " + sweep_id) && trial.id == best ? 1 : e.kind == "alert" ? 100 : 0;
  CHECK(alerts == 1);  // on the best run only; no trial's own launcher fired it
}

TEST_CASE("a run found lost by another command (its launcher killed) sends its failed alerts from a detached process, and the command does not wait", "[alerts][slow]") {
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db"), sent = dir.file("lost.jsonl");
  // The program answers after 3 s: `history` must not wait for it.
  std::ofstream(dir.file("lost.toml")) << "base = [\"" << dsrun::test::source_dir() << "/tests/recipes/tiny_train.toml\"]\n"
                                       << "[[alerts]]\non = \"failed\"\nrun = [\"sh\", \"-c\", \"sleep 3; cat >> '" << sent << "'\"]\n";
  const std::string env = "HOME='" + dir.file("home") + "' ";
  REQUIRE(std::system(("(" + env + "'" + std::string(DSRUN_BINARY) + "' run '" + dir.file("lost.toml") + "' --set run.steps=100000 --set checkpoint.every=0 --db '" + db +
                       "' > '" + dir.file("run.log") + "' 2>&1 & echo $! > '" + dir.file("run.pid") + "')").c_str()) == 0);
  std::string id;
  for (int i = 0; i < 600 && id.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!store_exists(db)) continue;
    Store store(db);
    RunListOptions o;
    o.limit = 1;
    const auto runs = store.list_runs(o);
    if (!runs.empty() && store.latest_metrics(runs[0].id).count("loss")) id = runs[0].id;
  }
  REQUIRE(!id.empty());
  REQUIRE(std::system(("kill -9 $(cat '" + dir.file("run.pid") + "')").c_str()) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto t0 = std::chrono::steady_clock::now();
  const auto history = dsrun::test::run_command(env + "'" + std::string(DSRUN_BINARY) + "' history --db '" + db + "'");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(history.text);
  CHECK(history.code == 0);
  CHECK(contains(history.text, "lost"));
  CHECK(seconds < 2.5);  // it did not wait for the program's 3 s
  for (int i = 0; i < 100 && count_lines_with(sent, "\"on\":\"failed\"") == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(count_lines_with(sent, "\"on\":\"failed\"") == 1);
  CHECK(count_lines_with(sent, "lost: its launcher, process") == 1);
  CHECK(count_lines_with(sent, "\"run_id\":\"" + id + "\"") == 1);
  Store store(db);
  CHECK(store.get_run(id).status == RunStatus::Lost);
  int alerts = 0;
  for (const EventRecord& e : store.events(id)) alerts += e.kind == "alert" && contains(e.message, "lost") ? 1 : 0;
  CHECK(alerts == 1);
  // Asked again, the run is already lost: no second alert.
  dsrun::test::run_command(env + "'" + std::string(DSRUN_BINARY) + "' history --db '" + db + "'");
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  CHECK(count_lines_with(sent, "\"on\":\"failed\"") == 1);
}

TEST_CASE("each alert receiver delivers on its own: a hanging command delays no other, failures retry 1, 2, 4 s apart, and what is not delivered by the end is recorded so", "[alerts][slow]") {
  dsrun::test::TempDir dir;
  const int port = 20000 + static_cast<int>(std::random_device{}() % 10000);  // nothing listens there
  std::ofstream(dir.file("alerts.toml")) << "base = [\"" << dsrun::test::source_dir() << "/tests/recipes/tiny_train.toml\"]\n"
                                         << "[[alerts]]\nname = \"hangs\"\non = \"failed\"\nrun = [\"sleep\", \"1000\"]\n\n"
                                         << "[[alerts]]\nname = \"healthy\"\non = \"failed\"\nrun = [\"tee\", \"-a\", \"" << dir.file("command.jsonl") << "\"]\n\n"
                                         << "[[alerts]]\nname = \"fails\"\non = \"failed\"\nrun = [\"false\"]\n\n"
                                         << "[[alerts]]\nname = \"refused\"\non = \"failed\"\nurl = \"http://127.0.0.1:" << port << "/hook\"\n";
  const auto started = std::chrono::steady_clock::now();
  dsrun::test::Run run = dsrun::test::train(dir, "--set run.steps=20 --set checkpoint.every=0", "HOME='" + dir.file("home") + "' DSRUN_TEST_CRASH_AT=0:3",
                                            dir.file("alerts.toml"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO("exit code " << run.code << " after " << seconds << " s");
  INFO(run.text);
  REQUIRE_FALSE(run.id.empty());
  CHECK(run.code != 0);
  // The healthy command got the alert, though the hanging one came first (serially it waited 30 s a try).
  CHECK(count_lines_with(dir.file("command.jsonl"), "\"on\":\"failed\"") == 1);
  CHECK(seconds < 90);  // the 30 s drain, not a hanging receiver's tries one after another
  Store store(dir.file("runs.db"));
  std::map<std::string, std::string> given_up;
  int healthy_retried = 0;
  for (const EventRecord& e : store.events(run.id)) {
    if (e.kind != "alert_delivery") continue;
    healthy_retried += contains(e.message, "\"healthy\"") ? 1 : 0;
    for (const char* name : {"hangs", "fails", "refused"})
      if (contains(e.message, std::string("alert \"") + name + "\" NOT delivered")) given_up[name] = e.message;
  }
  CHECK(healthy_retried == 0);
  REQUIRE(given_up.size() == 3);  // each recorded as not delivered, not left "retrying in the background"
  CHECK(contains(given_up["hangs"], "still running at the launcher's exit, killed"));
  // 1, 2, 4, 8 s apart within the 30 s drain: at least 4 tries each (one try in 60 s before).
  for (const char* name : {"fails", "refused"}) {
    INFO(given_up[name]);
    const size_t after = given_up[name].find("after ");
    REQUIRE(after != std::string::npos);
    CHECK(std::stoi(given_up[name].substr(after + 6)) >= 4);
  }
}
