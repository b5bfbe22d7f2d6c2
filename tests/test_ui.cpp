// `dsrun ui`: a real server on a real store while a run trains: /metrics in Prometheus' format,
// the runs page and its --where (injections refused as the CLI refuses them), the token rule.
#include "storage/store.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <random>
#include <thread>

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

}  // namespace

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
  REQUIRE(std::system(("cd '" + dsrun::test::source_dir() + "' && ('" + dsrun_binary() + "' run recipes/quickstart.toml --set run.steps=3000 --set eval.every=0 --db '" + db +
                       "' > '" + dir.file("run.log") + "' 2>&1 & echo $! > '" + dir.file("run.pid") + "')").c_str()) == 0);
  for (int i = 0; i < 600 && latest_step(db) < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(latest_step(db) >= 3);
  REQUIRE(std::system(("('" + dsrun_binary() + "' ui --port " + std::to_string(port) + " --db '" + db + "' > '" + dir.file("ui.log") + "' 2>&1 & echo $! > '" +
                       dir.file("ui.pid") + "')").c_str()) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));

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
  REQUIRE(std::system(("('" + dsrun_binary() + "' ui --host 0.0.0.0 --token s3cret --port " + std::to_string(port2) + " --db '" + db + "' > '" + dir.file("ui2.log") +
                       "' 2>&1 & echo $! > '" + dir.file("ui2.pid") + "')").c_str()) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const std::string base2 = "http://127.0.0.1:" + std::to_string(port2);
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' " + base2 + "/metrics").text == "401");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer s3cret' " + base2 + "/metrics").text == "200");
  CHECK(run_command("curl -s -o /dev/null -w '%{http_code}' '" + base2 + "/metrics?token=s3cret'").text == "200");

  for (const char* pid : {"ui.pid", "ui2.pid", "run.pid"}) std::system(("kill $(cat '" + dir.file(pid) + "') 2>/dev/null").c_str());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the run, interrupted, ends killed
}
