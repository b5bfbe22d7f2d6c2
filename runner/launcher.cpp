#include "runner/launcher.hpp"

#include "engine/checkpoint/checkpoint.hpp"
#include "engine/common/clock.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/mesh_shape.hpp"
#include "engine/protocol/rank_reports.hpp"
#include "runner/alerts.hpp"
#include "storage/tensorboard.hpp"

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits.h>
#include <random>

namespace dsrun {

namespace {

volatile sig_atomic_t interrupted = 0;
void on_interrupt(int) { interrupted = 1; }
volatile sig_atomic_t checkpoint_requested = 0;  // SIGUSR1: forwarded to every rank
void on_checkpoint_request(int) { checkpoint_requested = 1; }
volatile sig_atomic_t prune_requested = 0;  // SIGUSR2: the sweep pruned this trial
void on_prune_request(int) { prune_requested = 1; }

// How often the launcher records that it is alive (runs.heartbeat_at). launcher_gone() allows
// kLauncherSilentSeconds, many times this, so a busy store or a slow shutdown never looks dead.
constexpr double kHeartbeatSeconds = 10;

// The kernel's state letter for a process ('R', 'S', 'T' stopped, 't' traced, 'Z' zombie, ...),
// or 0 when /proc does not show it.
char process_state(int64_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  if (!file_exists(path)) return 0;
  const std::string stat = read_file(path);
  const size_t paren = stat.rfind(')');  // the command name in parentheses may hold anything
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

// How long a launcher that ends waits for alerts still undelivered (a receiver down, then back).
constexpr double kAlertDrainSeconds = 30;

// How long a failure that only echoes a peer's (lost_peer) waits for the cause to report.
constexpr double kCauseWaitSeconds = 3;

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  int fd = -1;              // read end of the rank's report pipe
  std::string pending;      // a partial line
  bool running = true;
  int exit_code = 0;        // or 128 + signal
  bool ready = false;
  int64_t step = 0;         // the last step this rank started
  double last_progress = 0;
  std::string error;        // the rank's own error message, if it sent one
  std::string log_path;
  int64_t log_start = 0;    // where this attempt's lines begin (a resumed or restarted run's log holds earlier ones)
};

// A rank whose own error only says that a peer went away (Gloo's and NCCL's words for it): the
// cause is another rank's.
bool lost_peer(const RankProcess& p) {
  static const char* const kEchoes[] = {"Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited", "Socket closed",
                                        "NCCL communicator was aborted", "ncclRemoteError"};
  for (const char* echo : kEchoes)
    if (p.error.find(echo) != std::string::npos) return true;
  return false;
}

class Supervisor {
 public:
  Supervisor(const LoadedRecipe& loaded, const Plan& plan, Store& store, const std::string& run_id, const LaunchOptions& options,
             std::vector<AlertRule> alert_rules)
      : r_(loaded.recipe), plan_(plan), store_(store), run_id_(run_id), o_(options) {
    if (!alert_rules.empty()) alerts_ = std::make_unique<RunAlerts>(std::move(alert_rules), run_id, loaded.recipe.run.name, store);
  }

  RunStatus run(const std::string& config_path) {
    config_path_ = config_path;
    make_directories(path_join(o_.run_dir, "logs"));
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    struct sigaction usr {};
    usr.sa_handler = on_checkpoint_request;
    sigaction(SIGUSR1, &usr, nullptr);
    struct sigaction prune {};
    prune.sa_handler = on_prune_request;
    sigaction(SIGUSR2, &prune, nullptr);

    if (r_.logging.tensorboard) tensorboard_ = std::make_unique<TensorBoardWriter>(path_join(o_.run_dir, "tensorboard"), read_host_facts().hostname);
    std::string resume_from = o_.resume_from;
    for (int restarts = 0;; ++restarts) {
      oom_kills_at_start_ = kernel_oom_kills();
      restarts_ = restarts;
      start_ranks(config_path_, resume_from, restarts);
      node_status("running");
      Ending end = watch();
      const bool may_restart = end.status == RunStatus::Failed && end.restartable && restarts < r_.run.max_restarts && o_.single_rank < 0;
      if (!may_restart) {
        if (end.status == RunStatus::Failed && end.restartable && r_.run.max_restarts > 0)
          end.why = "run.max_restarts (" + std::to_string(r_.run.max_restarts) + ") used up; the last attempt: " + end.why;
        return record(end);
      }
      // Restart every rank from the newest checkpoint that verifies (a torn one is skipped).
      std::vector<std::string> skipped;
      auto found = find_checkpoint(o_.checkpoint_root, -1, /*fallback=*/true, &skipped);
      for (const auto& why : skipped) store_.add_event(run_id_, "checkpoint", -1, "skipped a checkpoint that does not verify", why);
      resume_from = found ? found->path : "";
      const std::string message = "restart " + std::to_string(restarts + 1) + " of " + std::to_string(r_.run.max_restarts) + " after: " + end.why + "; " +
                                  (found ? "from the checkpoint at step " + std::to_string(found->step) : "from the start (no checkpoint yet)");
      store_.add_event(run_id_, "restart", end.culprit, message);
      print_line("dsrun: " + message);
    }
  }

 private:
  // How an attempt ended, before it is recorded: restartable failures are rank deaths and hangs,
  // not errors a rank reported (a bad config or a NaN loss would only fail again).
  struct Ending {
    RunStatus status = RunStatus::Finished;
    std::string why;
    int culprit = -1;
    bool restartable = false;
  };

