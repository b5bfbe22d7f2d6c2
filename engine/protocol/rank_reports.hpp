// What a rank tells the launcher, as one struct per message kind, and their wire form: one JSON
// object per line on an inherited pipe (DSRUN_REPORT_FD), or the rank's log without a launcher.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace dsrun {

// In the order the rank produced them: the launcher stores and shows them in that order. A value
// that is not finite travels as null and comes back as NaN, so the launcher can name it.
using Metrics = std::vector<std::pair<std::string, double>>;

// Defaults are what the launcher assumes when a field is missing from a line.
struct ReadyReport {
  double startup_seconds = 0;
  int64_t first_step = 1;  // a resumed run starts later; the launcher's ETA counts from here
};

struct BeatReport {
  int64_t step = 0;  // started, not finished: the launcher names a rank that falls behind
};

struct StepReport {
  int64_t step = 0;
  int64_t total = 0;
  Metrics metrics;
  bool skipped = false;
};

struct EvalReport {
  int64_t step = 0;
  Metrics metrics;
};

// Measured beside predicted; a field is absent where this rank cannot measure it (no GPU).
struct MemoryReport {
  std::optional<double> model_state_bytes;
  std::optional<double> predicted_model_state_bytes;
  std::optional<double> peak_rss_bytes;
  std::optional<double> anon_rss_bytes;
  std::optional<double> file_rss_bytes;
  std::optional<double> predicted_total_bytes;
  std::optional<double> predicted_host_bytes;
  std::optional<double> peak_allocated_bytes;
  std::optional<double> peak_reserved_bytes;
};

struct EventReport {
  std::string kind = "event";
  std::string message;
};

struct CheckpointReport {
  int64_t step = 0;
  std::string path;
  int64_t bytes = 0;
  std::string checksum;
  std::vector<std::string> removed;  // older checkpoints retention deleted: the store forgets them
  std::string why = "interval";
  double seconds = 0;        // from the save's start until the checkpoint was complete
  double pause_seconds = 0;  // of those, training stood still (all of them when synchronous)
  bool async = false;        // checkpoint.async: written from a thread while training went on
  double wait_seconds = 0;   // of the pause, waiting for the previous save's write
};

// A resume read its checkpoint: every rank's bytes, rank 0's seconds (the last rank done).
struct RestoreReport {
  int64_t step = 0;
  std::string path;
  int64_t bytes = 0;
  double seconds = 0;
};

struct ErrorReport {
  std::string message;
};

struct DoneReport {};

using RankReport = std::variant<ReadyReport, BeatReport, StepReport, EvalReport, MemoryReport, EventReport, CheckpointReport, RestoreReport,
                                ErrorReport, DoneReport>;

struct ReceivedReport {
  int rank = -1;
  double time = 0;  // seconds since the Unix epoch, on the rank's clock
  RankReport body;
};

// The wire's "type" of a report ("ready", "step", ...).
const char* report_type(const RankReport& report);

// One JSON object with "type", the struct's fields, "rank" and "time" (now); no newline in it, so
// the writer's newline ends it.
std::string encode_report(int rank, const RankReport& report);

// nullopt for a line that is not a JSON object, has an unknown "type", or a field of the wrong kind.
// Missing fields keep the struct's defaults.
std::optional<ReceivedReport> decode_report(const std::string& line);

// The memory measurements present, by their wire names, in the order the launcher records them.
Metrics memory_values(const MemoryReport& report);

class RankReporter {
 public:
  RankReporter(int rank, int fd);  // fd < 0: write to stderr
  void send(const RankReport& report);

 private:
  int rank_;
  int fd_;
};

}  // namespace dsrun
