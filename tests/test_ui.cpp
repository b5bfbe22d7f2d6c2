// `dsrun ui`: a real server on a real store while a run trains: /metrics in Prometheus' format,
// the runs page and its --where (injections refused as the CLI refuses them), the token rule; a
// real sweep's parallel coordinates and two of its trials compared, drawn in headless Chromium;
// /metrics scraped by a real Prometheus server.
#include "engine/common/files.hpp"
#include "storage/store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

using dsrun::test::contains;
using dsrun::test::run_command;

namespace {

std::string dsrun_binary() { return DSRUN_BINARY; }

// The latest step whose loss the store has for the newest run, 0 before one.
int64_t latest_step(const std::string& db) {
  if (!dsrun::store_exists(db)) return 0;
  dsrun::Store store(db);
  dsrun::RunListOptions o;
  o.limit = 1;
  const auto runs = store.list_runs(o);
  if (runs.empty()) return 0;
  const auto latest = store.latest_metrics(runs[0].id);
  const auto it = latest.find("loss");
  return it == latest.end() ? 0 : it->second.step;
}


// In the background, until `pid_file` is killed: a quickstart run long enough to be watched
// (true once its store has its third step), and `dsrun ui` on a store (`args` added), its pid in
// NAME.pid and its output in NAME.log.
bool start_quickstart(const dsrun::test::TempDir& dir, const std::string& db) {
  if (std::system(("cd '" + dsrun::test::source_dir() + "' && ('" + dsrun_binary() + "' run recipes/quickstart.toml --set run.steps=3000 --set eval.every=0 --db '" + db +
                   "' > '" + dir.file("run.log") + "' 2>&1 & echo $! > '" + dir.file("run.pid") + "')").c_str()) != 0)
    return false;
  for (int i = 0; i < 600 && latest_step(db) < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return latest_step(db) >= 3;
}
bool start_ui(const dsrun::test::TempDir& dir, const std::string& db, int port, const std::string& name, const std::string& args = "") {
  if (std::system(("('" + dsrun_binary() + "' ui " + args + " --port " + std::to_string(port) + " --db '" + db + "' > '" + dir.file(name + ".log") +
                   "' 2>&1 & echo $! > '" + dir.file(name + ".pid") + "')").c_str()) != 0)
    return false;
  // Until it answers at all (401 with a token is an answer), up to 15 s: a loaded machine (CI's two
  // cores under -j 2) took more than the 800 ms once slept here.
  const std::string probe = "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:" + std::to_string(port) + "/";
  for (int i = 0; i < 60; ++i) {
    if (run_command(probe).text != "000") return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return false;
}
}  // namespace

TEST_CASE("dsrun ui's /metrics writes each sample exactly: a running run's loss and device peak read back as the store holds them", "[ui]") {
  dsrun::test::TempDir dir;
  dsrun::Store store(dir.file("runs.db"));
  dsrun::NewRun run;
  run.name = "exact";
  run.status = dsrun::RunStatus::Running;
  const std::string id = store.create_run(run);
  // Seven significant digits and more: six would round both (4.12346, 1.23457e+10).
  const double loss = 4.123456789012345, peak = 12345678901.0, mfu = 0.58765432;
  store.add_metrics(id, 17, {{"loss", loss}, {"mfu", mfu}, {"memory/rank0/peak_allocated_bytes", peak}});
  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000);
  REQUIRE(start_ui(dir, dir.file("runs.db"), port, "ui"));
  const std::string text = run_command("curl -s http://127.0.0.1:" + std::to_string(port) + "/metrics").text;
  std::system(("kill $(cat '" + dir.file("ui.pid") + "') 2>/dev/null").c_str());
  INFO(text);
  auto sample = [&](const std::string& name) {
    const size_t at = text.find("\n" + name + "{");
    REQUIRE(at != std::string::npos);
    const std::string line = text.substr(at + 1, text.find('\n', at + 1) - at - 1);
    return std::stod(line.substr(line.rfind(' ') + 1));
  };
  CHECK(sample("dsrun_run_loss") == loss);
  CHECK(sample("dsrun_run_mfu") == mfu);
  CHECK(sample("dsrun_run_device_peak_bytes") == peak);
  CHECK(sample("dsrun_run_step") == 17);
  CHECK(contains(text, "dsrun_run_running{run_id=\"" + id + "\",name=\"exact\""));
}

TEST_CASE("dsrun ui refuses a non-loopback host without a token, before anything listens", "[ui]") {
  dsrun::test::TempDir dir;
  const auto out = run_command("'" + dsrun_binary() + "' ui --host 0.0.0.0 --db '" + dir.file("runs.db") + "'");
  CHECK(out.code != 0);
  CHECK(contains(out.text, "--host 0.0.0.0 would serve every run"));
  CHECK(contains(out.text, "--token"));
}

TEST_CASE("dsrun ui serves /metrics for Prometheus while a run trains, the runs page with --where, and a token when asked", "[ui][slow]") {
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db");
  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000);
  const std::string base = "http://127.0.0.1:" + std::to_string(port);
  // A quickstart run long enough to be watched, in the background.
  REQUIRE(start_quickstart(dir, db));
  REQUIRE(start_ui(dir, db, port, "ui"));

