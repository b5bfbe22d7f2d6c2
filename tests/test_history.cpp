// Looking at past runs: the --where language (parsing, errors, injection attempts), filters,
// sorting and export formats on a real store; compare; soft delete, restore and gc; watch;
// TensorBoard records against hand-computed bytes; the HTML report rendered in headless Chromium.
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "storage/run_query.hpp"
#include "storage/store.hpp"
#include "storage/tensorboard.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>

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
  n.is_config_key = [](const std::string& k) { return k == "optimizer.lr" || k == "batch.micro" || k == "run.name"; };
  n.known_names = {"optimizer.lr", "batch.micro", "run.name"};
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
    n.config_json = nlohmann::json({{"optimizer.lr", r.lr}, {"batch.micro", 2}, {"run.name", r.name}}).dump();
    const std::string id = store.create_run(n);
    store.set_status(id, dsrun::RunStatus::Running);
    store.add_metrics(id, 10, {{"val_loss", r.val_loss}, {"loss", r.val_loss + 0.1}});
    store.set_status(id, r.status, r.status == dsrun::RunStatus::Failed ? "boom" : "");
  }
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
  const std::string db = dir.file("runs.db");
  fill_store(db);
  dsrun::Store store(db);
  dsrun::RunQuery q;
  q.where = dsrun::parse_where("optimizer.lr > 1e-4 and metrics.val_loss < 2.5 and status = finished", names());
  q.sort = dsrun::sort_expression("metrics.val_loss", names());
  q.ascending = true;
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"e", "a"});
  q = {};
  q.model = "tiny";
  q.sort = dsrun::sort_expression("optimizer.lr", names());
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"d", "a", "b"});
  q = {};
  q.where = dsrun::parse_where("not (status = finished) or run.name = 'c'", names());
  q.ascending = true;
  CHECK(names_of(store.query_runs(q)) == std::vector<std::string>{"c", "d"});
  q = {};
  q.since_seconds = 3600;
  CHECK(store.query_runs(q).size() == 5);

  // A quote inside a string is a doubled quote and stays inside the value: nothing is injected.
  q = {};
  q.where = dsrun::parse_where("name = 'a'' OR 1=1 --'", names());
  CHECK(store.query_runs(q).empty());
  q.where = dsrun::parse_where("name = \"x\"\" ; DROP TABLE runs; --\"", names());
  CHECK(store.query_runs(q).empty());
  CHECK(store.count_runs() == 5);

  auto csv = dsrun_command(dir, "history --where \"metrics.val_loss < 2.2\" --sort metrics.val_loss --asc --csv");
  INFO(csv.text);
  CHECK(csv.code == 0);
  auto lines = dsrun::split(csv.text, '\n');
  REQUIRE(lines.size() >= 4);
  CHECK(dsrun::starts_with(lines[0], "id,name,status,"));
  CHECK(contains(lines[1], ",e,finished,"));
  CHECK(contains(lines[2], ",b,finished,"));
  auto json = nlohmann::json::parse(dsrun_command(dir, "history --status failed --json").text);
  REQUIRE(json.size() == 1);
  CHECK(json[0]["name"] == "d");
  CHECK(json[0]["error"] == "boom");
  auto bad = dsrun_command(dir, "history --where \"status = 'x'; DROP TABLE runs\"");
  CHECK(bad.code == 1);
  CHECK(contains(bad.text, "--where: unexpected character"));
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
