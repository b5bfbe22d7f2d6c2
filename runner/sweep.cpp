#include "runner/sweep.hpp"

#include "engine/common/clock.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/load.hpp"
#include "engine/sweep/sweep.hpp"
#include "runner/alerts.hpp"
#include "runner/launcher.hpp"
#include "runner/slurm.hpp"
#include "runner/terminal.hpp"
#include "storage/store.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <sstream>

namespace dsrun {

namespace {

volatile sig_atomic_t sweep_interrupted = 0;
void on_sweep_interrupt(int) { sweep_interrupted = 1; }

// What a trial is: `dsrun run` of the sweep's recipe with the trial's values, its log in `log`,
// told which sweep, trial and values it is (and, for a Slurm task's claimed trial, which run).
// `in_child` narrows what the trial sees (cores, GPUs) before it starts.
struct TrialLaunch {
  std::string recipe, db;
  std::vector<std::string> base_sets;
  std::string sweep_id;
  int64_t index = 0;
  TrialParams params;
  std::string claimed_run;  // "" : the trial's dsrun run records its own
  std::string log;
};

pid_t start_trial(const TrialLaunch& t, const std::function<void()>& in_child) {
  std::vector<std::string> args = {executable_path(), "run", t.recipe, "--db", t.db, "--set", "logging.progress=false"};
  for (const auto& s : t.base_sets) args.insert(args.end(), {"--set", s});
  for (const auto& s : trial_overrides(t.params)) args.insert(args.end(), {"--set", s});
  nlohmann::json params_json = nlohmann::json::object();
  for (const auto& [k, v] : t.params) params_json[k] = v;
  const std::string params_text = params_json.dump();
  pid_t pid = ::fork();
  if (pid < 0) fail_at(__FILE__, __LINE__, "fork failed");
  if (pid > 0) return pid;
  ::setpgid(0, 0);                       // Ctrl-C reaches the sweep, which stops its trials
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);    // a sweep killed outright takes its trials with it
  int fd = ::open(t.log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
  }
  in_child();
  ::setenv("DSRUN_SWEEP_ID", t.sweep_id.c_str(), 1);
  ::setenv("DSRUN_TRIAL_INDEX", std::to_string(t.index).c_str(), 1);
  ::setenv("DSRUN_TRIAL_PARAMS", params_text.c_str(), 1);
  if (!t.claimed_run.empty()) ::setenv("DSRUN_TRIAL_RUN", t.claimed_run.c_str(), 1);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  _exit(127);
}

// A finished trial's objective: its metric's curve summarised as the sweep says.
std::optional<double> objective_of(const Store& store, const SweepSpec& spec, const std::string& run_id) {
  Curve curve;
  for (const auto& m : store.metric_history(run_id, spec.metric)) curve.push_back({m.step, m.value});
  return summarize_curve(curve, spec.summary, spec.maximize);
}

TrialParams params_of(const RunRecord& r) {
  TrialParams p;
  nlohmann::json j = nlohmann::json::parse(r.trial_params.empty() ? "{}" : r.trial_params, nullptr, false);
  if (j.is_object())
    for (auto& [k, v] : j.items()) p[k] = v;
  return p;
}

// The leaderboard: trials with an objective first, best first; then the rest.
struct Row {
  RunRecord run;
  std::optional<double> objective;
};

std::vector<Row> leaderboard(const Store& store, const SweepSpec& spec, const std::string& sweep_id) {
  std::vector<Row> rows;
  for (auto& r : store.sweep_trials(sweep_id)) rows.push_back({r, r.status == RunStatus::Infeasible ? std::nullopt : objective_of(store, spec, r.id)});
  std::stable_sort(rows.begin(), rows.end(), [&](const Row& a, const Row& b) {
    const bool fa = a.run.status == RunStatus::Finished && a.objective, fb = b.run.status == RunStatus::Finished && b.objective;
    if (fa != fb) return fa;
    if (fa) return spec.maximize ? *a.objective > *b.objective : *a.objective < *b.objective;
    return a.run.trial_index < b.run.trial_index;
  });
  return rows;
}

std::string duration_text(const RunRecord& r) {
  if (r.started_at <= 0) return "";
  return format_seconds((r.ended_at > 0 ? r.ended_at : unix_now()) - r.started_at);
}

// The leaderboard as `dsrun sweep --show --json` prints it and `dsrun ui` draws it.
nlohmann::json leaderboard_json(const SweepSpec& spec, const SweepRecord& sweep, const std::vector<Row>& rows) {
  nlohmann::json out = {{"sweep", sweep.id}, {"name", sweep.name}, {"status", sweep.status}, {"metric", spec.metric},
                        {"goal", spec.maximize ? "maximize" : "minimize"}, {"best_run", sweep.best_run}, {"parameters", nlohmann::json::array()},
                        {"trials", nlohmann::json::array()}};
  for (const auto& p : spec.parameters)
    for (const auto& k : p.keys) out["parameters"].push_back(k);
  for (const auto& r : rows)
    out["trials"].push_back({{"trial", r.run.trial_index + 1}, {"run", r.run.id}, {"status", to_string(r.run.status)},
                             {"objective", r.objective ? nlohmann::json(*r.objective) : nlohmann::json()},
                             {"params", nlohmann::json::parse(r.run.trial_params.empty() ? "{}" : r.run.trial_params)},
                             {"seconds", r.run.started_at > 0 ? (r.run.ended_at > 0 ? r.run.ended_at : unix_now()) - r.run.started_at : 0.0},
                             {"error", r.run.error}});
  return out;
}

// Once a sweep has finished (not stopped): its recipe's and the user's `sweep_finished` alerts,
// with how its trials ended and the best one. The rules are read from the recipe file again (a
// task of a Slurm sweep has only the store).
void alert_if_finished(Store& store, const std::string& sweep_id) {
  const SweepRecord sweep = store.get_sweep(sweep_id);
  if (sweep.status != "finished") return;
  const std::vector<AlertRule> rules = alert_rules_in_recipe(sweep.recipe_path, AlertOn::SweepFinished, "sweep " + sweep.id);
  if (rules.empty()) return;
  const SweepSpec spec = sweep_spec_from_json(nlohmann::json::parse(sweep.spec_json));
  const std::vector<Row> rows = leaderboard(store, spec, sweep.id);
  std::map<std::string, int> ended;
  for (const Row& r : rows) ++ended[to_string(r.run.status)];
  std::string how;
  for (const auto& [status, n] : ended) how += (how.empty() ? "" : ", ") + std::to_string(n) + " " + status;
  std::string message = "finished: " + std::to_string(rows.size()) + " trial(s) (" + how + ")";
  if (!sweep.best_run.empty() && !rows.empty() && rows[0].objective)
    message += "; best run " + sweep.best_run + ", " + spec.metric + " " + format_double(*rows[0].objective, 6);
  const std::string event_run = !sweep.best_run.empty() ? sweep.best_run : rows.empty() ? "" : rows.back().run.id;
  alert_sweep_finished(rules, sweep, message, event_run, store, 30);
}

void print_leaderboard(const Store& store, const SweepSpec& spec, const SweepRecord& sweep, bool json, bool csv) {
  std::vector<Row> rows = leaderboard(store, spec, sweep.id);
  if (json) {
    std::cout << leaderboard_json(spec, sweep, rows).dump(2) << "\n";
    return;
  }
  if (csv) {
    std::vector<std::string> keys;
    for (const auto& p : spec.parameters)
      for (const auto& k : p.keys) keys.push_back(k);
    std::cout << "rank,trial,run,status," << spec.metric;
    for (const auto& k : keys) std::cout << "," << csv_field(k);
    std::cout << ",seconds,error\n";
    int rank = 1;
    for (const auto& r : rows) {
      TrialParams p = params_of(r.run);
      std::cout << rank++ << "," << r.run.trial_index + 1 << "," << r.run.id << "," << to_string(r.run.status) << ","
                << (r.objective ? format_double(*r.objective, 17) : "");
      for (const auto& k : keys) std::cout << "," << csv_field(p.count(k) ? (p[k].is_string() ? p[k].get<std::string>() : p[k].dump()) : "");
      const double secs = r.run.started_at > 0 ? (r.run.ended_at > 0 ? r.run.ended_at : unix_now()) - r.run.started_at : 0.0;
      std::cout << "," << format_double(secs, 6) << "," << csv_field(r.run.error) << "\n";
    }
    return;
  }
  std::cout << "sweep " << sweep.id << " (" << sweep.name << "): " << sweep.status << ", " << rows.size() << " trial(s), "
            << (spec.maximize ? "maximize " : "minimize ") << spec.metric << "\n";
  TextTable t({"#", "trial", "run", "status", spec.metric, "parameters", "duration"});
  int rank = 1;
  for (const auto& r : rows)
    t.add({std::to_string(rank++), std::to_string(r.run.trial_index + 1), r.run.id, to_string(r.run.status), r.objective ? format_double(*r.objective, 5) : "-",
           describe_params(params_of(r.run)), duration_text(r.run)});
  std::cout << t.render("  ");
  if (!sweep.best_run.empty()) std::cout << "best run: " << sweep.best_run << " (dsrun show " << sweep.best_run << ")\n";
}

// The cores (and GPUs) of one concurrency slot: the machine divided evenly between running trials.
struct Slot {
  std::vector<int> cpus;
  std::vector<int> gpus;
};

std::vector<Slot> divide_devices(int concurrency) {
  std::vector<Slot> slots(static_cast<size_t>(concurrency));
  cpu_set_t mask;
  CPU_ZERO(&mask);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof mask, &mask) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &mask)) cpus.push_back(c);
  if (cpus.empty()) cpus.push_back(0);
  const HostFacts host = read_host_facts();
  for (int s = 0; s < concurrency; ++s) {
    // More slots than cores: slots share cores round-robin (CPU ranks can oversubscribe).
    const size_t per = std::max<size_t>(1, cpus.size() / static_cast<size_t>(concurrency));
    for (size_t i = 0; i < per; ++i) slots[static_cast<size_t>(s)].cpus.push_back(cpus[(static_cast<size_t>(s) * per + i) % cpus.size()]);
    const int per_gpu = host.cuda_devices / concurrency;
    for (int g = 0; g < per_gpu; ++g) slots[static_cast<size_t>(s)].gpus.push_back(s * per_gpu + g);
  }
  return slots;
}