  const auto metrics = run_command("curl -s " + base + "/metrics");
  INFO(metrics.text);
  CHECK(contains(metrics.text, "# TYPE dsrun_run_loss gauge"));
  CHECK(contains(metrics.text, "dsrun_run_loss{run_id=\""));
  CHECK(contains(metrics.text, "name=\"quickstart\""));
  CHECK(contains(metrics.text, "dsrun_run_running{"));
  // The step series grows while the run trains.
  auto step_of = [](const std::string& text) {
    const size_t at = text.find("dsrun_run_step{");
    if (at == std::string::npos) return -1.0;
    return std::stod(text.substr(text.find("} ", at) + 2));
  };
  const double first = step_of(metrics.text);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const double later = step_of(run_command("curl -s " + base + "/metrics").text);
  CHECK(first >= 3);
  CHECK(later > first);

  const auto page = run_command("curl -s '" + base + "/?where=status%20%3D%20running'");
  CHECK(contains(page.text, "<td class=\"running\">running</td>"));
  const auto none = run_command("curl -s '" + base + "/api/runs?where=status%20%3D%20finished'");
  CHECK(none.text == "[]");
  // An injection through the page meets the --where parser, which refuses it, and nothing runs.
  const auto injected = run_command("curl -s -o /dev/null -w '%{http_code}' '" + base + "/api/runs?where=name%20%3D%20%27x%27%3B%20drop%20table%20runs'");
  CHECK(injected.text == "400");
  CHECK(contains(run_command("curl -s '" + base + "/api/runs'").text, "\"status\":\"running\""));
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -X POST " + base + "/").text == "405");  // read-only

