#include "engine/protocol/rank_reports.hpp"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>
#include <type_traits>

namespace dsrun {

namespace {

// Ordered, so metrics reach the launcher in the order the rank produced them.
using Json = nlohmann::ordered_json;

template <class Report, class Value>
struct Field {
  const char* name;
  Value Report::*member;
};

template <class Report, class Value>
constexpr Field<Report, Value> field(const char* name, Value Report::*member) {
  return {name, member};
}

// The wire table: each report's "type" and its fields' names, read by encode and decode alike so
// the two cannot drift. A field's name is also its key in logs and docs: renaming one breaks
// launchers of another version.
template <class Report>
struct Wire;

template <>
struct Wire<ReadyReport> {
  static constexpr const char* type = "ready";
  static constexpr auto fields = std::make_tuple(field("startup_seconds", &ReadyReport::startup_seconds), field("first_step", &ReadyReport::first_step));
};

template <>
struct Wire<BeatReport> {
  static constexpr const char* type = "beat";
  static constexpr auto fields = std::make_tuple(field("step", &BeatReport::step));
};

template <>
struct Wire<StepReport> {
  static constexpr const char* type = "step";
  static constexpr auto fields = std::make_tuple(field("step", &StepReport::step), field("total", &StepReport::total), field("metrics", &StepReport::metrics),
                                                 field("skipped", &StepReport::skipped));
};

template <>
struct Wire<EvalReport> {
  static constexpr const char* type = "eval";
  static constexpr auto fields = std::make_tuple(field("step", &EvalReport::step), field("metrics", &EvalReport::metrics));
};

// In the order the launcher records them (memory_values).
template <>
struct Wire<MemoryReport> {
  static constexpr const char* type = "memory";
  static constexpr auto fields = std::make_tuple(
      field("model_state_bytes", &MemoryReport::model_state_bytes), field("predicted_model_state_bytes", &MemoryReport::predicted_model_state_bytes),
      field("peak_rss_bytes", &MemoryReport::peak_rss_bytes), field("anon_rss_bytes", &MemoryReport::anon_rss_bytes),
      field("file_rss_bytes", &MemoryReport::file_rss_bytes), field("predicted_total_bytes", &MemoryReport::predicted_total_bytes),
      field("peak_allocated_bytes", &MemoryReport::peak_allocated_bytes), field("peak_reserved_bytes", &MemoryReport::peak_reserved_bytes),
      field("predicted_host_bytes", &MemoryReport::predicted_host_bytes));
};

template <>
struct Wire<EventReport> {
  static constexpr const char* type = "event";
  static constexpr auto fields = std::make_tuple(field("kind", &EventReport::kind), field("message", &EventReport::message));
};

template <>
struct Wire<CheckpointReport> {
  static constexpr const char* type = "checkpoint";
  static constexpr auto fields = std::make_tuple(field("step", &CheckpointReport::step), field("path", &CheckpointReport::path),
                                                 field("bytes", &CheckpointReport::bytes), field("checksum", &CheckpointReport::checksum),
                                                 field("removed", &CheckpointReport::removed), field("why", &CheckpointReport::why),
                                                 field("seconds", &CheckpointReport::seconds), field("pause_seconds", &CheckpointReport::pause_seconds),
                                                 field("async", &CheckpointReport::async), field("wait_seconds", &CheckpointReport::wait_seconds));
};

template <>
struct Wire<RestoreReport> {
  static constexpr const char* type = "restore";
  static constexpr auto fields = std::make_tuple(field("step", &RestoreReport::step), field("path", &RestoreReport::path), field("bytes", &RestoreReport::bytes),
                                                 field("seconds", &RestoreReport::seconds));
};

template <>
struct Wire<ErrorReport> {
  static constexpr const char* type = "error";
  static constexpr auto fields = std::make_tuple(field("message", &ErrorReport::message));
};

template <>
struct Wire<DoneReport> {
  static constexpr const char* type = "done";
  static constexpr auto fields = std::make_tuple();
};

// ---- values: JSON has no NaN or infinity, so a double that is not finite travels as null ----

Json finite_or_null(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

void put(Json& j, const char* name, double v) { j[name] = finite_or_null(v); }
void put(Json& j, const char* name, int64_t v) { j[name] = v; }
void put(Json& j, const char* name, bool v) { j[name] = v; }
void put(Json& j, const char* name, const std::string& v) { j[name] = v; }
void put(Json& j, const char* name, const std::vector<std::string>& v) { j[name] = v; }
void put(Json& j, const char* name, const std::optional<double>& v) {
  if (v) put(j, name, *v);  // absent: not measured on this rank
}
void put(Json& j, const char* name, const Metrics& metrics) {
  Json object = Json::object();
  for (const auto& [metric, value] : metrics) object[metric] = finite_or_null(value);
  j[name] = std::move(object);
}

// Each returns false for a value of the wrong kind: the line is garbled.
bool read(const Json& v, double& out) {
  if (v.is_null()) out = std::numeric_limits<double>::quiet_NaN();
  else if (v.is_number()) out = v.get<double>();
  else return false;
  return true;
}
bool read(const Json& v, int64_t& out) {
  if (!v.is_number_integer()) return false;
  out = v.get<int64_t>();
  return true;
}
bool read(const Json& v, bool& out) {
  if (!v.is_boolean()) return false;
  out = v.get<bool>();
  return true;
}
bool read(const Json& v, std::string& out) {
  if (!v.is_string()) return false;
  out = v.get<std::string>();
  return true;
}
bool read(const Json& v, std::vector<std::string>& out) {
  if (!v.is_array()) return false;
  out.clear();
  for (const auto& item : v) {
    if (!item.is_string()) return false;
    out.push_back(item.get<std::string>());
  }
  return true;
}
bool read(const Json& v, std::optional<double>& out) {
  double value = 0;
  if (!read(v, value)) return false;
  out = value;
  return true;
}
// A metric that is not a number (null, or a hook's string) becomes NaN, which the launcher names
// instead of storing; the rest of the line is still good.
bool read(const Json& v, Metrics& out) {
  if (!v.is_object()) return false;
  out.clear();
  for (const auto& [metric, value] : v.items())
    out.emplace_back(metric, value.is_number() ? value.get<double>() : std::numeric_limits<double>::quiet_NaN());
  return true;
}

template <class Value>
bool take(const Json& j, const char* name, Value& out) {
  auto it = j.find(name);
  return it == j.end() || read(*it, out);  // missing: keeps the default
}

template <class Report>
Json encode_fields(const Report& report) {
  Json j = Json::object();
  j["type"] = Wire<Report>::type;
  std::apply([&](const auto&... f) { (put(j, f.name, report.*f.member), ...); }, Wire<Report>::fields);
  return j;
}

template <class Report>
std::optional<RankReport> decode_fields(const Json& j) {
  Report report;
  const bool ok = std::apply([&](const auto&... f) { return (true && ... && take(j, f.name, report.*f.member)); }, Wire<Report>::fields);
  if (!ok) return std::nullopt;
  return RankReport(std::move(report));
}

struct WireKind {
  const char* type;
  std::optional<RankReport> (*decode)(const Json&);
};

template <size_t... I>
constexpr std::array<WireKind, sizeof...(I)> wire_kinds(std::index_sequence<I...>) {
  return {{{Wire<std::variant_alternative_t<I, RankReport>>::type, &decode_fields<std::variant_alternative_t<I, RankReport>>}...}};
}

constexpr auto kWireKinds = wire_kinds(std::make_index_sequence<std::variant_size_v<RankReport>>{});

constexpr bool same_text(const char* a, const char* b) {
  while (*a && *a == *b) ++a, ++b;
  return *a == *b;
}

constexpr bool wire_types_unique() {
  for (size_t i = 0; i < kWireKinds.size(); ++i)
    for (size_t j = i + 1; j < kWireKinds.size(); ++j)
      if (same_text(kWireKinds[i].type, kWireKinds[j].type)) return false;
  return true;
}
static_assert(wire_types_unique(), "two reports share a wire type: decode would only ever return the first");

}  // namespace

const char* report_type(const RankReport& report) {
  return std::visit([](const auto& r) { return Wire<std::decay_t<decltype(r)>>::type; }, report);
}

std::string encode_report(int rank, const RankReport& report) {
  Json j = std::visit([](const auto& r) { return encode_fields(r); }, report);
  j["rank"] = rank;
  j["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Invalid UTF-8 (a path, a library's message) is replaced rather than thrown: a rank reports its
  // error from inside a catch block, where a second exception would abort it.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::optional<ReceivedReport> decode_report(const std::string& line) {
  const Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;  // also a parse failure (discarded)
  auto type = j.find("type");
  if (type == j.end() || !type->is_string()) return std::nullopt;
  ReceivedReport received;
  int64_t rank = received.rank;
  if (!take(j, "rank", rank) || !take(j, "time", received.time)) return std::nullopt;
  if (rank < std::numeric_limits<int>::min() || rank > std::numeric_limits<int>::max()) return std::nullopt;
  received.rank = static_cast<int>(rank);
  const std::string& name = type->get_ref<const std::string&>();
  for (const WireKind& kind : kWireKinds) {
    if (name != kind.type) continue;
    std::optional<RankReport> body = kind.decode(j);
    if (!body) return std::nullopt;
    received.body = std::move(*body);
    return received;
  }
  return std::nullopt;  // a type this launcher does not know
}

Metrics memory_values(const MemoryReport& report) {
  Metrics values;
  auto add = [&](const auto& f) {
    if (const auto& value = report.*f.member) values.emplace_back(f.name, *value);
  };
  std::apply([&](const auto&... f) { (add(f), ...); }, Wire<MemoryReport>::fields);
  return values;
}

RankReporter::RankReporter(int rank, int fd) : rank_(rank), fd_(fd) {}

void RankReporter::send(const RankReport& report) {
  std::string line = encode_report(rank_, report) + "\n";
  if (fd_ < 0) {
    std::fputs(line.c_str(), stderr);
    return;
  }
  // One write per line (under PIPE_BUF for ordinary messages), so lines never interleave.
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // the launcher is gone; it stops this rank itself
    done += static_cast<size_t>(n);
  }
}

}  // namespace dsrun
