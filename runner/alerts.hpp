// A run's alerts (its recipe's [[alerts]] and the user's file, engine/recipe/alert_rules.hpp): each
// rule fires at most once per run, is recorded as an event, and is delivered in the background.
#pragma once

#include "engine/recipe/alert_rules.hpp"
#include "storage/run_query.hpp"
#include "storage/store.hpp"

#include <nlohmann/json.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dsrun {

// Delivers alerts in the background, so that a receiver that is down or slow never stops or slows
// training: a webhook gets a POST of the alert's JSON ({"text": ..., which Slack and similar
// receivers show, and "alert": the fields}); a command runs without a shell with the JSON on its
// stdin. Each receiver of each alert has a thread of its own, so that one that hangs (a webhook
// that never answers: 10 s a try; a command: 30 s) delays no other; each is retried 1 s, 2 s,
// 4 s ... (at most a minute) apart until it succeeds or the drain deadline passes, and what was
// not delivered by then is noted as such.
class AlertDelivery {
 public:
  AlertDelivery();
  ~AlertDelivery();  // waits for what is still undelivered up to the drain deadline (finish())
  AlertDelivery(const AlertDelivery&) = delete;
  AlertDelivery& operator=(const AlertDelivery&) = delete;

  void send(const AlertRule& rule, const nlohmann::json& alert);
  // Stop taking more; wait up to `seconds` for what is queued to get through.
  void finish(double seconds);
  // What happened to deliveries since the last call (a failure that will be retried, a delivery
  // after retries, one given up at the deadline), for the run's events.
  std::vector<std::string> take_notes();

 private:
  // One receiver of one alert: the rule's webhook, or its command.
  struct Target {
    AlertRule rule;
    std::string body;
    bool webhook = false;
  };
  void deliver(const Target& target);  // a thread's body: tries until delivered or given up
  bool given_up() const;               // the drain deadline has passed (under mutex_)

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  int undelivered_ = 0;  // targets still trying
  std::vector<std::string> notes_;
  bool stopping_ = false;
  double deadline_ = 0;               // set by finish(): give up on what is left after it
  std::atomic<bool> abandon_{false};  // past the deadline: an attempt under way stops too
};

// One run's rules, evaluated by the launcher as reports arrive (its own thread: the store is not
// shared with the delivery thread).
class RunAlerts {
 public:
  RunAlerts(std::vector<AlertRule> rules, std::string run_id, std::string run_name, Store& store);
  // A step's or an evaluation's metrics, finite or not: NaN and metric rules.
  void on_metrics(int64_t step, const std::vector<std::pair<std::string, double>>& metrics);
  // Every watch-loop turn (now: steady_seconds()): stalled rules, and delivery notes recorded as events.
  void tick(double now);
  // The run ended (failed or killed fire `failed`), then deliveries get up to `drain_seconds`.
  void on_end(RunStatus status, const std::string& why, double drain_seconds);

 private:
  void fire(size_t rule, int64_t step, const std::string& message);
  void check_conditions(bool now_or_never);
  void record_notes();

  std::vector<AlertRule> rules_;
  std::vector<bool> fired_;
  std::string run_id_, run_name_;
  Store& store_;
  QueryNames names_;  // what `when` conditions' names mean (alert_query_names)
  AlertDelivery delivery_;
  double last_step_at_ = 0;
  int64_t last_step_ = 0;
  double last_metric_check_ = 0;
  bool metrics_unchecked_ = false;
};

// A sweep finished (every trial ended, no interruption): its `sweep_finished` rules fire, each once
// (a sweep finishes once), recorded as an `alert` event on `event_run` (its best run, else its last
// trial) and delivered, the driver waiting up to `drain_seconds` for them.
void alert_sweep_finished(const std::vector<AlertRule>& rules, const SweepRecord& sweep, const std::string& message, const std::string& event_run,
                          Store& store, double drain_seconds);

// A run that another command found lost (its launcher dead, or its Slurm job gone): its `failed`
// rules (the recipe's, read again from its file, and the user's) are recorded as the run's events
// and delivered from a detached process, so that the command which noticed never waits for a
// receiver (how each delivery went is not recorded). A recipe file that is gone is said on stderr.
void alert_lost_run(Store& store, const RunRecord& run, const std::string& why);

// The rules of kind `on` that a recipe file (its [[alerts]]) and the user's file hold, read again
// after the fact (a sweep that finished, a run found lost); none, said on stderr naming `whose`,
// where the file is gone. A problem in the rules throws dsrun::Error.
std::vector<AlertRule> alert_rules_in_recipe(const std::string& recipe_path, AlertOn on, const std::string& whose);

// The rules a run is watched by: its recipe's, then the user's (load_user_alert_rules). Each
// metric rule's `when` is checked as `dsrun history --where` would parse it (bare names are
// metrics); a problem throws dsrun::Error naming the file, line and key.
std::vector<AlertRule> alert_rules_for_run(const std::vector<AlertRule>& recipe_rules);

}  // namespace dsrun