  // The run's page in a real browser (Debian's Chromium, headless): its own script fetches the
  // loss and draws it, and the points grow while the run trains.
  const std::string listed = run_command("curl -s '" + base + "/api/runs?limit=1'").text;
  const size_t id_at = listed.find("\"id\":\"");
  REQUIRE(id_at != std::string::npos);
  const std::string id = listed.substr(id_at + 6, 8);
  // The run's page puts the plan beside what was measured, a row for every rank, and the tables of
  // nodes (rows from runs over several nodes) and checkpoints.
  const std::string run_page = run_command("curl -s " + base + "/run/" + id).text;
  const std::string beside = run_page.substr(std::min(run_page.size(), run_page.find("<table id=\"plan-beside-measured\">")));
  CHECK(contains(beside, "<td>step seconds</td>"));
  CHECK(contains(beside, "<td>peak memory rank 0 (CPU RSS)</td>"));
  CHECK(contains(beside, "<td>peak memory rank 1 (CPU RSS)</td>"));
  CHECK(contains(run_page, "<table id=\"nodes\">"));
  CHECK(contains(run_page, "<table id=\"checkpoints\">"));
  REQUIRE(run_command("command -v chromium").code == 0);  // ./setup.sh --with-test-tools installs it
  auto chrome = [&](const std::string& profile) {
    return "chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir='" + dir.file(profile) +
           "' --virtual-time-budget=3000 --dump-dom '" + base + "/run/" + id + "' 2>/dev/null";
  };
  auto points_in = [](const std::string& dom) {
    const std::string marker = "id=\"points-loss\">";
    const size_t at = dom.find(marker);
    return at == std::string::npos ? -1 : std::atoi(dom.c_str() + at + marker.size());
  };
  const std::string dom = run_command(chrome("chrome1")).text;
  INFO(dom.substr(0, 2000));
  CHECK(contains(dom, "<svg id=\"chart-loss\" width=\"560\" height=\"180\"><polyline"));
  const int seen = points_in(dom);
  CHECK(seen >= 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  CHECK(points_in(run_command(chrome("chrome2")).text) > seen);

  // Off loopback with a token: every request must carry it.
  const int port2 = port + 1;
  REQUIRE(start_ui(dir, db, port2, "ui2", "--host 0.0.0.0 --token s3cret"));
  const std::string base2 = "http://127.0.0.1:" + std::to_string(port2);
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' " + base2 + "/metrics").text == "401");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer s3cret' " + base2 + "/metrics").text == "200");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' '" + base2 + "/metrics?token=s3cret'").text == "200");
  // The scheme in any case (RFC 7235); a wrong token or a token without its scheme still refused.
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: bearer s3cret' " + base2 + "/metrics").text == "200");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: BEARER  s3cret' " + base2 + "/metrics").text == "200");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: bearer s3cre' " + base2 + "/metrics").text == "401");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: s3cret' " + base2 + "/metrics").text == "401");
  // An error page says what went wrong, not where the store is.
  const std::string bad = run_command("curl -s -H 'Authorization: Bearer s3cret' '" + base2 + "/api/runs/nosuchrun'").text;
  CHECK(contains(bad, "nosuchrun"));
  CHECK_FALSE(contains(bad, db));  // (before: "runs.db: no run ..."; a PostgreSQL store's user, host and database)

  for (const char* pid : {"ui.pid", "ui2.pid", "run.pid"}) std::system(("kill $(cat '" + dir.file(pid) + "') 2>/dev/null").c_str());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the run, interrupted, ends killed
}