  RunStatus record(const Ending& end) {
    finish_progress();
    // A failed run's alert goes out before the launcher exits: deliveries get up to 30 s more.
    if (alerts_) alerts_->on_end(end.status, end.why, kAlertDrainSeconds);
    node_status(to_string(end.status), end.why);
    if (!o_.owns_run) {
      // Another node owns the run's status; this node's ending is its row and, when it failed, an event.
      if (end.status != RunStatus::Finished) {
        store_.add_event(run_id_, to_string(end.status), end.culprit, "node " + std::to_string(o_.node_rank) + " (" + hostname_ + "): " + end.why);
        std::cerr << "dsrun: node " << o_.node_rank << " of run " << run_id_ << " " << to_string(end.status) << ": " << end.why << "\n";
      }
      return end.status;
    }
    if (end.status == RunStatus::Finished) {
      store_.set_status(run_id_, RunStatus::Finished);
      store_.add_event(run_id_, "finished", -1, "all ranks finished");
      return end.status;
    }
    store_.set_status(run_id_, end.status, end.why);
    std::cerr << "dsrun: run " << run_id_ << " " << to_string(end.status) << ": " << end.why << "\n";
    return end.status;
  }

  void start_ranks(const std::string& config_path, const std::string& resume_from, int restart) {
    echo_seen_at_ = 0;
    ranks_.clear();
    stopped_early_.clear();
    // This node's ranks are first_rank + [first_local, end_local): all of them, or under an outside
    // launcher only the one it placed here.
    const bool single = o_.single_rank >= 0;
    const int local_world = single ? o_.local_world : (plan_.world_size + o_.nnodes - 1) / o_.nnodes;
    const int first_rank = single ? o_.single_rank - o_.local_rank : o_.node_rank * local_world;
    const int first_local = single ? o_.local_rank : 0, end_local = single ? o_.local_rank + 1 : local_world;
    // A fresh port per attempt: the last one may linger in TIME_WAIT.
    const int port = o_.master_port > 0 ? o_.master_port : free_port();
    const std::string rank_binary = path_join(executable_directory(), "dsrun-rank");
    const HostFacts host = read_host_facts();
    started_ = steady_seconds();
    first_step_ = 1;

    for (int local = first_local; local < end_local && first_rank + local < plan_.world_size; ++local) {
      RankProcess p;
      p.rank = first_rank + local;
      p.log_path = path_join(o_.run_dir, "logs/rank" + std::to_string(p.rank) + ".log");
      p.log_start = file_exists(p.log_path) ? file_size(p.log_path) : 0;
      int pipe_fds[2];
      if (::pipe2(pipe_fds, O_CLOEXEC) != 0) fail_at(__FILE__, __LINE__, "pipe failed");
      pid_t pid = ::fork();
      if (pid < 0) fail_at(__FILE__, __LINE__, "fork failed");
      if (pid == 0) {
        // The child: its own process group (Ctrl-C reaches only the launcher), log file, environment.
        ::setpgid(0, 0);
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed outright takes its ranks with it
        int log = ::open(p.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (log >= 0) {
          ::dup2(log, 1);
          ::dup2(log, 2);
        }
        ::dup2(pipe_fds[1], 3);  // the report pipe is fd 3 in every rank
        const int threads = std::max(1, host.cpu_cores / local_world);
        set_rank_environment(RankPlace{p.rank, plan_.world_size, local, local_world, o_.master_addr, port});
        ::setenv("DSRUN_REPORT_FD", "3", 1);
        ::setenv("DSRUN_RUN_ID", run_id_.c_str(), 1);
        ::setenv("DSRUN_RESTART", std::to_string(restart).c_str(), 1);
        ::setenv("DSRUN_CHECKPOINT_DIR", o_.checkpoint_root.c_str(), 1);
        if (!resume_from.empty()) ::setenv("DSRUN_RESUME_FROM", resume_from.c_str(), 1);
        else ::unsetenv("DSRUN_RESUME_FROM");
        if (o_.accept_data_change) ::setenv("DSRUN_ACCEPT_DATA_CHANGE", "1", 1);
        // Threads: torch's OpenMP pool gets the rank's share of the cores; OpenBLAS stays single-
        // threaded, since its own pool fights OpenMP's (measured: 0.57 -> 0.16 s/step, docs/benchmarks.md).
        // Values the user exported win.
        ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 0);
        ::setenv("OPENBLAS_NUM_THREADS", "1", 0);
        if (!r_.hardware.p2p) ::setenv("NCCL_P2P_DISABLE", "1", 1);
        if (o_.nccl_debug) {
          ::setenv("NCCL_DEBUG", "INFO", 1);
          ::setenv("NCCL_DEBUG_SUBSYS", "INIT,COLL", 1);
          ::setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
        }
        if (o_.debug_rank >= 0) ::setenv("DSRUN_DEBUG_RANK", std::to_string(o_.debug_rank).c_str(), 1);
        execl(rank_binary.c_str(), rank_binary.c_str(), config_path.c_str(), static_cast<char*>(nullptr));
        std::fprintf(stderr, "cannot start %s: %s\n", rank_binary.c_str(), std::strerror(errno));
        _exit(127);
      }
      ::close(pipe_fds[1]);
      p.pid = pid;
      p.fd = pipe_fds[0];
      p.last_progress = steady_seconds();
      ranks_.push_back(p);
    }
    if (single && !o_.owns_run) return;  // one launch event per run under an outside launcher, from rank 0's worker
    const std::string where = o_.nnodes > 1 ? " on node " + std::to_string(o_.node_rank) + " (" + hostname_ + ")" : "";
    store_.add_event(run_id_, "launch", -1,
                     "started " + (single ? std::string("rank 0 of ") + std::to_string(plan_.world_size) + " under an outside launcher" : std::to_string(ranks_.size()) + " rank(s)") +
                         where + " on port " + std::to_string(port) + ", logs in " + path_join(o_.run_dir, "logs") +
                         (resume_from.empty() ? "" : ", resuming from " + resume_from));
  }

  void node_status(const std::string& status, const std::string& error = "") {
    if (o_.reports_node) report_node(store_, run_id_, o_, status, restarts_, error);
    node_status_ = status;
  }