std::string list_text(const std::vector<int>& v) {
  std::vector<std::string> parts;
  for (int x : v) parts.push_back(std::to_string(x));
  return join(parts, ",");
}

// What one trial sees of the machine when `concurrency` trials run side by side.
HostFacts trial_share(HostFacts host, int concurrency) {
  const Slot slot = divide_devices(concurrency).front();
  host.cpu_cores = static_cast<int>(slot.cpus.size());
  host.cuda_devices = static_cast<int>(slot.gpus.size());
  return host;
}

// The largest number of concurrent trials (below `tried`) whose share runs the recipe; 0 if none.
int fitting_concurrency(const std::string& recipe, LoadOptions options, int tried) {
  const HostFacts whole = options.host;
  for (int c = tried - 1; c >= 1; --c) {
    options.host = trial_share(whole, c);
    if (load_recipe_file(recipe, options).ok()) return c;
  }
  return 0;
}

Error share_error(const std::string& recipe, int concurrency, const HostFacts& whole, const HostFacts& share, int fits) {
  ErrorContext c;
  c.file = recipe;
  c.key = "sweep.concurrency";
  c.hint = (fits > 0 ? "run " + std::to_string(fits) + " trial(s) at a time (sweep.concurrency = " + std::to_string(fits) + "), or " : std::string()) +
           "let each trial use what its share has: parallel.data_parallel = \"auto\" (or fewer ranks)";
  const bool gpus = whole.cuda_devices > 0;
  return Error(std::to_string(concurrency) + " concurrent trials get " + std::to_string(gpus ? share.cuda_devices : share.cpu_cores) + " " +
                  (gpus ? "GPU(s)" : "core(s)") + " each (of " + std::to_string(gpus ? whole.cuda_devices : whole.cpu_cores) +
                  "), and the recipe cannot run on that share (the errors above)",
              c);
}