TEST_CASE("dsrun ui draws a sweep's trials as parallel coordinates (pruned marked, the best linked) and compares runs: curves overlaid, only differing keys", "[ui][slow]") {
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db");
  // 6 trials over two parameters (the sweep); ASHA prunes the ones whose rate cannot learn.
  const std::string sweep = dir.write("sweep.toml", "base = \"" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml\"\n"
                                      "[run]\nsteps = 30\n[checkpoint]\nat_end = false\n[parallel]\ndata_parallel = 1\n[schedule]\nname = \"constant\"\n"
                                      "[sweep]\nmethod = \"grid\"\n[sweep.objective]\nmetric = \"loss\"\n"
                                      "[sweep.pruning]\nmethod = \"asha\"\ngrace_steps = 2\nreduction_factor = 2\n"
                                      "[sweep.parameters]\n\"optimizer.lr\" = [3e-3, 3e-4, 1e-7]\n\"optimizer.weight_decay\" = [0.0, 0.1]\n");
  const auto swept = run_command("'" + dsrun_binary() + "' sweep '" + sweep + "' --db '" + db + "'");
  INFO(swept.text);
  REQUIRE(swept.code == 0);
  const size_t at = swept.text.find("sweep s");
  REQUIRE(at != std::string::npos);
  const std::string sweep_id = swept.text.substr(at + 6, 8);
  dsrun::Store store(db);
  const auto trials = store.sweep_trials(sweep_id);
  REQUIRE(trials.size() == 6);
  int pruned = 0;
  for (const auto& t : trials) pruned += t.status == dsrun::RunStatus::Pruned;
  REQUIRE(pruned >= 1);

  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000);
  const std::string base = "http://127.0.0.1:" + std::to_string(port);
  REQUIRE(start_ui(dir, db, port, "ui"));
  auto chrome = [&](const std::string& profile, const std::string& path) {
    return run_command("chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir='" + dir.file(profile) +
                       "' --virtual-time-budget=3000 --dump-dom '" + base + path + "' 2>/dev/null").text;
  };
  auto count = [](const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t i = text.find(what); i != std::string::npos; i = text.find(what, i + 1)) ++n;
    return n;
  };
  REQUIRE(run_command("command -v chromium").code == 0);

  // The sweep: one line per trial, the pruned ones marked, exactly one best, linked to its run.
  const std::string coordinates = chrome("chrome1", "/sweep/" + sweep_id);
  INFO(coordinates.substr(0, 3000));
  CHECK(count(coordinates, "<polyline class=\"trial ") == 6);
  CHECK(count(coordinates, "<polyline class=\"trial pruned") == pruned);
  CHECK(count(coordinates, " best\"") == 1);
  const std::string best = store.get_sweep(sweep_id).best_run;
  REQUIRE(!best.empty());
  CHECK(contains(coordinates, "<a href=\"/run/" + best + "\"><polyline class=\"trial finished best\""));
  CHECK(contains(coordinates, ">optimizer.lr (log)</text>"));
  CHECK(contains(coordinates, ">optimizer.weight_decay</text>"));
  CHECK(contains(run_command("curl -s " + base + "/api/sweeps/" + sweep_id).text, "\"parameters\":[\"optimizer.lr\",\"optimizer.weight_decay\"]"));
  // The runs page links the sweep and offers the comparison.
  const std::string runs_page = run_command("curl -s " + base + "/").text;
  CHECK(contains(runs_page, "<a href=\"/sweep/" + sweep_id + "\">"));
  CHECK(contains(runs_page, "<form action=\"/compare\">"));

  // Two trials that differ in the rate alone: both curves drawn, the diff lists that key only.
  std::string a, b;
  for (const auto& t : trials) {
    const auto p = nlohmann::json::parse(t.trial_params);
    if (p["optimizer.weight_decay"].get<double>() != 0.0) continue;
    if (a.empty()) a = t.id;
    else if (b.empty()) b = t.id;
  }
  REQUIRE(!b.empty());
  const std::string compared = chrome("chrome2", "/compare?run=" + a + "&run=" + b);
  INFO(compared.substr(0, 3000));
  CHECK(contains(compared, "<polyline class=\"run-" + a + "\""));
  CHECK(contains(compared, "<polyline class=\"run-" + b + "\""));
  const std::string diff = compared.substr(compared.find("id=\"config-diff\""));
  CHECK(count(diff, "<tr class=\"differs\">") == 1);
  CHECK(contains(diff, "<td>optimizer.lr</td>"));
  CHECK(!contains(diff, "<td>optimizer.weight_decay</td>"));
  // One run is not a comparison: the page says what to give.
  const auto one = run_command("curl -s -w ' %{http_code}' '" + base + "/compare?run=" + a + "'");
  CHECK(contains(one.text, "compare needs at least two runs"));
  CHECK(contains(one.text, " 400"));
  std::system(("kill $(cat '" + dir.file("ui.pid") + "') 2>/dev/null").c_str());
}

