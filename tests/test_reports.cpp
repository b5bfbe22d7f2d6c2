// Rank reports on the wire: every kind round-trips through its JSON line, NaN metrics travel as
// null, and lines the launcher cannot read (garbled, unknown type, wrong field kinds) are refused.
#include "engine/protocol/rank_reports.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>

using namespace dsrun;

namespace {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// Encodes as rank 3 and decodes, checking the envelope; the body is the caller's to compare.
template <class Report>
Report round_trip(const Report& sent, const std::string& type) {
  const double before = unix_now();
  const std::string line = encode_report(3, sent);
  INFO(line);
  CHECK(line.find('\n') == std::string::npos);  // the writer's newline alone ends the line
  CHECK(nlohmann::json::parse(line).at("type") == type);
  CHECK(report_type(sent) == type);
  std::optional<ReceivedReport> got = decode_report(line);
  REQUIRE(got);
  CHECK(got->rank == 3);
  CHECK(got->time >= before - 1);
  CHECK(got->time <= unix_now() + 1);
  REQUIRE(std::holds_alternative<Report>(got->body));
  return std::get<Report>(got->body);
}

}  // namespace

TEST_CASE("every rank report kind round-trips through its wire line", "[reports]") {
  SECTION("ready") {
    ReadyReport r = round_trip(ReadyReport{1.25, 41}, "ready");
    CHECK(r.startup_seconds == 1.25);
    CHECK(r.first_step == 41);
  }
  SECTION("beat") { CHECK(round_trip(BeatReport{7}, "beat").step == 7); }
  SECTION("step, metrics in the order sent") {
    StepReport r = round_trip(StepReport{5, 100, {{"loss", 2.5}, {"grad_norm", 0.75}, {"lr", 1e-3}}, true}, "step");
    CHECK(r.step == 5);
    CHECK(r.total == 100);
    CHECK(r.metrics == Metrics{{"loss", 2.5}, {"grad_norm", 0.75}, {"lr", 1e-3}});
    CHECK(r.skipped);
  }
  SECTION("eval") {
    EvalReport r = round_trip(EvalReport{10, {{"val_loss", 3.0}, {"val_perplexity", 20.0855}}}, "eval");
    CHECK(r.step == 10);
    CHECK(r.metrics == Metrics{{"val_loss", 3.0}, {"val_perplexity", 20.0855}});
  }
  SECTION("memory, unmeasured fields stay absent") {
    MemoryReport sent;
    sent.model_state_bytes = 1e6;
    sent.predicted_model_state_bytes = 1.1e6;
    sent.peak_rss_bytes = 2e9;
    sent.anon_rss_bytes = 1.5e9;
    sent.file_rss_bytes = 5e8;
    sent.predicted_total_bytes = 3e9;
    sent.predicted_host_bytes = 4e9;
    CHECK_FALSE(nlohmann::json::parse(encode_report(0, sent)).contains("peak_allocated_bytes"));
    MemoryReport r = round_trip(sent, "memory");
    CHECK(r.model_state_bytes == 1e6);
    CHECK(r.predicted_model_state_bytes == 1.1e6);
    CHECK(r.peak_rss_bytes == 2e9);
    CHECK(r.anon_rss_bytes == 1.5e9);
    CHECK(r.file_rss_bytes == 5e8);
    CHECK(r.predicted_total_bytes == 3e9);
    CHECK(r.predicted_host_bytes == 4e9);
    CHECK_FALSE(r.peak_allocated_bytes);
    CHECK_FALSE(r.peak_reserved_bytes);
    sent.peak_allocated_bytes = 7e9;
    sent.peak_reserved_bytes = 8e9;
    MemoryReport gpu = round_trip(sent, "memory");
    CHECK(gpu.peak_allocated_bytes == 7e9);
    CHECK(gpu.peak_reserved_bytes == 8e9);
    // The launcher's order, which the store has always seen.
    CHECK(memory_values(gpu) == Metrics{{"model_state_bytes", 1e6}, {"predicted_model_state_bytes", 1.1e6}, {"peak_rss_bytes", 2e9},
                                        {"anon_rss_bytes", 1.5e9}, {"file_rss_bytes", 5e8}, {"predicted_total_bytes", 3e9},
                                        {"peak_allocated_bytes", 7e9}, {"peak_reserved_bytes", 8e9}, {"predicted_host_bytes", 4e9}});
  }
  SECTION("event, with characters JSON must escape") {
    EventReport r = round_trip(EventReport{"hook", "step 3: \"quoted\"\nsecond line \xc3\xa9"}, "event");
    CHECK(r.kind == "hook");
    CHECK(r.message == "step 3: \"quoted\"\nsecond line \xc3\xa9");
  }
  SECTION("checkpoint") {
    CheckpointReport r = round_trip(CheckpointReport{20, "/ck/step_00000020", 123456789012, "abc123", {"/ck/step_00000010", "/ck/step_00000005"}, "requested", 1.5},
                                    "checkpoint");
    CHECK(r.step == 20);
    CHECK(r.path == "/ck/step_00000020");
    CHECK(r.bytes == 123456789012);
    CHECK(r.checksum == "abc123");
    CHECK(r.removed == std::vector<std::string>{"/ck/step_00000010", "/ck/step_00000005"});
    CHECK(r.why == "requested");
    CHECK(r.seconds == 1.5);
  }
  SECTION("error") { CHECK(round_trip(ErrorReport{"[rank 1] out of memory"}, "error").message == "[rank 1] out of memory"); }
  SECTION("done") { round_trip(DoneReport{}, "done"); }
}