  // Several nodes: the other nodes whose launcher is gone (on this host, its process has exited;
  // anywhere, no report for three heartbeats), each row marked lost; "" when none.
  std::string gone_nodes() {
    if (!o_.reports_node) return "";
    std::vector<std::string> gone;
    const double now = unix_now();
    for (const NodeRecord& n : store_.nodes(run_id_)) {
      if (n.node_rank == o_.node_rank || (n.status != "running" && n.status != "starting")) continue;
      std::string why;
      if (n.host == hostname_ && n.pid > 0 && !process_alive(n.pid)) why = "its launcher, process " + std::to_string(n.pid) + " on this host, has exited";
      else if (n.heartbeat_at > 0 && now - n.heartbeat_at > 3 * kHeartbeatSeconds) why = "no report from its launcher for " + format_seconds(now - n.heartbeat_at);
      if (why.empty()) continue;
      NodeReport lost = n;
      lost.status = "lost";
      lost.error = why;
      store_.report_node(run_id_, lost);
      gone.push_back("node " + std::to_string(n.node_rank) + " (" + n.host + ") is gone: " + why);
      store_.add_event(run_id_, "lost", -1, gone.back());
    }
    return join(gone, "; ");
  }

  // Several nodes, start-up timed out: the nodes that never joined (no row of theirs in the run),
  // with the rendezvous they were to reach, and those whose launcher failed; "" when all are here.
  std::string nodes_not_started() {
    if (!o_.reports_node || o_.nnodes <= 1) return "";
    std::vector<bool> seen(static_cast<size_t>(o_.nnodes), false);
    std::vector<std::string> parts;
    for (const NodeRecord& n : store_.nodes(run_id_)) {
      if (n.node_rank < 0 || n.node_rank >= o_.nnodes) continue;
      seen[static_cast<size_t>(n.node_rank)] = true;
      if (n.status == "failed" || n.status == "lost")
        parts.push_back("node " + std::to_string(n.node_rank) + " (" + n.host + ") " + n.status + (n.error.empty() ? "" : ": " + n.error));
    }
    const std::string rendezvous = o_.master_addr + ":" + std::to_string(o_.master_port);
    std::vector<std::string> missing;
    for (int k = 0; k < o_.nnodes; ++k)
      if (!seen[static_cast<size_t>(k)]) missing.push_back(std::to_string(k));
    if (!missing.empty())
      parts.push_back("node " + join(missing, ", ") + " of " + std::to_string(o_.nnodes) + " never joined the rendezvous at " + rendezvous +
                      " within run.startup_timeout_s = " + format_seconds(plan_.startup_timeout_seconds) + ": start `dsrun run RECIPE --nnodes " +
                      std::to_string(o_.nnodes) + " --node-rank " + missing.front() + " --master-addr " + o_.master_addr + " --master-port " +
                      std::to_string(o_.master_port) + "` there with this node's recipe and overrides, and check that it reaches " + rendezvous);
    return parts.empty() ? "" : ": " + join(parts, "; ");
  }

  // `dsrun watch` and `dsrun delete` on another terminal tell a dead launcher by this.
  void heartbeat() {
    const double now = steady_seconds();
    if (now - last_heartbeat_ < kHeartbeatSeconds) return;
    last_heartbeat_ = now;
    if (o_.owns_run) store_.run_heartbeat(run_id_, hostname_, ::getpid());
    if (o_.reports_node) report_node(store_, run_id_, o_, node_status_, restarts_);
  }