// Grid and random trials are known before any result: each is loaded on its share now, so a
// trial that could not start is reported before the first one runs.
void check_every_trial(const std::string& recipe, const SweepSpec& spec, const LoadOptions& options) {
  std::vector<std::string> problems;
  for (int64_t i = 0; i < trial_budget(spec) && problems.size() < 10; ++i) {
    const TrialParams params = next_trial(spec, i, {});
    LoadOptions o = options;
    for (const auto& s : trial_overrides(params)) o.overrides.push_back(s);
    LoadedRecipe r = load_recipe_file(recipe, o);
    for (const auto& d : r.diagnostics)
      if (d.severity == Diagnostic::Severity::Error) problems.push_back("trial " + std::to_string(i + 1) + " (" + describe_params(params) + "): " + d.key + ": " + d.message);
  }
  if (problems.empty()) return;
  ErrorContext c;
  c.file = recipe;
  c.key = "sweep.parameters";
  c.hint = "change the swept values, or sweep.concurrency (each trial gets 1/concurrency of the machine)";
  throw Error("trials that could not start on their share of this machine:\n  " + join(problems, "\n  "), c);
}

// Every trial's curve of the sweep's metric, by run (infeasible trials never ran).
std::map<std::string, Curve> sweep_curves(const Store& store, const SweepSpec& spec, const std::string& sweep_id) {
  std::map<std::string, Curve> curves;
  for (const auto& r : store.sweep_trials(sweep_id)) {
    if (r.status == RunStatus::Infeasible) continue;
    Curve c;
    for (const auto& m : store.metric_history(r.id, spec.metric)) c.push_back({m.step, m.value});
    curves[r.id] = c;
  }
  return curves;
}

// Whether the sweep's pruning stops `run_id` now, judged against every other trial's curve.
std::optional<std::string> trial_prune_reason(const SweepSpec& spec, const std::map<std::string, Curve>& curves, const std::string& run_id) {
  std::vector<Curve> others;
  for (const auto& [id, c] : curves)
    if (id != run_id) others.push_back(c);
  return prune_reason(spec.pruning, spec.maximize, curves.at(run_id), others);
}

