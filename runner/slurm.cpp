#include "runner/slurm.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "runner/alerts.hpp"
#include "runner/launcher.hpp"
#include "storage/database.hpp"

#include <sys/stat.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

namespace dsrun {

namespace {

struct ProgramOutput {
  int code = -1;  // exit status; 127: not found
  std::string out, err;
};

// Runs a program (no shell: arguments are never re-read as shell text) and collects its output.
ProgramOutput run_program(const std::vector<std::string>& argv) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) fail_at(__FILE__, __LINE__, std::string("pipe: ") + std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) fail_at(__FILE__, __LINE__, std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "%s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  ProgramOutput result;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open = 2;
  while (open > 0) {
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      }
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':'))
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  return false;
}

std::string minutes_text(int64_t minutes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:00", static_cast<long long>(minutes / 60), static_cast<long long>(minutes % 60));
  return buf;
}

}  // namespace

bool is_slurm_job_id(const std::string& id) {
  if (id.empty() || !std::isdigit(static_cast<unsigned char>(id[0]))) return false;
  return id.find_first_not_of("0123456789_") == std::string::npos;
}

SlurmJobSpec slurm_job_from_plan(const Recipe& r, const Plan& plan, const std::string& name, const std::string& db_path, const std::string& job_dir) {
  SlurmJobSpec job;
  job.name = name;
  job.nodes = plan.nodes;
  job.tasks_per_node = plan.ranks_per_node;
  job.gpus_per_node = r.hardware.device == Device::Cuda ? plan.ranks_per_node : 0;
  job.time_limit_minutes = r.run.time_limit_minutes;
  job.options = r.slurm;
  // Every node reaches the store the same way: a server URL, or a SQLite file on the shared file system.
  if (location_has_password(db_path)) {
    make_directories(job_dir);
    if (::chmod(job_dir.c_str(), 0700) != 0) fail_at(__FILE__, __LINE__, "chmod 0700 " + job_dir + ": " + std::strerror(errno));
    const std::string file = path_join(job_dir, "store_location");
    write_file_atomic(file, db_path + "\n", 0600);
    job.env.push_back({"DSRUN_DB_FILE", file});
  } else {
    job.env.push_back({"DSRUN_DB", is_postgres_location(db_path) ? db_path : absolute(db_path)});
  }
  job.env.push_back({"DSRUN_RUNS_DIR", absolute(runs_directory(db_path))});
  return job;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string sbatch_script(const SlurmJobSpec& job) {
  std::string s = "#!/bin/bash\n# Written by dsrun from the run's plan; `sbatch` reads the #SBATCH lines.\n";
  auto directive = [&](const std::string& option) {
    // "--name=value": sbatch reads a #SBATCH line's words as a shell would its quotes; the recipe
    // refuses control characters, and this refuses any that come some other way.
    for (unsigned char ch : option)
      if (ch < 0x20 || ch == 0x7f) throw Error("a job script's #SBATCH line would contain a control character: " + option);
    const size_t eq = option.find('=');
    const bool spaced = option.find_first_of(" \t\"\\'") != std::string::npos;
    if (!spaced || eq == std::string::npos) {
      s += "#SBATCH " + option + "\n";
      return;
    }
    std::string quoted = "\"";
    for (char ch : option.substr(eq + 1)) quoted += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
    s += "#SBATCH " + option.substr(0, eq + 1) + quoted + "\"\n";
  };
  directive("--job-name=" + job.name);
  directive("--nodes=" + std::to_string(job.nodes));
  directive("--ntasks-per-node=" + std::to_string(job.tasks_per_node));
  if (job.gpus_per_node > 0) directive("--gpus-per-node=" + std::to_string(job.gpus_per_node));
  if (job.cpus_per_task > 0) directive("--cpus-per-task=" + std::to_string(job.cpus_per_task));
  if (job.time_limit_minutes > 0) directive("--time=" + minutes_text(job.time_limit_minutes));
  if (!job.options.partition.empty()) directive("--partition=" + job.options.partition);
  if (!job.options.account.empty()) directive("--account=" + job.options.account);
  if (!job.options.qos.empty()) directive("--qos=" + job.options.qos);
  if (!job.options.constraint.empty()) directive("--constraint=" + job.options.constraint);
  if (!job.array.empty()) directive("--array=" + job.array);
  directive(job.requeue ? "--requeue" : "--no-requeue");
  directive("--output=" + job.output);
  directive("--open-mode=append");  // a requeued job's log continues instead of starting over
  for (const auto& extra : job.options.sbatch) directive(extra);
  s += "\nset -euo pipefail\n";
  for (const auto& [name, value] : job.env) s += "export " + name + "=" + shell_quote(value) + "\n";
  s += "# The rendezvous: the job's first node, a port the job id picks (every task computes the same).\n";
  s += "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n";
  s += "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))\n";
  s += "echo \"dsrun: job $SLURM_JOB_ID${SLURM_ARRAY_TASK_ID:+ task $SLURM_ARRAY_TASK_ID} on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}\"\n";
  s += "srun --kill-on-bad-exit=1 " + job.task_command + "\n";
  return s;
}

std::string slurm_missing() {
  std::vector<std::string> missing;
  for (const char* p : {"sbatch", "squeue", "scancel", "scontrol"})
    if (!on_path(p)) missing.push_back(p);
  return join(missing, ", ");
}

std::string submit_job(const std::string& script_path) {
  if (!on_path("sbatch")) {
    ErrorContext c;
    c.key = "--slurm";
    c.hint = "run on a Slurm login node (Slurm's client: the slurm-client package), or without --slurm";
    throw Error("no sbatch on PATH", c);
  }
  ProgramOutput r = run_program({"sbatch", "--parsable", script_path});
  if (r.code != 0) {
    ErrorContext c;
    c.file = script_path;
    c.hint = "Slurm refused the job: check [slurm] (partition, account, qos, constraint) and run.time_limit in the recipe";
    std::string why = trim(r.err.empty() ? r.out : r.err);
    throw Error("sbatch failed (exit " + std::to_string(r.code) + "): " + why, c);
  }
  // --parsable prints "ID" or "ID;CLUSTER".
  std::string id = trim(r.out);
  id = id.substr(0, id.find(';'));
  if (!is_slurm_job_id(id)) fail_at(__FILE__, __LINE__, "sbatch printed no job id: " + r.out);
  return id;
}

void cancel_job(const std::string& job_id) {
  ProgramOutput r = run_program({"scancel", job_id});
  if (r.code != 0) {
    ErrorContext c;
    c.key = job_id;
    c.hint = "is the job still in `squeue`? scancel may only cancel your own jobs";
    throw Error("scancel failed: " + trim(r.err.empty() ? r.out : r.err), c);
  }
}

std::map<std::string, SlurmJobState> query_jobs(const std::vector<std::string>& job_ids) {
  std::map<std::string, SlurmJobState> out;
  std::vector<std::string> ids;
  for (const auto& id : job_ids)
    if (is_slurm_job_id(id)) ids.push_back(id);
  if (ids.empty() || !on_path("squeue")) return out;
  // -t all: finished jobs too (while Slurm remembers them); -r: one line per array task. Ids Slurm
  // does not know are left out of a list's answer, but make a single id an error: asked one by one.
  auto ask = [&](const std::string& list) {
    ProgramOutput r = run_program({"squeue", "-h", "-r", "-t", "all", "-j", list, "-o", "%i|%T|%N|%r"});
    if (r.code != 0) return;
    std::stringstream lines(r.out);
    std::string line;
    while (std::getline(lines, line)) {
      const auto f = split(line, '|');
      if (f.size() < 4) continue;
      const std::string reason = trim(f[3]);
      out[trim(f[0])] = {trim(f[1]), trim(f[2]), reason == "None" ? "" : reason};  // squeue says "None" for no reason
    }
  };
  if (ids.size() == 1) ask(ids[0]);
  else ask(join(ids, ","));
  return out;
}

// Slurm's job states that end a job (squeue's long names); UNKNOWN is dsrun's own, for a job gone
// from Slurm's memory.
static const std::vector<std::string>& final_slurm_states() {
  static const std::vector<std::string> states = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
                                                  "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED", "UNKNOWN"};
  return states;
}