TEST_CASE("a real Prometheus server scrapes dsrun ui's /metrics: the target is up, a running run's step and loss are queryable by its labels", "[ui][slow][prometheus]") {
  REQUIRE(run_command("command -v prometheus").code == 0);  // ./setup.sh --with-test-tools installs Debian's
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db");
  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000), prom_port = port + 1;
  REQUIRE(start_quickstart(dir, db));
  REQUIRE(start_ui(dir, db, port, "ui"));
  const std::string config = dir.write("prometheus.yml", "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: dsrun\n"
                                                         "    static_configs:\n      - targets: ['127.0.0.1:" + std::to_string(port) + "']\n");
  REQUIRE(std::system(("(prometheus --config.file='" + config + "' --storage.tsdb.path='" + dir.file("tsdb") + "' --web.listen-address=127.0.0.1:" +
                       std::to_string(prom_port) + " > '" + dir.file("prometheus.log") + "' 2>&1 & echo $! > '" + dir.file("prometheus.pid") + "')").c_str()) == 0);
  const std::string api = "http://127.0.0.1:" + std::to_string(prom_port) + "/api/v1/";
  // Until the server has scraped twice (or 20 s).
  std::string targets, steps;
  for (int i = 0; i < 40; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    targets = run_command("curl -s " + api + "targets").text;
    steps = run_command("curl -s '" + api + "query?query=dsrun_run_step'").text;
    if (contains(targets, "\"health\":\"up\"") && contains(steps, "\"name\":\"quickstart\"")) break;
  }
  INFO(targets);
  INFO(steps);
  INFO(dsrun::read_file(dir.file("prometheus.log")).substr(0, 3000));
  // Prometheus' own parser took the exposition: the target is up, with no parse error.
  CHECK(contains(targets, "\"health\":\"up\""));
  CHECK(contains(targets, "\"lastError\":\"\""));
  // The running run's series, found by its labels, with a step past the first ones.
  CHECK(contains(steps, "\"__name__\":\"dsrun_run_step\""));
  CHECK(contains(steps, "\"name\":\"quickstart\""));
  CHECK(contains(steps, "\"run_id\":\""));
  const size_t value_at = steps.find("\"value\":[");
  REQUIRE(value_at != std::string::npos);
  const size_t quote = steps.find(",\"", value_at);
  CHECK(std::stod(steps.substr(quote + 2)) >= 3);
  // The loss read back through Prometheus' query API, by the run's id: one the store recorded.
  const std::string run_id = dsrun::Store(db).resolve_run("quickstart");
  const std::string loss = run_command("curl -s '" + api + "query?query=dsrun_run_loss%7Brun_id%3D%22" + run_id + "%22%7D'").text;
  INFO(loss);
  const size_t loss_at = loss.find("\"value\":[");
  REQUIRE(loss_at != std::string::npos);
  const double scraped = std::stod(loss.substr(loss.find(",\"", loss_at) + 2));
  bool recorded = false;
  for (const dsrun::MetricValue& m : dsrun::Store(db).metric_history(run_id, "loss")) recorded |= m.value == scraped;  // exact: /metrics writes the shortest text that reads back
  CHECK(recorded);
  CHECK(scraped > 0);
  const std::string running = run_command("curl -s '" + api + "query?query=sum(dsrun_run_running)'").text;
  CHECK(contains(running, "\"value\":["));
  CHECK(contains(running, ",\"1\"]"));
  for (const char* pid : {"prometheus.pid", "ui.pid", "run.pid"}) std::system(("kill $(cat '" + dir.file(pid) + "') 2>/dev/null").c_str());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
}

TEST_CASE("dsrun ui driven in Chromium by puppeteer: a filter typed and submitted, two runs ticked and compared", "[ui][slow][browser]") {
  const std::string modules = dsrun::parent_directory(DSRUN_BINARY) + "/npm/node_modules";
  REQUIRE(run_command("test -d '" + modules + "/puppeteer-core'").code == 0);  // ./setup.sh --with-test-tools installs it
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db");
  for (const char* lr : {"1e-3", "3e-3"})
    REQUIRE(run_command("'" + dsrun_binary() + "' run '" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml' --set run.steps=6 --set optimizer.lr=" + lr +
                        " --set checkpoint.at_end=false --db '" + db + "'").code == 0);
  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000);
  REQUIRE(start_ui(dir, db, port, "ui"));
  const auto driven = run_command("NODE_PATH='" + modules + "' timeout 60 node '" + dsrun::test::source_dir() + "/tests/ui_driver.js' http://127.0.0.1:" + std::to_string(port));
  std::system(("kill $(cat '" + dir.file("ui.pid") + "') 2>/dev/null").c_str());
  INFO(driven.text);
  REQUIRE(driven.code == 0);
  const auto seen = nlohmann::json::parse(driven.text.substr(driven.text.rfind("{\"runs\"")));
  CHECK(seen["runs"] == 2);
  CHECK(seen["filtered"] == 1);  // optimizer.lr > 0.002: the second run alone
  CHECK(dsrun::test::contains(seen["url"].get<std::string>(), "/compare?run="));
  CHECK(seen["curves"] == 2);
  CHECK(seen["differs"] == nlohmann::json::array({"optimizer.lr"}));
}

TEST_CASE("dsrun ui marks a run whose launcher died lost: /metrics stops reporting it running", "[ui]") {
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db");
  std::string dead;
  {
    dsrun::Store store(db);
    dead = dsrun::test::running_run(store, "orphan");
    store.run_heartbeat(dead, dsrun::read_host_facts().hostname, dsrun::test::exited_process());  // its launcher exited, on this host
  }
  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000);
  REQUIRE(start_ui(dir, db, port, "ui"));
  const std::string metrics = run_command("curl -s http://127.0.0.1:" + std::to_string(port) + "/metrics").text;
  std::system(("kill $(cat '" + dir.file("ui.pid") + "') 2>/dev/null").c_str());
  INFO(metrics);
  CHECK(contains(metrics, "# TYPE dsrun_run_running gauge"));
  CHECK_FALSE(contains(metrics, "dsrun_run_running{run_id=\"" + dead));  // before: reported running forever
  CHECK(dsrun::Store(db).get_run(dead).status == dsrun::RunStatus::Lost);
}

