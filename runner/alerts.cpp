#include "runner/alerts.hpp"

#include "engine/common/clock.hpp"
#include "engine/common/error.hpp"
#include "engine/common/file_descriptor.hpp"
#include "engine/common/files.hpp"
#include "engine/recipe/load.hpp"
#include "runner/history.hpp"
#include "storage/run_query.hpp"

#ifdef DSRUN_WITH_CURL
#include <curl/curl.h>
#endif
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <iostream>

extern char** environ;

namespace dsrun {

namespace {

std::string describe(const AlertRule& r) {
  return r.url.empty() ? r.command.front() : r.command.empty() ? r.url : r.url + " and " + r.command.front();
}

// The event an alert leaves on its run.
std::string alert_event(const AlertRule& r, const std::string& message) { return "alert \"" + r.name + "\": " + message + " (to " + describe(r) + ")"; }

// What a run's alert delivers: `text` (what Slack and similar receivers show) and its fields.
nlohmann::json run_alert_body(const AlertRule& r, const std::string& run_id, const std::string& run_name, int64_t step, const std::string& message) {
  nlohmann::json alert = {{"run_id", run_id}, {"run_name", run_name}, {"rule", r.name}, {"on", to_string(r.on)}, {"step", step}, {"message", message},
                          {"time", static_cast<int64_t>(std::time(nullptr))}};
  return {{"text", "dsrun: run " + run_id + (run_name.empty() ? "" : " (" + run_name + ")") + ": " + message}, {"alert", alert}};
}

#ifdef DSRUN_WITH_CURL
// RAII owners of curl's handles.
struct CurlEasy {
  CURL* handle = curl_easy_init();
  ~CurlEasy() {
    if (handle) curl_easy_cleanup(handle);
  }
};
struct CurlHeaders {
  curl_slist* list = nullptr;
  ~CurlHeaders() {
    if (list) curl_slist_free_all(list);
  }
};
size_t discard(char*, size_t size, size_t count, void*) { return size * count; }
#endif

// POSTs `body` as JSON; true on a 2xx answer. 10 s at most, and it stops when `abandon` is set.
bool post_json(const std::string& url, const std::string& body, const std::atomic<bool>& abandon, std::string& why) {
#ifdef DSRUN_WITH_CURL
  CurlEasy curl;
  CurlHeaders headers;
  if (!curl.handle) return why = "curl_easy_init failed", false;
  headers.list = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(curl.handle, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl.handle, CURLOPT_HTTPHEADER, headers.list);
  curl_easy_setopt(curl.handle, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(curl.handle, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(curl.handle, CURLOPT_TIMEOUT, 10L);
  curl_easy_setopt(curl.handle, CURLOPT_NOSIGNAL, 1L);  // a thread of its own: no SIGALRM for timeouts
  curl_easy_setopt(curl.handle, CURLOPT_WRITEFUNCTION, discard);
  // Called about once a second while waiting: a non-zero answer aborts the transfer.
  using Progress = int (*)(void*, curl_off_t, curl_off_t, curl_off_t, curl_off_t);
  const Progress stop_if_abandoned = [](void* flag, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
    return static_cast<const std::atomic<bool>*>(flag)->load() ? 1 : 0;
  };
  curl_easy_setopt(curl.handle, CURLOPT_XFERINFOFUNCTION, stop_if_abandoned);
  curl_easy_setopt(curl.handle, CURLOPT_XFERINFODATA, const_cast<std::atomic<bool>*>(&abandon));
  curl_easy_setopt(curl.handle, CURLOPT_NOPROGRESS, 0L);
  const CURLcode rc = curl_easy_perform(curl.handle);
  if (rc == CURLE_ABORTED_BY_CALLBACK) return why = "POST " + url + ": no answer by the launcher's exit", false;
  if (rc != CURLE_OK) return why = std::string("POST ") + url + ": " + curl_easy_strerror(rc), false;
  long status = 0;
  curl_easy_getinfo(curl.handle, CURLINFO_RESPONSE_CODE, &status);
  if (status < 200 || status >= 300) return why = "POST " + url + ": HTTP " + std::to_string(status), false;
  return true;
#else
  (void)body;
  (void)abandon;
  why = "this dsrun was built without libcurl: webhook " + url + " cannot be sent";
  return false;
#endif
}

// Runs argv[0] (found on PATH, no shell) with `input` on its stdin, its output discarded; true when
// it exits 0 within 30 s. It is killed after that, or when `abandon` is set.
bool run_with_input(const std::vector<std::string>& argv, const std::string& input, const std::atomic<bool>& abandon, std::string& why) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return why = std::string("pipe: ") + std::strerror(errno), false;
  FileDescriptor read_end(fds[0]), write_end(fds[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, read_end.get(), 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return why = "run " + argv[0] + ": " + std::strerror(rc), false;
  read_end.close();
  // A program that does not read its stdin gets EPIPE (not an error of ours); one that never reads
  // it would block this write: non-blocking, given up with the program.
  ::fcntl(write_end.get(), F_SETFL, ::fcntl(write_end.get(), F_GETFL) | O_NONBLOCK);
  size_t written = 0;
  int status = 0;
  for (const double until = steady_seconds() + 30;;) {
    if (write_end.get() >= 0 && written < input.size()) {
      const ssize_t n = ::write(write_end.get(), input.data() + written, input.size() - written);
      if (n > 0) written += static_cast<size_t>(n);
      else if (n < 0 && errno != EAGAIN && errno != EINTR) written = input.size();
    }
    if (write_end.get() >= 0 && written >= input.size()) write_end.close();
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) break;
    if (got < 0) return why = "run " + argv[0] + ": waitpid: " + std::strerror(errno), false;
    if (steady_seconds() > until || abandon.load()) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return why = "run " + argv[0] + (abandon.load() ? ": still running at the launcher's exit, killed" : ": still running after 30 s, killed"), false;
    }
    ::usleep(20000);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return why = "run " + argv[0] + ": " + (WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status)) : "killed by signal " + std::to_string(WTERMSIG(status))), false;
  return true;
}

// A `when` is --where's language over the run, its bare names being metrics.
QueryNames alert_query_names() {
  QueryNames n = query_names();
  n.bare_names_are_metrics = true;
  return n;
}

}  // namespace

// ---------------------------------------------------------------- AlertDelivery

AlertDelivery::AlertDelivery() {
#ifdef DSRUN_WITH_CURL
  static const bool curl_ready = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;  // once, before any thread uses curl
  (void)curl_ready;
#endif
}

AlertDelivery::~AlertDelivery() { finish(0); }

void AlertDelivery::send(const AlertRule& rule, const nlohmann::json& alert) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) return;
  const std::string body = alert.dump();
  for (const bool webhook : {true, false}) {
    if (webhook ? rule.url.empty() : rule.command.empty()) continue;
    ++undelivered_;
    threads_.emplace_back([this, target = Target{rule, body, webhook}] { deliver(target); });
  }
}