bool slurm_state_is_final(const std::string& state) {
  const auto& f = final_slurm_states();
  return std::find(f.begin(), f.end(), state) != f.end();
}

void refresh_slurm_runs(Store& store) {
  std::vector<RunRecord> open;
  for (auto& r : store.runs_with_open_jobs(final_slurm_states()))
    if (is_slurm_job_id(r.job_id)) open.push_back(r);
  if (open.empty() || !slurm_missing().empty()) return;
  std::vector<std::string> ids;
  for (const auto& r : open) ids.push_back(r.job_id);
  const auto states = query_jobs(ids);
  for (const auto& r : open) {
    // Read again: the run may have reported its own ending since the list was made.
    const RunRecord now = store.get_run(r.id);
    const bool reported = now.status != RunStatus::Planned && now.status != RunStatus::Running;
    auto it = states.find(r.job_id);
    if (it == states.end()) {
      store.set_job(r.id, "", "UNKNOWN", "", "gone from the queue");
      if (reported) continue;
      const std::string why = "Slurm job " + r.job_id + " is gone from Slurm's queue with no final report from the run (last known" + last_step_text(store, r.id) + ")";
      store.add_event(r.id, "lost", -1, why);
      store.set_status(r.id, RunStatus::Lost, why);
      alert_lost_run(store, r, why);
      continue;
    }
    const SlurmJobState& job = it->second;
    store.set_job(r.id, "", job.state, job.nodes, job.reason);
    if (!slurm_state_is_final(job.state)) continue;
    const std::string verdict = "Slurm ended job " + r.job_id + ": " + job.state + (job.reason.empty() ? "" : " (" + job.reason + ")");
    if (reported) {
      // The run said how it ended; when Slurm ended the job itself (a time limit, memory, a
      // node), its reason becomes an event of the run, once.
      if (job.state != "COMPLETED" && job.state != "CANCELLED" && job.state != r.job_state) store.add_event(r.id, "job", -1, verdict);
      continue;
    }
    // Slurm ended the job but the run never said how it ended: Slurm's verdict stands.
    const std::string why = verdict + last_step_text(store, r.id);
    store.add_event(r.id, job.state == "CANCELLED" ? "killed" : "failed", -1, why);
    store.set_status(r.id, job.state == "CANCELLED" ? RunStatus::Killed : RunStatus::Failed,
                     job.state == "COMPLETED" ? why + ", but the run never reported finishing" : why);
  }
}

}  // namespace dsrun