class SweepDriver {
 public:
  SweepDriver(const SweepSpec& spec, Store& store, const SweepRecord& sweep, const std::string& db_path, std::vector<std::string> base_sets)
      : spec_(spec), store_(store), sweep_(sweep), db_path_(db_path), base_sets_(std::move(base_sets)) {}

  int run() {
    struct sigaction sa {};
    sa.sa_handler = on_sweep_interrupt;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    slots_ = divide_devices(spec_.concurrency);
    busy_.assign(slots_.size(), false);
    log_dir_ = path_join(runs_directory(db_path_), "sweeps/" + sweep_.id);
    make_directories(log_dir_);
    const int64_t budget = trial_budget(spec_);
    const double deadline = spec_.max_minutes > 0 ? steady_seconds() + spec_.max_minutes * 60 : 0;

    // What earlier attempts of this sweep finished stays; failed and killed trials run again.
    std::vector<bool> done(static_cast<size_t>(budget), false);
    for (const auto& r : store_.sweep_trials(sweep_.id)) {
      if (r.trial_index < 0 || r.trial_index >= budget) continue;
      if (r.status == RunStatus::Finished || r.status == RunStatus::Pruned || r.status == RunStatus::Infeasible) done[static_cast<size_t>(r.trial_index)] = true;
      if (r.status == RunStatus::Finished)
        if (auto o = objective_of(store_, spec_, r.id)) finished_.push_back({params_of(r), *o});
      note_best(r);
    }
    for (int64_t i = 0; i < budget; ++i)
      if (!done[static_cast<size_t>(i)]) pending_.push_back(i);
    std::cout << "sweep " << sweep_.id << ": " << pending_.size() << " of " << budget << " trial(s) to run, " << spec_.concurrency
              << " at a time; trial logs in " << log_dir_ << "\n";

    std::string stop_reason;
    while (true) {
      store_.sweep_heartbeat(sweep_.id);
      reap();
      if (sweep_interrupted && stop_reason.empty()) {
        stop_reason = "interrupted";
        for (auto& t : running_) ::kill(t.pid, SIGTERM);
      }
      if (stop_reason.empty() && target_reached_) {
        stop_reason = "target reached";
        prune_all("the sweep's target " + format_double(*spec_.target, 6) + " was reached by run " + best_run_);
      }
      if (stop_reason.empty() && deadline > 0 && steady_seconds() > deadline) {
        stop_reason = "time budget";
        prune_all("the sweep's time budget of " + format_double(spec_.max_minutes, 4) + " min ran out");
      }
      if (stop_reason.empty()) prune_poor_trials();
      while (stop_reason.empty() && !pending_.empty() && static_cast<int>(running_.size()) < spec_.concurrency) {
        launch(pending_.front());
        pending_.erase(pending_.begin());
      }
      if (running_.empty() && (pending_.empty() || !stop_reason.empty())) break;
      ::usleep(200000);
    }
    const std::string status = stop_reason == "interrupted" ? "stopped" : "finished";
    store_.update_sweep(sweep_.id, status, best_run_, stop_reason == "interrupted" ? "interrupted (Ctrl-C or SIGTERM)" : "", ::getpid());
    std::cout << "\n";
    print_leaderboard(store_, spec_, store_.get_sweep(sweep_.id), false, false);
    if (!stop_reason.empty() && stop_reason != "interrupted") std::cout << "ended early: " << stop_reason << "\n";
    return stop_reason == "interrupted" ? 130 : 0;
  }

 private:
  struct Trial {
    int64_t index = 0;
    TrialParams params;
    pid_t pid = -1;
    size_t slot = 0;
    std::string run_id;
    double started = 0;
    bool prune_sent = false;
  };

  void launch(int64_t index) {
    Trial t;
    t.index = index;
    t.params = next_trial(spec_, index, finished_);
    t.started = unix_now();
    t.slot = static_cast<size_t>(std::find(busy_.begin(), busy_.end(), false) - busy_.begin());
    busy_[t.slot] = true;
    const Slot& slot = slots_[t.slot];
    t.pid = start_trial({spec_.path, db_path_, base_sets_, sweep_.id, index, t.params, "", path_join(log_dir_, "trial" + std::to_string(index) + ".log")}, [&] {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      for (int c : slot.cpus) CPU_SET(c, &mask);
      sched_setaffinity(0, sizeof mask, &mask);  // the trial's ranks see only its cores
      if (!slot.gpus.empty()) ::setenv("CUDA_VISIBLE_DEVICES", list_text(slot.gpus).c_str(), 1);
    });
    std::cout << "trial " << index + 1 << "/" << trial_budget(spec_) << " started: " << describe_params(t.params) << " (cores " << list_text(slot.cpus)
              << (slot.gpus.empty() ? "" : ", GPUs " + list_text(slot.gpus)) << ")\n" << std::flush;
    running_.push_back(t);
  }