bool AlertDelivery::given_up() const { return stopping_ && steady_seconds() >= deadline_; }

void AlertDelivery::deliver(const Target& t) {
  // A program that exits without reading its stdin (`false`) must cost this write an EPIPE, not
  // the launcher a SIGPIPE: blocked on this thread alone (a write's SIGPIPE goes to its thread).
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  const std::string to = t.webhook ? t.rule.url : t.rule.command.front();
  const std::string alert = "alert \"" + t.rule.name + "\"";
  for (int attempt = 1;; ++attempt) {
    std::string why;
    const bool delivered = t.webhook ? post_json(t.rule.url, t.body, abandon_, why) : run_with_input(t.rule.command, t.body, abandon_, why);
    std::unique_lock<std::mutex> lock(mutex_);
    if (delivered) {
      if (attempt > 1) notes_.push_back(alert + " delivered to " + to + " at attempt " + std::to_string(attempt));
      break;
    }
    if (attempt == 1 && !given_up()) notes_.push_back(alert + " not delivered yet to " + to + " (retrying 1, 2, 4 s ... apart in the background): " + why);
    // The next try 1, 2, 4 ... 60 s after this one, unless the deadline comes first.
    const double next = steady_seconds() + std::min(60.0, std::pow(2.0, attempt - 1));
    while (!given_up() && steady_seconds() < next) {
      const double until = stopping_ ? std::min(next, deadline_) : next;
      wake_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, until - steady_seconds())));
    }
    if (given_up()) {
      notes_.push_back(alert + " NOT delivered to " + to + " by the launcher's exit, after " + std::to_string(attempt) + " attempt(s): " + why);
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  --undelivered_;
  wake_.notify_all();
}

void AlertDelivery::finish(double seconds) {
  std::vector<std::thread> threads;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!stopping_) {
      stopping_ = true;
      deadline_ = steady_seconds() + seconds;
    }
    wake_.notify_all();
    while (undelivered_ > 0 && !given_up()) wake_.wait_for(lock, std::chrono::duration<double>(std::max(0.01, deadline_ - steady_seconds())));
    abandon_ = true;  // an attempt under way past the deadline stops (curl's progress check, the command's kill)
    wake_.notify_all();
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

std::vector<std::string> AlertDelivery::take_notes() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  out.swap(notes_);
  return out;
}