  Ending watch() {
    while (true) {
      heartbeat();
      if (alerts_) alerts_->tick(steady_seconds());
      std::vector<pollfd> fds;
      for (auto& p : ranks_)
        if (p.fd >= 0) fds.push_back({p.fd, POLLIN, 0});
      if (!fds.empty()) ::poll(fds.data(), fds.size(), 200);
      else ::usleep(100000);
      for (auto& p : ranks_) drain(p);
      reap();

      // A rank installs its SIGUSR1 handler before it reports ready; until every rank has, the
      // signal's default action would kill it. The request waits (it stays set) until then.
      const bool all_ready = std::all_of(ranks_.begin(), ranks_.end(), [](const RankProcess& p) { return p.ready || !p.running; });
      if (checkpoint_requested && all_ready) {
        checkpoint_requested = 0;
        for (auto& p : ranks_)
          if (p.running) ::kill(p.pid, SIGUSR1);
        store_.add_event(run_id_, "checkpoint", -1, "checkpoint requested (SIGUSR1); saved after the current step");
      }
      if (prune_requested) return stop_all({RunStatus::Pruned, "pruned by its sweep (the pruned event says why)", -1, false}, 5.0);
      if (interrupted) {
        // Healthy ranks finish their step and save (checkpoint.at_end) before they exit.
        const double grace = r_.checkpoint.at_end ? std::min(120.0, std::max(5.0, r_.run.step_timeout_s)) : 5.0;
        return stop_all({RunStatus::Killed, "interrupted (Ctrl-C or SIGTERM)", -1, false}, grace);
      }
      // The cause, not its echo: a rank that failed on its own (disk full, a model mismatch)
      // before one that only lost its peer, whichever the kernel reported first. A peer's echo
      // alone waits a moment for the cause to report.
      const RankProcess* failed = nullptr;
      for (auto& p : ranks_)
        if (!p.running && p.exit_code != 0 && (!failed || (lost_peer(*failed) && !lost_peer(p)))) failed = &p;
      if (failed && lost_peer(*failed)) {
        const bool others_running = std::any_of(ranks_.begin(), ranks_.end(), [](const RankProcess& p) { return p.running; });
        if (echo_seen_at_ == 0) echo_seen_at_ = steady_seconds();
        if (others_running && steady_seconds() - echo_seen_at_ < kCauseWaitSeconds) continue;
      }
      if (failed) {
        const RankProcess& p = *failed;
        std::string why = "rank " + std::to_string(p.rank) + " " +
                          (p.exit_code > 128 ? "was killed by signal " + std::to_string(p.exit_code - 128) : "exited with code " + std::to_string(p.exit_code)) +
                          (p.error.empty() ? "" : ": " + p.error);
        // Several nodes: a node whose launcher died is the cause of its peers' lost connections.
        const std::string gone = gone_nodes();
        if (!gone.empty()) why = gone + "; then " + why;
        // Out of memory only when the kernel says its killer ran since the ranks started
        // (/proc/vmstat's oom_kill); a SIGKILL from anyone else is not guessed at.
        if (p.exit_code == 128 + SIGKILL && p.error.empty() && kernel_oom_kills() > oom_kills_at_start_)
          why += " by the kernel's out-of-memory killer (the plan counts " + format_bytes(plan_.host.total()) + " of host memory per rank, " + format_bytes(plan_.host_memory_needed) +
                 " per node: check hardware.host_memory_gib and parallel.offload against this machine)";
        return stop_all({RunStatus::Failed, why, p.rank, p.error.empty()}, 5.0);
      }
      bool all_done = true;
      for (auto& p : ranks_) all_done &= !p.running;
      if (all_done && !stopped_early_.empty()) {
        // Ranks stopped by a SIGTERM from outside (a scheduler, a preemption): not a finished run.
        store_.add_event(run_id_, "killed", -1, stopped_early_);
        return {RunStatus::Killed, stopped_early_, -1, false};
      }
      if (all_done) return {RunStatus::Finished, "", -1, false};
      // Hangs: no progress within the step timeout (start-up has its own, longer one). When one
      // rank hangs the others soon wait for it in a collective, so all go quiet: the culprit is the
      // rank that got least far (started the fewest steps, or never became ready).
      const double now = steady_seconds();
      // A rank the kernel shows stopped (SIGSTOP, a debugger) is the culprit by definition, and the
      // others' silence is only their wait for it: once anyone is past the step timeout (start-up
      // included), it is the one named.
      const RankProcess* stopped = nullptr;
      char stopped_state = 0;
      for (auto& p : ranks_) {
        const char state = p.running ? process_state(p.pid) : 0;
        if ((state == 'T' || state == 't') && !stopped) stopped = &p, stopped_state = state;
      }
      if (stopped) {
        double quiet = 0;
        for (auto& p : ranks_)
          if (p.running) quiet = std::max(quiet, now - p.last_progress);
        if (quiet > r_.run.step_timeout_s)
          return stop_all({RunStatus::Failed,
                           describe_rank(stopped->rank) + " hung: its process is stopped (state " + std::string(1, stopped_state) +
                               ": SIGSTOP, or a debugger holds it) and made no progress for " + format_seconds(now - stopped->last_progress) + " (run.step_timeout_s)",
                           stopped->rank, true},
                          5.0);
      }
      for (auto& p : ranks_) {
        if (!p.running) continue;
        const double limit = p.ready ? r_.run.step_timeout_s : plan_.startup_timeout_seconds;
        if (now - p.last_progress <= limit) continue;
        auto progress = [](const RankProcess& q) { return q.ready ? q.step : -1; };  // not ready: least of all
        const RankProcess* culprit = &p;
        bool all_level = true;
        for (auto& q : ranks_) {
          if (!q.running) continue;
          all_level &= progress(q) == progress(p);
          if (progress(q) < progress(*culprit)) culprit = &q;
        }
        std::string why = all_level ? (p.ready ? "all ranks stopped making progress in step " + std::to_string(p.step) + " for " +
                                                     format_seconds(now - p.last_progress) + " (a collective that never completed?) (run.step_timeout_s)"
                                               : "no rank finished start-up within " + format_seconds(now - p.last_progress) +
                                                     " (rendezvous or model build; run.startup_timeout_s)" + nodes_not_started())
                                    : describe_rank(culprit->rank) + " hung: " +
                                          (culprit->ready ? "it never started step " + std::to_string(culprit->step + 1) + " while others did (run.step_timeout_s)"
                                                          : "no progress during start-up (run.startup_timeout_s)");
        return stop_all({RunStatus::Failed, why, all_level ? -1 : culprit->rank, true}, 5.0);
      }
    }
  }

  // "rank 5", or with model parallelism where it sits: "rank 5 (pipeline stage 1, data 0, tensor 1)".
  std::string describe_rank(int rank) const {
    const MeshShape shape = plan_.layout.mesh_shape();
    std::string s = "rank " + std::to_string(rank);
    if (shape.data == shape.size() && shape.expert == 1 && shape.context == 1) return s;
    const MeshCoordinates c = shape.coordinates_of(rank);
    return s + " (pipeline stage " + std::to_string(c.pipeline) + ", data " + std::to_string(c.data) + ", tensor " + std::to_string(c.tensor) +
           (shape.context > 1 ? ", replica " + std::to_string(shape.replica(rank)) + " context " + std::to_string(shape.context_rank(rank)) : "") +
           (shape.expert > 1 ? ", expert shard " + std::to_string(shape.expert_shard(rank)) : "") + ")";
  }

  void drain(RankProcess& p) {
    if (p.fd < 0) return;
    char buf[65536];
    while (true) {
      pollfd pfd{p.fd, POLLIN, 0};
      if (::poll(&pfd, 1, 0) <= 0) return;
      ssize_t n = ::read(p.fd, buf, sizeof buf);
      if (n <= 0) {
        ::close(p.fd);
        p.fd = -1;
        return;
      }
      p.pending.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = p.pending.find('\n')) != std::string::npos) {
        std::string line = p.pending.substr(0, nl);
        p.pending.erase(0, nl + 1);
        handle(p, line);
      }
    }
  }

  void handle(RankProcess& p, const std::string& line) {
    std::optional<ReceivedReport> report = decode_report(line);
    if (!report) {
      store_.add_event(run_id_, "garbled", p.rank, "unreadable report line", line.substr(0, 200));
      return;
    }
    p.last_progress = steady_seconds();
    std::visit([&](const auto& body) { on_report(p, body); }, report->body);
  }