namespace {
// A TCP connection to 127.0.0.1:port from the loopback address `source` (any of 127.0.0.0/8 is
// this machine): -1 when it cannot be made.
int connect_from(const std::string& source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}
// One slow client's answer: what the server sent (up to 4 KB, or "" when it closed without a
// word) and when, counted from the connect.
struct SlowAnswer {
  bool arrived = false;
  std::string text;
  double after_s = 0;
};
}  // namespace

TEST_CASE("dsrun ui serves another address while 40 connections from one address trickle their headers: 8 are held and told 408 at the header deadline, 32 are told 503 at once", "[ui]") {
  dsrun::test::TempDir dir;
  const std::string db = dir.file("runs.db");
  {
    dsrun::Store store(db);
    dsrun::test::running_run(store, "watched");
  }
  const int port = 30000 + static_cast<int>(std::random_device{}() % 10000);
  REQUIRE(start_ui(dir, db, port, "ui"));
  std::vector<int> slow;
  const auto connected = std::chrono::steady_clock::now();
  for (int i = 0; i < 40; ++i) {
    const int fd = connect_from("127.0.0.2", port);
    REQUIRE(fd >= 0);
    REQUIRE(::send(fd, "GET /metrics HTTP/1.1\r\n", 23, MSG_NOSIGNAL) == 23);
    slow.push_back(fd);
  }
  // One header byte per connection every 250 ms until the server answers it (before, each byte
  // renewed cpp-httplib's read timeout and the 40 held all 32 workers for as long as they
  // trickled); every connection is watched at once, for up to 12 s.
  std::vector<SlowAnswer> answers(slow.size());
  std::thread trickle([&] {
    for (;;) {
      const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - connected).count();
      size_t open = 0;
      for (size_t i = 0; i < slow.size(); ++i) {
        if (answers[i].arrived) continue;
        pollfd p{slow[i], POLLIN, 0};
        if (::poll(&p, 1, 0) > 0) {
          char text[4096];
          const ssize_t n = ::recv(slow[i], text, sizeof(text), MSG_DONTWAIT);
          answers[i] = SlowAnswer{true, n > 0 ? std::string(text, static_cast<size_t>(n)) : std::string(), now};
          continue;
        }
        ++open;
        ::send(slow[i], "x", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      if (open == 0 || now > 12) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
  });
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const auto asked = std::chrono::steady_clock::now();
  const auto metrics = run_command("curl -s --max-time 4 -o /dev/null -w '%{http_code}' http://127.0.0.1:" + std::to_string(port) + "/metrics");
  const double answered_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
  trickle.join();
  for (int fd : slow) ::close(fd);
  std::system(("kill $(cat '" + dir.file("ui.pid") + "') 2>/dev/null").c_str());
  int busy = 0, timed_out = 0;
  double last_busy_s = 0, first_timed_out_s = 1e9;
  std::string seen;  // each connection's status line and time, for a failure's message
  for (const SlowAnswer& a : answers) {
    seen += (a.arrived ? (a.text.empty() ? std::string("closed") : a.text.substr(0, a.text.find('\r'))) : std::string("nothing")) + " after " +
            std::to_string(a.after_s) + " s\n";
    if (contains(a.text, "HTTP/1.1 503")) {
      ++busy;
      last_busy_s = std::max(last_busy_s, a.after_s);
    }
    if (contains(a.text, "HTTP/1.1 408")) {
      ++timed_out;
      first_timed_out_s = std::min(first_timed_out_s, a.after_s);
    }
  }
  INFO(seen);
  CHECK(metrics.text == "200");
  CHECK(answered_after < 2.0);
  CHECK(timed_out == 8);
  CHECK(busy == 32);
  CHECK(first_timed_out_s >= 4.5);  // held to the deadline, however the bytes trickled
  CHECK(last_busy_s < first_timed_out_s);  // the rest refused at once, not after a wait
}