// ---------------------------------------------------------------- RunAlerts

RunAlerts::RunAlerts(std::vector<AlertRule> rules, std::string run_id, std::string run_name, Store& store)
    : rules_(std::move(rules)), fired_(rules_.size(), false), run_id_(std::move(run_id)), run_name_(std::move(run_name)), store_(store),
      names_(alert_query_names()), last_step_at_(steady_seconds()) {}

void RunAlerts::fire(size_t i, int64_t step, const std::string& message) {
  if (fired_[i]) return;
  fired_[i] = true;
  const AlertRule& r = rules_[i];
  store_.add_event(run_id_, "alert", -1, alert_event(r, message));
  delivery_.send(r, run_alert_body(r, run_id_, run_name_, step, message));
}

void RunAlerts::on_metrics(int64_t step, const std::vector<std::pair<std::string, double>>& metrics) {
  bool has_loss = false;
  for (const auto& [name, value] : metrics) {
    if (name != "loss" && name != "val_loss") continue;
    has_loss = has_loss || name == "loss";
    if (!std::isfinite(value))
      for (size_t i = 0; i < rules_.size(); ++i)
        if (rules_[i].on == AlertOn::NanLoss) fire(i, step, name + " is " + (std::isnan(value) ? "NaN" : "infinite") + " at step " + std::to_string(step));
  }
  if (has_loss) {
    last_step_at_ = steady_seconds();
    last_step_ = step;
  }
  metrics_unchecked_ = true;
  check_conditions(false);
}

// Metric conditions through the store, as `dsrun history --where` asks it (the values are the
// run's latest metrics, just written): at most once a second, and once more when the run ends.
void RunAlerts::check_conditions(bool now_or_never) {
  const double now = steady_seconds();
  if (!metrics_unchecked_ || (!now_or_never && now - last_metric_check_ < 1.0)) return;
  last_metric_check_ = now;
  metrics_unchecked_ = false;
  for (size_t i = 0; i < rules_.size(); ++i) {
    if (fired_[i] || rules_[i].on != AlertOn::Metric) continue;
    RunQuery q;
    q.limit = 1;
    q.where = "(" + rules_[i].when + ") and id = '" + run_id_ + "'";  // (run ids are hexadecimal: nothing to escape)
    q.names = names_;
    try {
      if (!store_.query_runs(q).empty()) fire(i, last_step_, rules_[i].when + " at step " + std::to_string(last_step_));
    } catch (const Error& e) {  // the store away (its writes wait in the journal): the condition is asked again later
      metrics_unchecked_ = true;
      std::cerr << "dsrun: alert \"" << rules_[i].name << "\" not checked now: " << e.describe() << "\n";
      return;
    }
  }
}

void RunAlerts::record_notes() {
  for (const std::string& note : delivery_.take_notes()) store_.add_event(run_id_, "alert_delivery", -1, note);
}

void RunAlerts::tick(double now) {
  for (size_t i = 0; i < rules_.size(); ++i)
    if (rules_[i].on == AlertOn::Stalled && now - last_step_at_ > 60 * rules_[i].minutes)
      fire(i, last_step_, "no step completed for " + std::to_string(static_cast<int64_t>(now - last_step_at_)) + " s (the last: step " + std::to_string(last_step_) + ")");
  record_notes();
}

void RunAlerts::on_end(RunStatus status, const std::string& why, double drain_seconds) {
  check_conditions(true);
  if (status == RunStatus::Failed || status == RunStatus::Killed)
    for (size_t i = 0; i < rules_.size(); ++i)
      if (rules_[i].on == AlertOn::Failed) fire(i, last_step_, std::string(to_string(status)) + ": " + why);
  delivery_.finish(drain_seconds);
  record_notes();
}

void alert_sweep_finished(const std::vector<AlertRule>& rules, const SweepRecord& sweep, const std::string& message, const std::string& event_run,
                          Store& store, double drain_seconds) {
  AlertDelivery delivery;
  bool any = false;
  for (const AlertRule& r : rules) {
    if (r.on != AlertOn::SweepFinished) continue;
    any = true;
    if (!event_run.empty()) store.add_event(event_run, "alert", -1, alert_event(r, "sweep " + sweep.id + ": " + message));
    nlohmann::json alert = {{"sweep_id", sweep.id}, {"sweep_name", sweep.name}, {"rule", r.name}, {"on", to_string(r.on)}, {"message", message},
                            {"best_run", sweep.best_run}, {"time", static_cast<int64_t>(std::time(nullptr))}};
    delivery.send(r, {{"text", "dsrun: sweep " + sweep.id + (sweep.name.empty() ? "" : " (" + sweep.name + ")") + ": " + message}, {"alert", alert}});
  }
  if (!any) return;
  delivery.finish(drain_seconds);
  for (const std::string& note : delivery.take_notes()) {
    std::cerr << "sweep " << sweep.id << ": " << note << "\n";
    if (!event_run.empty()) store.add_event(event_run, "alert_delivery", -1, note);
  }
}