  // One overload per report kind: a new kind does not compile until the launcher handles it.
  void on_report(RankProcess& p, const ReadyReport& r) {
    p.ready = true;
    first_step_ = r.first_step;
    if (p.rank == 0) store_.add_event(run_id_, "ready", -1, "ranks started in " + format_seconds(steady_seconds() - started_));
    if (p.rank == 0) store_.add_metrics(run_id_, 0, {{"startup_seconds", r.startup_seconds}, {"launch_to_ready_seconds", steady_seconds() - started_}});
  }

  void on_report(RankProcess& p, const BeatReport& r) { p.step = r.step; }

  void on_report(RankProcess& p, const StepReport& r) {
    if (o_.config_pending && !config_recorded_) {  // training runs on the resume's overrides: they are the run's now
      config_recorded_ = true;
      for (const auto& [from, to] : {std::pair<std::string, std::string>{"config.resume.toml", "config.toml"}, {"plan.resume.json", "plan.json"}}) {
        const std::string source = node_file_name(from, o_.node_rank), target = node_file_name(to, o_.node_rank);
        if (::rename(path_join(o_.run_dir, source).c_str(), path_join(o_.run_dir, target).c_str()) != 0)
          fail_at(__FILE__, __LINE__, "rename " + source + " to " + target + " in " + o_.run_dir + ": " + std::strerror(errno));
      }
      sync_directory(o_.run_dir);
      config_path_ = absolute(path_join(o_.run_dir, node_file_name("config.toml", o_.node_rank)));  // (what a restart starts from)
      if (o_.on_started) o_.on_started();
    }
    record_metrics(p, r.step, r.metrics);
    show_progress(r.step, r.total, metrics_json(r.metrics));
  }

  void on_report(RankProcess& p, const EvalReport& r) {
    record_metrics(p, r.step, r.metrics);
    print_line("eval at step " + std::to_string(r.step) + ": " + metrics_json(r.metrics).dump());
  }

  void on_report(RankProcess& p, const MemoryReport& r) {
    const std::string prefix = "memory/rank" + std::to_string(p.rank) + "/";
    std::vector<std::pair<std::string, double>> values;
    for (const auto& [name, value] : memory_values(r)) values.push_back({prefix + name, value});
    store_.add_metrics(run_id_, 0, values);
  }

  void on_report(RankProcess& p, const EventReport& r) {
    store_.add_event(run_id_, r.kind, p.rank, r.message);
    if (r.kind == "stopped") stopped_early_ = "a rank was asked to stop (" + r.message + ")";
  }

  void on_report(RankProcess& p, const CheckpointReport& r) {
    CheckpointRecord c;
    c.step = r.step;
    c.path = r.path;
    c.bytes = r.bytes;
    c.checksum = r.checksum;
    c.created_at = unix_now();
    store_.add_checkpoint(run_id_, c);
    for (const auto& removed : r.removed) store_.remove_checkpoint(run_id_, removed);
    const double write_seconds = std::max(1e-9, r.seconds);
    store_.add_event(run_id_, "checkpoint", -1, "saved step " + std::to_string(c.step) + " (" + r.why + ") to " + c.path + ", " +
                                                   format_bytes(static_cast<double>(c.bytes)) + " in " + format_seconds(r.seconds) +
                                                   (r.async ? ", training paused " + format_seconds(r.pause_seconds) + " (async)" : " (sync)"));
    // Per save, so that compare shows what checkpoints cost: the pause, and the disk's bandwidth.
    store_.add_metrics(run_id_, r.step, {{"checkpoint_pause_s", r.pause_seconds}, {"checkpoint_wait_s", r.wait_seconds}, {"checkpoint_write_s", r.seconds},
                                         {"checkpoint_write_MBps", static_cast<double>(c.bytes) / 1e6 / write_seconds}});
  }

  void on_report(RankProcess& p, const RestoreReport& r) {
    store_.add_metrics(run_id_, r.step, {{"checkpoint_read_s", r.seconds}, {"checkpoint_read_MBps", static_cast<double>(r.bytes) / 1e6 / std::max(1e-9, r.seconds)}});
    store_.add_event(run_id_, "checkpoint", -1, "read step " + std::to_string(r.step) + " from " + r.path + ": " + format_bytes(static_cast<double>(r.bytes)) + " in " +
                                                   format_seconds(r.seconds));
  }

  void on_report(RankProcess& p, const ErrorReport& r) { p.error = r.message; }

  void on_report(RankProcess& p, const DoneReport&) {}  // the exit status says the rest

  // A value that is not finite is named in an event, not stored: SQLite and TensorBoard want numbers.
  void record_metrics(RankProcess& p, int64_t step, const Metrics& metrics) {
    std::vector<std::pair<std::string, double>> values;
    for (const auto& [name, value] : metrics) {
      if (std::isfinite(value)) values.push_back({name, value});
      else store_.add_event(run_id_, "metric", p.rank, name + " is not a finite number at step " + std::to_string(step));
    }
    store_.add_metrics(run_id_, step, values);
    if (alerts_) alerts_->on_metrics(step, metrics);  // (NaN included: alerts watch for it; conditions read the store)
    if (tensorboard_) {
      try {
        tensorboard_->add_scalars(step, values);
      } catch (const Error& e) {  // recorded, and the run goes on without event files
        store_.add_event(run_id_, "tensorboard", -1, e.describe());
        tensorboard_.reset();
      }
    }
  }