TEST_CASE("a metric that is not finite reports as null and arrives as NaN", "[reports]") {
  const std::string line = encode_report(0, StepReport{2, 3, {{"loss", std::nan("")}, {"big", INFINITY}, {"fine", 1.0}}, false});
  const nlohmann::json wire = nlohmann::json::parse(line);
  CHECK(wire["metrics"]["loss"].is_null());
  CHECK(wire["metrics"]["big"].is_null());
  std::optional<ReceivedReport> got = decode_report(line);
  REQUIRE(got);
  const Metrics& m = std::get<StepReport>(got->body).metrics;
  REQUIRE(m.size() == 3);
  CHECK(m[0].first == "loss");
  CHECK(std::isnan(m[0].second));
  CHECK(std::isnan(m[1].second));
  CHECK(m[2] == std::pair<std::string, double>{"fine", 1.0});
}

TEST_CASE("report lines the launcher cannot read decode to nothing", "[reports]") {
  CHECK_FALSE(decode_report(""));
  CHECK_FALSE(decode_report("{\"type\":\"step\",\"step\":"));  // cut off mid-line
  CHECK_FALSE(decode_report("not json at all"));
  CHECK_FALSE(decode_report("[1,2,3]"));
  CHECK_FALSE(decode_report("{\"step\":1}"));                      // no type
  CHECK_FALSE(decode_report("{\"type\":7}"));
  CHECK_FALSE(decode_report("{\"type\":\"teleport\",\"rank\":0}"));  // unknown type
  CHECK_FALSE(decode_report("{\"type\":\"beat\",\"step\":\"three\"}"));
  CHECK_FALSE(decode_report("{\"type\":\"checkpoint\",\"removed\":[1]}"));
  CHECK_FALSE(decode_report("{\"type\":\"done\",\"rank\":\"zero\"}"));
}

TEST_CASE("a report line missing fields gets the launcher's defaults", "[reports]") {
  std::optional<ReceivedReport> ready = decode_report("{\"type\":\"ready\"}");
  REQUIRE(ready);
  CHECK(std::get<ReadyReport>(ready->body).first_step == 1);
  std::optional<ReceivedReport> event = decode_report("{\"type\":\"event\",\"message\":\"hi\",\"extra\":true}");  // unknown fields are ignored
  REQUIRE(event);
  CHECK(std::get<EventReport>(event->body).kind == "event");
  CHECK(std::get<EventReport>(event->body).message == "hi");
  std::optional<ReceivedReport> checkpoint = decode_report("{\"type\":\"checkpoint\",\"step\":4}\n");
  REQUIRE(checkpoint);
  CHECK(std::get<CheckpointReport>(checkpoint->body).why == "interval");
}