std::vector<AlertRule> alert_rules_in_recipe(const std::string& recipe_path, AlertOn on, const std::string& whose) {
  std::vector<AlertRule> rules;
  if (recipe_path.empty()) return rules;
  if (!file_exists(recipe_path)) {
    std::cerr << whose << ": its recipe " << recipe_path << " is not here, so its " << to_string(on) << " alerts were not evaluated\n";
    return rules;
  }
  for (AlertRule& r : alert_rules_for_run(load_recipe_file(recipe_path, LoadOptions{}).alerts))
    if (r.on == on) rules.push_back(std::move(r));
  return rules;
}

void alert_lost_run(Store& store, const RunRecord& run, const std::string& why) {
  std::vector<AlertRule> rules;
  try {
    rules = alert_rules_in_recipe(run.recipe_path, AlertOn::Failed, "run " + run.id + " is lost");
  } catch (const Error& e) {  // (the command that noticed goes on; the user learns why no alert went)
    std::cerr << "run " << run.id << " is lost; its alert rules could not be read, so none were sent: " << e.describe() << "\n";
    return;
  }
  if (rules.empty()) return;
  // The events first, here: the process that delivers opens no store (SQLite's connections must
  // not cross a fork), so how each delivery went is not recorded for a lost run.
  const auto latest = store.latest_metrics(run.id);
  const int64_t last_step = latest.count("loss") ? latest.at("loss").step : 0;
  const std::string message = "lost: " + why;
  std::vector<nlohmann::json> bodies;
  for (const AlertRule& r : rules) {
    store.add_event(run.id, "alert", -1, alert_event(r, message));
    bodies.push_back(run_alert_body(r, run.id, run.name, last_step, message));
  }
  // Two forks: the grandchild delivers (retrying up to a minute) on its own, and the child is
  // reaped at once. The commands that call this are single-threaded, so fork is safe here.
  const pid_t child = ::fork();
  if (child < 0) fail_at(__FILE__, __LINE__, std::string("fork failed: ") + std::strerror(errno));
  if (child > 0) {
    int status = 0;
    ::waitpid(child, &status, 0);
    return;
  }
  if (::fork() != 0) ::_exit(0);
  ::setsid();
  const int null = ::open("/dev/null", O_RDWR);  // (a pipe the caller reads must not wait for us)
  if (null >= 0) {
    ::dup2(null, STDIN_FILENO);
    ::dup2(null, STDOUT_FILENO);
    ::dup2(null, STDERR_FILENO);
  }
  {
    AlertDelivery delivery;
    for (size_t i = 0; i < rules.size(); ++i) delivery.send(rules[i], bodies[i]);
    delivery.finish(60);
  }
  ::_exit(0);
}

std::vector<AlertRule> alert_rules_for_run(const std::vector<AlertRule>& recipe_rules) {
  std::vector<AlertRule> rules = recipe_rules;
  std::vector<Diagnostic> problems;
  for (AlertRule& r : load_user_alert_rules(problems)) rules.push_back(std::move(r));
  std::string report;
  for (const Diagnostic& d : problems)
    if (d.severity == Diagnostic::Severity::Error) report += d.format();
  if (!report.empty()) throw Error("the user's alert rules have errors:\n" + report, ErrorContext{"", 0, 0, "alerts", -1, "fix the rules (docs/alerts.md)"});
  const QueryNames names = alert_query_names();
  for (const AlertRule& r : rules) {
#ifndef DSRUN_WITH_CURL
    if (!r.url.empty())
      throw Error("the alert rule at " + r.written_at + " posts to " + r.url + ", and this dsrun was built without libcurl",
                  ErrorContext{r.written_at, 0, 0, "alerts.url", -1, "use run = [...] (a program), or build dsrun with libcurl4-openssl-dev (setup.sh installs it)"});
#endif
    if (r.on != AlertOn::Metric) continue;
    try {
      parse_where(r.when, names);
    } catch (const Error& e) {
      throw Error("the alert rule at " + r.written_at + ": when: " + e.describe(), ErrorContext{r.written_at, 0, 0, "alerts.when", -1, "write when as `dsrun history --where` takes it, e.g. \"val_loss > 3.0\""});
    }
  }
  return rules;
}

}  // namespace dsrun