  // For the terminal, which shows metrics sorted by name as it always has; a NaN prints as null.
  static nlohmann::json metrics_json(const Metrics& metrics) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [name, value] : metrics) out[name] = value;
    return out;
  }

  void reap() {
    for (auto& p : ranks_) {
      if (!p.running) continue;
      int status = 0;
      pid_t got = ::waitpid(p.pid, &status, WNOHANG);
      if (got != p.pid) continue;
      drain(p);  // the last lines it wrote
      p.running = false;
      p.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
  }

  // Stops every rank still running (SIGTERM, then SIGKILL after `grace` seconds) and records why.
  Ending stop_all(const Ending& end, double grace) {
    finish_progress();
    const RunStatus status = end.status;
    const std::string& why = end.why;
    const int culprit = end.culprit;
    for (auto& p : ranks_)
      if (p.running) ::kill(p.pid, SIGTERM);
    const double deadline = steady_seconds() + grace;
    while (steady_seconds() < deadline) {
      heartbeat();  // the grace period may be minutes (checkpoint.at_end)
      for (auto& p : ranks_) drain(p);  // checkpoints saved while stopping are still recorded
      reap();
      bool any = false;
      for (auto& p : ranks_) any |= p.running;
      if (!any) break;
      ::usleep(50000);
    }
    for (auto& p : ranks_)
      if (p.running) ::kill(p.pid, SIGKILL);
    for (auto& p : ranks_)
      if (p.running) {
        int s;
        ::waitpid(p.pid, &s, 0);
        p.running = false;
      }
    std::string detail;
    if (culprit >= 0) {
      for (auto& p : ranks_)
        if (p.rank == culprit) detail = tail_of_file(p.log_path, 20, p.log_start);
    }
    if (status != RunStatus::Pruned) store_.add_event(run_id_, status == RunStatus::Killed ? "killed" : "failed", culprit, why, detail);
    if (!detail.empty()) std::cerr << "--- last lines of rank " << culprit << "'s log ---\n" << detail << "\n---\n";
    return end;
  }

  void show_progress(int64_t step, int64_t total, const nlohmann::json& metrics) {
    const double elapsed = steady_seconds() - started_;
    const int64_t done_here = step - first_step_ + 1;  // steps this attempt ran (a resumed run starts later)
    const double eta = done_here > 0 ? elapsed / static_cast<double>(done_here) * static_cast<double>(total - step) : 0;
    std::string line = "step " + std::to_string(step) + "/" + std::to_string(total) + "  loss " + format_double(metrics.value("loss", 0.0), 5) +
                       "  lr " + format_double(metrics.value("lr", 0.0), 3) + "  " + format_count(metrics.value("tokens_per_second", 0.0)) +
                       (r_.model.arch == ModelArch::ResNet ? " img/s" : " tok/s") + "  ETA " + format_seconds(eta);
    if (!o_.progress) return;
    if (::isatty(1)) {
      std::cout << "\r" << line << "\033[K" << std::flush;
      progress_open_ = true;
    } else if (step == 1 || step == total || step % std::max<int64_t>(1, total / 20) == 0) {
      std::cout << line << "\n" << std::flush;
    }
  }

  void print_line(const std::string& text) {
    finish_progress();
    std::cout << text << "\n";
  }

  void finish_progress() {
    if (progress_open_) std::cout << "\n";
    progress_open_ = false;
  }

  const Recipe& r_;
  const Plan& plan_;
  Store& store_;
  std::string run_id_;
  LaunchOptions o_;
  std::vector<RankProcess> ranks_;
  double started_ = 0;
  int64_t first_step_ = 1;
  double echo_seen_at_ = 0;       // when a rank that only lost its peer was first seen failed
  bool config_recorded_ = false;  // LaunchOptions::config_pending: the resume's config made the run's
  std::string config_path_;       // what the ranks load
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // logging.tensorboard: RUN_DIR/tensorboard/
  std::unique_ptr<RunAlerts> alerts_;               // the run's [[alerts]] and the user's (owning node only)
  bool progress_open_ = false;
  std::string stopped_early_;  // why, when a rank stopped before the last step
  std::string hostname_ = read_host_facts().hostname;
  int64_t oom_kills_at_start_ = -1;  // the kernel's out-of-memory kills when the ranks started

  // The kernel's count of out-of-memory kills on this machine (-1 where it keeps none).
  static int64_t kernel_oom_kills() {
    if (!file_exists("/proc/vmstat")) return -1;
    std::istringstream vmstat(read_file("/proc/vmstat"));
    std::string key;
    int64_t value = 0;
    while (vmstat >> key >> value)
      if (key == "oom_kill") return value;
    return -1;
  }
  double last_heartbeat_ = 0;
  int restarts_ = 0;
  std::string node_status_ = "starting";
};

void pin(Config& config, const std::string& key, Value value) {
  config[key].value = std::move(value);
}

}  // namespace

void set_rank_environment(const RankPlace& place) {
  ::setenv("RANK", std::to_string(place.rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(place.world).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(place.local_rank).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(place.local_world).c_str(), 1);
  ::setenv("MASTER_ADDR", place.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(place.master_port).c_str(), 1);
}

int free_port() {
  std::random_device random;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = 20000 + static_cast<int>(random() % 12000);
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (ok) return port;
  }
  fail_at(__FILE__, __LINE__, std::string("cannot find a free port: ") + std::strerror(errno));
}

std::string tail_of_file(const std::string& path, int lines, int64_t from_byte) {
  if (!file_exists(path)) return "";
  const std::string text = read_file(path);
  std::vector<std::string> all = split(text.substr(std::min<size_t>(text.size(), static_cast<size_t>(std::max<int64_t>(0, from_byte)))), '\n');
  while (!all.empty() && all.back().empty()) all.pop_back();
  size_t from = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0;
  return join(std::vector<std::string>(all.begin() + static_cast<long>(from), all.end()), "\n");
}

std::string node_file_name(const std::string& name, int node_rank) {
  if (node_rank <= 0) return name;
  const size_t dot = name.find('.');
  return name.substr(0, dot) + "-node" + std::to_string(node_rank) + name.substr(dot);
}