  // The run a trial's child recorded (it appears once the child has planned).
  void discover_run(Trial& t) {
    if (!t.run_id.empty()) return;
    for (const auto& r : store_.sweep_trials(sweep_.id))
      if (r.trial_index == t.index && r.created_at >= t.started - 1 && !known_runs_.count(r.id)) {
        t.run_id = r.id;
        known_runs_.insert(r.id);
        return;
      }
  }

  void reap() {
    for (auto it = running_.begin(); it != running_.end();) {
      discover_run(*it);
      int status = 0;
      if (::waitpid(it->pid, &status, WNOHANG) != it->pid) {
        ++it;
        continue;
      }
      discover_run(*it);
      busy_[it->slot] = false;
      report_end(*it, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
      it = running_.erase(it);
    }
  }

  void report_end(const Trial& t, int code) {
    const std::string head = "trial " + std::to_string(t.index + 1) + "/" + std::to_string(trial_budget(spec_)) + " ";
    if (t.run_id.empty()) {
      std::cout << head << "failed before recording a run (exit " << code << "); see " << path_join(log_dir_, "trial" + std::to_string(t.index) + ".log") << "\n";
      return;
    }
    RunRecord r = store_.get_run(t.run_id);
    std::string line = head + to_string(r.status) + ": run " + r.id;
    if (r.status == RunStatus::Finished) {
      if (auto o = objective_of(store_, spec_, r.id)) {
        finished_.push_back({t.params, *o});
        line += ", " + spec_.metric + " " + format_double(*o, 5);
      }
    } else if (!r.error.empty()) {
      line += ": " + r.error;
    }
    note_best(r);
    line += "  (" + describe_params(t.params) + ")";
    if (!best_run_.empty()) line += "  best: " + best_run_ + " " + format_double(best_value_, 5);
    std::cout << line << "\n" << std::flush;
  }

  void note_best(const RunRecord& r) {
    if (r.status != RunStatus::Finished) return;
    auto o = objective_of(store_, spec_, r.id);
    if (!o) return;
    if (best_run_.empty() || (spec_.maximize ? *o > best_value_ : *o < best_value_)) {
      best_run_ = r.id;
      best_value_ = *o;
    }
    if (spec_.target && (spec_.maximize ? *o >= *spec_.target : *o <= *spec_.target)) target_reached_ = true;
  }

  void prune(Trial& t, const std::string& reason) {
    if (t.prune_sent || t.run_id.empty()) return;
    store_.add_event(t.run_id, "pruned", -1, reason);
    ::kill(t.pid, SIGUSR2);  // the trial's launcher stops its ranks and records the run as pruned
    t.prune_sent = true;
    std::cout << "trial " << t.index + 1 << " pruning run " << t.run_id << ": " << reason << "\n" << std::flush;
  }

  void prune_all(const std::string& reason) {
    for (auto& t : running_) prune(t, reason);
  }

  void prune_poor_trials() {
    if (spec_.pruning.method == PruneMethod::None) return;
    const std::map<std::string, Curve> curves = sweep_curves(store_, spec_, sweep_.id);
    for (auto& t : running_) {
      if (t.run_id.empty() || t.prune_sent || !curves.count(t.run_id)) continue;
      if (auto reason = trial_prune_reason(spec_, curves, t.run_id)) prune(t, *reason);
    }
  }

  const SweepSpec& spec_;
  Store& store_;
  SweepRecord sweep_;
  std::string db_path_;
  std::vector<std::string> base_sets_;
  std::string log_dir_;
  std::vector<Slot> slots_;
  std::vector<bool> busy_;
  std::vector<int64_t> pending_;
  std::vector<Trial> running_;
  std::vector<TrialOutcome> finished_;
  std::set<std::string> known_runs_;
  std::string best_run_;
  double best_value_ = 0;
  bool target_reached_ = false;
};

// `dsrun sweep --slurm`: one job array, a task per trial and at most sweep.concurrency at once;
// each task claims trials from the store (run_slurm_sweep_task). Every task gets one node with
// the cores (or GPUs) a trial's ranks need.
int submit_sweep_to_slurm(const SweepSpec& spec, Store& store, const SweepRecord& sweep, const std::string& db_path, const std::vector<std::string>& sets) {
  LoadOptions options;
  options.overrides = sets;
  const LoadedRecipe base = load_recipe_file(sweep.recipe_path, options);
  const Plan plan = make_plan(base.recipe, read_host_facts());
  // One task per array element, on one node: its launcher starts the trial's ranks there.
  const std::string dir = absolute(path_join(runs_directory(db_path), "sweeps/" + sweep.id));
  SlurmJobSpec job = slurm_job_from_plan(base.recipe, plan, "dsrun-sweep-" + sweep.name, db_path, dir);
  job.nodes = 1;
  job.tasks_per_node = 1;
  job.cpus_per_task = job.gpus_per_node > 0 ? 0 : plan.ranks_per_node;
  job.array = "0-" + std::to_string(trial_budget(spec) - 1) + "%" + std::to_string(spec.concurrency);
  make_directories(dir);
  job.output = path_join(dir, "task-%a.out");
  job.requeue = false;  // a killed task's trial is taken up by the next task instead
  job.task_command = shell_quote(executable_path()) + " sweep --slurm-task " + sweep.id;
  const std::string script = path_join(dir, "job.sh");
  write_file_atomic(script, sbatch_script(job), 0700);  // the submitter's alone
  std::string job_id;
  try {
    job_id = submit_job(script);
  } catch (const Error& e) {
    store.update_sweep(sweep.id, "failed", "", "not submitted: " + e.describe(), 0);
    throw;
  }
  store.set_sweep_job(sweep.id, job_id);
  store.update_sweep(sweep.id, "running", "", "", 0);
  std::cout << "sweep " << sweep.id << " submitted to Slurm as job array " << job_id << " (" << trial_budget(spec) << " task(s), at most " << spec.concurrency
            << " at a time); task logs in " << dir << "\nfollow it: dsrun sweep --show " << sweep.id << "   dsrun history --sweep " << sweep.id << "\n";
  return 0;
}

// A trial of a Slurm sweep is attempted at most this often (a killed array task's trial runs again).
constexpr int kSlurmTrialAttempts = 2;

// The next trial for an array task, decided and recorded in one transaction: the lowest index no
// run holds (planned, running, or ended other than killed or lost) with attempts left, its
// parameters from the trials already in the store (TPE). Two tasks never get the same trial: the
// second one's transaction sees the first one's run. nullopt: nothing left to run.
struct ClaimedTrial {
  int64_t index = 0;
  TrialParams params;
  std::string run_id;
};
std::optional<ClaimedTrial> claim_trial(Store& store, const SweepSpec& spec, const SweepRecord& sweep, const std::string& job_id) {
  std::optional<ClaimedTrial> claim;
  store.transaction([&] {
    claim.reset();
    const int64_t budget = trial_budget(spec);
    std::vector<int> attempts(static_cast<size_t>(budget), 0);
    std::vector<bool> held(static_cast<size_t>(budget), false);
    std::vector<TrialOutcome> finished;
    for (const auto& r : store.sweep_trials(sweep.id)) {
      if (r.trial_index < 0 || r.trial_index >= budget) continue;
      const size_t i = static_cast<size_t>(r.trial_index);
      ++attempts[i];
      held[i] = held[i] || (r.status != RunStatus::Killed && r.status != RunStatus::Lost);
      if (r.status == RunStatus::Finished)
        if (auto o = objective_of(store, spec, r.id)) finished.push_back({params_of(r), *o});
    }
    for (int64_t i = 0; i < budget; ++i) {
      if (held[static_cast<size_t>(i)] || attempts[static_cast<size_t>(i)] >= kSlurmTrialAttempts) continue;
      ClaimedTrial c;
      c.index = i;
      c.params = next_trial(spec, i, finished);
      nlohmann::json params_json = nlohmann::json::object();
      for (const auto& [k, v] : c.params) params_json[k] = v;
      NewRun run;
      run.name = sweep.name + " #" + std::to_string(i);
      run.recipe_path = sweep.recipe_path;
      run.recipe_text = sweep.recipe_text;
      run.sweep_id = sweep.id;
      run.trial_index = i;
      run.trial_params = params_json.dump();
      run.host = read_host_facts().hostname;
      c.run_id = store.create_run(run);
      store.set_job(c.run_id, job_id, "RUNNING", "", "");
      claim = c;
      return;
    }
  });
  return claim;
}

// One task of a sweep's job array: claims trials until none is left, runs each as `dsrun run`
// (its own launcher, its ranks on this node), prunes it from the store's curves as the local
// sweep would, and the task that finds the sweep complete records it finished.
int run_slurm_sweep_task(Store& store, const std::string& sweep_query, const std::string& db_path) {
  struct sigaction sa {};
  sa.sa_handler = on_sweep_interrupt;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  const SweepRecord sweep = store.get_sweep(sweep_query);
  const nlohmann::json stored = nlohmann::json::parse(sweep.spec_json);
  const SweepSpec spec = sweep_spec_from_json(stored);
  const std::vector<std::string> base_sets = stored.contains("base_sets") ? stored["base_sets"].get<std::vector<std::string>>() : std::vector<std::string>{};
  const char* array_job = std::getenv("SLURM_ARRAY_JOB_ID");
  const char* array_task = std::getenv("SLURM_ARRAY_TASK_ID");
  const std::string job_id = array_job && array_task ? std::string(array_job) + "_" + array_task : std::getenv("SLURM_JOB_ID") ? std::getenv("SLURM_JOB_ID") : "";
  const std::string log_dir = path_join(runs_directory(db_path), "sweeps/" + sweep.id);
  make_directories(log_dir);
  int trials = 0;
  while (!sweep_interrupted) {
    std::optional<ClaimedTrial> claim = claim_trial(store, spec, sweep, job_id);
    if (!claim) break;
    ++trials;
    const std::string log = path_join(log_dir, "trial" + std::to_string(claim->index) + ".log");
    std::cout << "task " << job_id << ": trial " << claim->index + 1 << "/" << trial_budget(spec) << " as run " << claim->run_id << " ("
              << describe_params(claim->params) << ")\n" << std::flush;
    const pid_t pid = start_trial({sweep.recipe_path, db_path, base_sets, sweep.id, claim->index, claim->params, claim->run_id, log}, [] {});
    bool prune_sent = false, stop_sent = false;
    int exit_status = 0;
    while (true) {
      if (::waitpid(pid, &exit_status, WNOHANG) == pid) break;
      if (sweep_interrupted && !stop_sent) {
        ::kill(pid, SIGTERM);  // the trial's launcher stops its ranks and records the run killed
        stop_sent = true;
      }
      if (!prune_sent && spec.pruning.method != PruneMethod::None) {
        const std::map<std::string, Curve> curves = sweep_curves(store, spec, sweep.id);
        if (auto reason = curves.count(claim->run_id) ? trial_prune_reason(spec, curves, claim->run_id) : std::nullopt) {
          store.add_event(claim->run_id, "pruned", -1, *reason);
          ::kill(pid, SIGUSR2);
          prune_sent = true;
        }
      }
      ::usleep(500000);
    }
    RunRecord r = store.get_run(claim->run_id);
    if (r.status == RunStatus::Planned) {  // its `dsrun run` ended before it started the ranks
      const int code = WIFEXITED(exit_status) ? WEXITSTATUS(exit_status) : 128 + WTERMSIG(exit_status);
      store.set_status(r.id, RunStatus::Failed, "dsrun run exited with code " + std::to_string(code) + " before starting; see " + log);
      r = store.get_run(claim->run_id);
    }
    std::cout << "task " << job_id << ": trial " << claim->index + 1 << " " << to_string(r.status) << (r.error.empty() ? "" : ": " + r.error) << "\n" << std::flush;
  }
  // Nothing left to claim: when no trial is still planned or running, the sweep is complete.
  bool finished_here = false;
  store.transaction([&] {
    finished_here = false;  // (a retried transaction decides again)
    const std::vector<Row> rows = leaderboard(store, spec, sweep.id);
    for (const auto& row : rows)
      if (row.run.status == RunStatus::Planned || row.run.status == RunStatus::Running) return;
    const bool has_best = !rows.empty() && rows[0].run.status == RunStatus::Finished && rows[0].objective;
    if (!sweep_interrupted && store.get_sweep(sweep.id).status == "running") {
      store.update_sweep(sweep.id, "finished", has_best ? rows[0].run.id : "", "", 0);
      finished_here = true;
    }
  });
  if (finished_here) alert_if_finished(store, sweep.id);  // (once: the task that finished it)
  std::cout << "task " << job_id << ": " << trials << " trial(s) run, nothing left to claim\n";
  return sweep_interrupted ? 130 : 0;
}

}  // namespace