std::string rank_config_toml(const LoadedRecipe& loaded, const Plan& plan) {
  Config c = loaded.config;
  const Recipe& r = loaded.recipe;
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  // The layout as planned ("auto" keys resolved by the search and the planner): the rank reads
  // these keys and plans the same layout, never a second choice of its own.
  for (const auto& [key, value] : plan.layout.to_config_keys()) pin(c, key, value);
  // And how each step executes (the loss chunk, the update path, the attention kernel): the rank
  // runs these modes, and refuses to start where its build cannot (a mismatch named, not priced wrong).
  for (const auto& [key, value] : plan.modes.to_config_keys()) pin(c, key, value);
  pin(c, "hardware.devices_per_node", Value::of_int(r.hardware.devices_per_node));
  pin(c, "hardware.memory_gib", Value::of_float(r.hardware.memory_bytes / GiB));
  pin(c, "hardware.host_memory_gib", Value::of_float(r.hardware.host_memory_bytes / GiB));
  pin(c, "checkpoint.async", Value::of_bool(plan.checkpoint_disk.async));  // as planned: unset, the plan may have chosen synchronous
  pin(c, "data.path", Value::of_string(absolute(r.data.path)));
  pin(c, "data.val_path", Value::of_string(absolute(r.data.val_path)));
  if (!r.data.blend.empty()) {  // resolved against the recipe: the rank reads its config from the run directory
    Value blend;
    blend.kind = Value::Kind::Array;
    for (const std::string& p : r.data.blend) blend.items.push_back(Value::of_string(absolute(p)));
    pin(c, "data.blend", blend);
  }
  pin(c, "hooks.script", Value::of_string(absolute(r.hooks.script)));
  pin(c, "model.init_from", Value::of_string(absolute(r.model.init_from)));
  pin(c, "checkpoint.dir", Value::of_string(absolute(r.checkpoint.dir)));
  return config_to_toml(c);
}

std::string checkpoint_root_of(const Recipe& recipe, const std::string& run_dir, const std::string& run_id) {
  return absolute(recipe.checkpoint.dir.empty() ? path_join(run_dir, "checkpoints") : path_join(recipe.checkpoint.dir, run_id));
}

// The plan fits the recipe's hardware; this node must also have that much host memory free now,
// or the kernel would kill a rank mid-run with a bare SIGKILL.
static void check_host_memory_available(const Plan& plan) {
  const HostFacts host = read_host_facts();
  if (host.available_bytes <= 0 || plan.host_memory_needed <= host.available_bytes) return;
  ErrorContext c;
  c.key = "hardware.host_memory_gib";
  c.hint = "free host memory, run fewer ranks on this node, or lower what each holds (parallel.offload, parallel.zero_stage); `dsrun plan` shows the host table";
  throw Error("the plan needs " + format_bytes(plan.host_memory_needed) + " of host memory on this node (" + std::to_string(plan.ranks_per_node) + " rank(s) x " +
                  format_bytes(plan.host.total()) + "), but only " + format_bytes(host.available_bytes) + " is available now (MemAvailable)",
              c);
}

// How long a launcher's store write waits for a lost server before journaling it:
// $DSRUN_STORE_RECONNECT_S, else 10 s (a restart is back within that).
static double store_reconnect_seconds() {
  const char* v = std::getenv("DSRUN_STORE_RECONNECT_S");
  return v && std::atof(v) > 0 ? std::atof(v) : 10.0;
}

// The run has ended: what the store could not take is replayed before the launcher exits, trying
// for up to 10 minutes; past that it stays in the journal, which the run's next launcher
// (`dsrun resume`) replays first.
static void flush_store_journal(Store& store) {
  if (!store.journal_pending()) return;
  std::fprintf(stderr, "dsrun: waiting up to 10 min for the run store to take the run's last writes\n");
  const double deadline = steady_seconds() + 600;
  while (!store.replay_journal(/*now=*/true)) {
    if (store.journal_waits_for_missing_run()) {
      std::fprintf(stderr, "dsrun: warning: the run is not in the store: its record (status, metrics, events) is only in its journal until it is brought back and replayed\n");
      const std::string lost = store.unjournaled_writes();
      if (!lost.empty()) std::fprintf(stderr, "dsrun: error: the journal file could not take some writes, and they end with this launcher: %s\n", lost.c_str());
      return;
    }
    if (steady_seconds() > deadline) {
      std::fprintf(stderr, "dsrun: warning: the run store stayed away: the run's last writes wait in its journal; `dsrun resume` replays them\n");
      const std::string lost = store.unjournaled_writes();
      if (!lost.empty())
        std::fprintf(stderr, "dsrun: error: the journal file could not take some writes, and they end with this launcher: %s\n", lost.c_str());
      return;
    }
    ::usleep(5000000);
  }
}

RunStatus launch_run(const LoadedRecipe& loaded, const Plan& plan, Store& store, const std::string& run_id, const LaunchOptions& options) {
  // Whatever fails here, before the ranks start or after they end, ends the run `failed` with the
  // reason: a run is never left `running` without a launcher.
  try {
    check_host_memory_available(plan);
    make_directories(options.run_dir);
    const std::string pending = options.config_pending ? ".resume" : "";
    const std::string config_path = absolute(path_join(options.run_dir, node_file_name("config" + pending + ".toml", options.node_rank)));
    write_file_atomic(config_path, rank_config_toml(loaded, plan));
    write_file_atomic(path_join(options.run_dir, node_file_name("plan" + pending + ".json", options.node_rank)), plan_to_json(plan));
    // Training never stops for the store: what it cannot take waits, in order, beside the run.
    store.journal_writes_to(path_join(options.run_dir, "store_journal-node" + std::to_string(options.node_rank) + ".jsonl"), store_reconnect_seconds());
    if (options.owns_run) {
      if (!options.run_claimed) store.set_status(run_id, RunStatus::Running);
      store.run_heartbeat(run_id, read_host_facts().hostname, ::getpid());
    }
    if (options.reports_node) report_node(store, run_id, options, "starting", 0);
    LaunchOptions o = options;
    if (o.checkpoint_root.empty()) o.checkpoint_root = checkpoint_root_of(loaded.recipe, options.run_dir, run_id);
    make_directories(o.checkpoint_root);
    Supervisor supervisor(loaded, plan, store, run_id, o, options.owns_run ? alert_rules_for_run(loaded.alerts) : std::vector<AlertRule>{});
    const RunStatus status = supervisor.run(config_path);
    flush_store_journal(store);
    return status;
  } catch (const std::exception& e) {
    const Error* error = dynamic_cast<const Error*>(&e);
    const std::string why = "the launcher failed: " + (error ? error->describe() : std::string(e.what()));
    try {
      if (options.reports_node) report_node(store, run_id, options, "failed", 0, why);
      if (!options.owns_run) {
        store.add_event(run_id, "failed", -1, "node " + std::to_string(options.node_rank) + ": " + why);
      } else if (const RunStatus now = store.get_run(run_id).status; now == RunStatus::Planned || now == RunStatus::Running) {
        store.add_event(run_id, "failed", -1, why);
        store.set_status(run_id, RunStatus::Failed, why);
      }
      flush_store_journal(store);
    } catch (const Error& unrecorded) {  // the store itself failed: both errors reach the user
      throw Error(why + "; and it could not be recorded: " + unrecorded.describe());
    }
    throw;
  }
}

std::string absolute(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char cwd[PATH_MAX];
  if (!::getcwd(cwd, sizeof cwd)) fail_at(__FILE__, __LINE__, "cannot read the working directory");
  return path_join(cwd, path);
}

std::string executable_path() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) fail_at(__FILE__, __LINE__, "cannot read /proc/self/exe");
  buf[n] = 0;
  return buf;
}

std::string executable_directory() { return parent_directory(executable_path()); }

void report_node(Store& store, const std::string& run_id, const LaunchOptions& options, const std::string& status, int restarts, const std::string& error) {
  NodeReport n;
  n.node_rank = options.node_rank;
  n.host = read_host_facts().hostname;
  n.pid = ::getpid();
  n.status = status;
  n.restarts = restarts;
  n.error = error;
  store.report_node(run_id, n);
}

bool process_alive(int64_t pid) {
  if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) return false;
  return process_state(pid) != 'Z';
}

std::string launcher_gone(const RunRecord& run, const std::string& this_host, double now) {
  if (run.status != RunStatus::Running) return "";
  if (run.pid > 0 && !run.host.empty() && run.host == this_host && !process_alive(run.pid))
    return "its launcher, process " + std::to_string(run.pid) + " on this host, has exited";
  // Runs recorded before schema v5 have no heartbeat of their own until their first metrics.
  const double last_sign = run.heartbeat_at > 0 ? run.heartbeat_at : run.started_at > 0 ? run.started_at : run.created_at;
  if (now - last_sign > kLauncherSilentSeconds)
    return "no heartbeat from its launcher" + (run.host.empty() ? std::string() : " on " + run.host) + " for " + format_seconds(now - last_sign);
  return "";
}

std::string last_step_text(const Store& store, const std::string& run_id) {
  const auto metrics = store.latest_metrics(run_id);
  return metrics.count("loss") ? " at step " + std::to_string(metrics.at("loss").step) : " before its first step";
}

void mark_lost_runs(Store& store) {
  RunQuery q;
  q.status = "running";
  q.limit = 1 << 20;
  const std::string this_host = read_host_facts().hostname;
  for (const RunRecord& r : store.query_runs(q)) {
    if (!r.job_id.empty()) continue;  // Slurm's runs: refresh_slurm_runs asks Slurm
    const std::string gone = launcher_gone(r, this_host, unix_now());
    if (gone.empty()) continue;
    const std::string why = gone + "; last known" + last_step_text(store, r.id);  // (show prints "lost: " + why)
    if (!store.set_status_if(r.id, RunStatus::Running, RunStatus::Lost, why)) continue;
    store.add_event(r.id, "lost", -1, why);
    alert_lost_run(store, r, gone);
  }
}

void exec_rank_process(const std::string& config_path) {
  const std::string rank_binary = path_join(executable_directory(), "dsrun-rank");
  execl(rank_binary.c_str(), rank_binary.c_str(), config_path.c_str(), static_cast<char*>(nullptr));
  fail_at(__FILE__, __LINE__, "cannot start " + rank_binary + ": " + std::strerror(errno));
}

// The journals a run's launchers left beside it (the store was away when they ended), replayed
// into the store in node order; nothing while a launcher of the run is alive (it replays its own).
// Returns how many journals were replayed.
int replay_run_journals(Store& store, const RunRecord& r, const std::string& run_dir) {
  if (r.status == RunStatus::Running && launcher_gone(r, read_host_facts().hostname, unix_now()).empty()) return 0;
  if (!is_directory(run_dir)) return 0;
  int replayed = 0;
  for (const std::string& f : list_directory(run_dir)) {
    if (!starts_with(f, "store_journal-node") || !ends_with(f, ".jsonl")) continue;
    const std::string path = path_join(run_dir, f);
    if (is_directory(path) || file_size(path) == 0) continue;
    store.journal_writes_to(path, 10);
    if (!store.replay_journal(/*now=*/true)) {
      ErrorContext c;
      c.file = path;
      c.hint = "the run store must answer to take the run's journaled writes; try again when it does";
      throw Error("the run store did not take run " + r.id + "'s journal", c);
    }
    ++replayed;
  }
  return replayed;
}

// Every run whose directory holds a journal its launcher left (not while that launcher lives).
void replay_stranded_journals(Store& store, const std::string& db_path) {
  const std::string root = runs_directory(db_path);
  if (!is_directory(root)) return;
  for (const std::string& id : list_directory(root)) {
    const std::string dir = path_join(root, id);
    if (!file_exists(path_join(dir, "store_journal-node0.jsonl"))) continue;  // (node 0's: the launcher that owns the run)
    std::optional<RunRecord> r;
    try {
      r = store.get_run(id);
    } catch (const Error&) {
      continue;  // a directory of another store's run, or not a run's
    }
    replay_run_journals(store, *r, dir);
  }
}

}  // namespace dsrun