nlohmann::json sweep_leaderboard(const Store& store, const std::string& sweep_query) {
  const SweepRecord sweep = store.get_sweep(sweep_query);
  const SweepSpec spec = sweep_spec_from_json(nlohmann::json::parse(sweep.spec_json));
  return leaderboard_json(spec, sweep, leaderboard(store, spec, sweep.id));
}

int command_sweep(const SweepArgs& args, const std::string& db_path) {
  if (!args.slurm_task.empty()) {
    Store store(db_path);
    return run_slurm_sweep_task(store, args.slurm_task, db_path);
  }
  if (!args.show.empty() || !args.resume.empty()) {
    if (!store_exists(db_path)) throw Error("no run store here", ErrorContext{db_path, 0, 0, "", -1, "pass --db"});
  }
  if (!args.show.empty()) {
    Store store(db_path);
    SweepRecord sweep = store.get_sweep(args.show);
    print_leaderboard(store, sweep_spec_from_json(nlohmann::json::parse(sweep.spec_json)), sweep, args.json, args.csv);
    return 0;
  }
  make_directories(runs_directory(db_path));
  Store store(db_path);
  SweepRecord sweep;
  SweepSpec spec;
  std::vector<std::string> sets = args.sets;
  const HostFacts host = read_host_facts();
  if (!args.resume.empty()) {
    sweep = store.get_sweep(args.resume);
    spec = sweep_spec_from_json(nlohmann::json::parse(sweep.spec_json));
    const double age = unix_now() - sweep.heartbeat_at;
    if (sweep.status == "running" && sweep.host == host.hostname && process_alive(sweep.pid) && age < 15) {
      ErrorContext c;
      c.key = "sweep " + sweep.id;
      c.hint = "it is still running in process " + std::to_string(sweep.pid) + "; stop it first";
      throw Error("sweep is running", c);
    }
    // Trials a dead sweep left running: their processes died with it.
    for (const auto& r : store.sweep_trials(sweep.id))
      if (r.status == RunStatus::Running) {
        const std::string why = "abandoned: its sweep process died (last heartbeat " + format_seconds(unix_now() - sweep.heartbeat_at) + " ago)";
        store.add_event(r.id, "failed", -1, why);
        store.set_status(r.id, RunStatus::Failed, why);
      }
    store.update_sweep(sweep.id, "running", sweep.best_run, "", ::getpid());
    std::cout << "resuming sweep " << sweep.id << " (" << sweep.name << ")\n";
  } else {
    if (args.file.empty()) throw Error("dsrun sweep needs a recipe with a [sweep] section, --resume SWEEP or --show SWEEP");
    spec = load_sweep_spec(args.file);
    // The base recipe must be valid on one trial's share of the machine, and every swept value
    // acceptable for its key, before anything runs.
    LoadOptions options;
    options.host = trial_share(host, spec.concurrency);
    options.overrides = sets;
    LoadedRecipe base = load_recipe_file(args.file, options);
    if (!base.ok()) {
      std::cerr << base.report();
      LoadOptions whole = options;
      whole.host = host;
      if (!load_recipe_file(args.file, whole).ok()) throw Error("invalid recipe", ErrorContext{args.file, 0, 0, "", -1, "fix the errors above"});
      throw share_error(args.file, spec.concurrency, host, options.host, fitting_concurrency(args.file, whole, spec.concurrency));
    }
    if (spec.method != SweepMethod::Tpe) check_every_trial(args.file, spec, options);
    std::vector<std::string> problems;
    for (const auto& p : spec.parameters) {
      std::vector<nlohmann::json> probes = p.values;
      if (p.distribution != Distribution::Values) probes = {p.min, p.max};
      for (const auto& v : probes) {
        TrialParams one;
        if (p.keys.size() == 1) one[p.keys[0]] = p.distribution == Distribution::IntUniform ? nlohmann::json(static_cast<int64_t>(v.get<double>())) : v;
        else
          for (size_t k = 0; k < p.keys.size(); ++k) one[p.keys[k]] = v[k];
        LoadOptions o = options;
        for (const auto& s : trial_overrides(one)) o.overrides.push_back(s);
        LoadedRecipe r = load_recipe_file(args.file, o);
        for (const auto& d : r.diagnostics)
          if (d.severity == Diagnostic::Severity::Error && one.count(d.key)) problems.push_back(d.key + " = " + one[d.key].dump() + ": " + d.message);
      }
    }
    if (!problems.empty()) {
      ErrorContext c;
      c.file = args.file;
      c.key = "sweep.parameters";
      c.hint = "change the swept values";
      throw Error("swept values the recipe does not accept:\n  " + join(problems, "\n  "), c);
    }
    sweep.name = base.recipe.run.name.empty() ? file_stem(args.file) : base.recipe.run.name;
    sweep.recipe_path = args.file;
    sweep.recipe_text = read_file(args.file);
    nlohmann::json spec_json = sweep_spec_to_json(spec);
    spec_json["base_sets"] = sets;
    sweep.spec_json = spec_json.dump();
    sweep.host = host.hostname;
    sweep.pid = ::getpid();
    sweep.id = store.create_sweep(sweep);
    sweep.status = "running";
    std::cout << "sweep " << sweep.id << " (" << sweep.name << "): " << trial_budget(spec) << " trial(s), "
              << (spec.method == SweepMethod::Grid ? "grid" : spec.method == SweepMethod::Random ? "random" : "TPE") << ", "
              << (spec.maximize ? "maximize " : "minimize ") << spec.metric << "\n";
  }
  nlohmann::json stored = nlohmann::json::parse(sweep.spec_json);
  if (stored.contains("base_sets") && args.resume.size()) sets = stored["base_sets"].get<std::vector<std::string>>();
  if (args.slurm) return submit_sweep_to_slurm(spec, store, sweep, db_path, sets);
  SweepDriver driver(spec, store, sweep, db_path, sets);
  const int code = driver.run();
  alert_if_finished(store, sweep.id);
  return code;
}

}  // namespace dsrun
