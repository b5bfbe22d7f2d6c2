// Batch jobs on Slurm: the job script written from a plan, sbatch/squeue/scancel run as real
// processes, and the store kept in step with what Slurm says of each run's job.
#pragma once

#include "engine/plan/plan.hpp"
#include "engine/recipe/recipe.hpp"
#include "storage/store.hpp"

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

// One batch job: the plan's shape (nodes, tasks and GPUs per node), the recipe's [slurm] options,
// and what every task runs.
struct SlurmJobSpec {
  std::string name;
  int nodes = 1, tasks_per_node = 1, gpus_per_node = 0;
  int cpus_per_task = 0;           // 0: Slurm's default (one)
  int64_t time_limit_minutes = 0;  // 0: the partition's default
  SlurmOptions options;
  std::string output;              // the job's log (%j: job id, %a: array task)
  std::string array;               // "0-5%2": a job array (a sweep), "" for one job
  bool requeue = true;             // preemption and node failure start it again (dsrun resumes it)
  std::vector<std::pair<std::string, std::string>> env;  // exported before the tasks start
  std::string task_command;        // each task's command line, already quoted
};

// The sbatch script: #SBATCH lines (a value with spaces in double quotes, as sbatch reads them; a
// control character is refused: it would end the line and start shell), the rendezvous (the job's
// first node, a port from the job id), then `srun` of the task command.
std::string sbatch_script(const SlurmJobSpec& job);
// A job of the plan's shape (nodes, tasks and GPUs per node), the recipe's time limit and [slurm]
// options, and the store every task reports into (DSRUN_DB, DSRUN_RUNS_DIR). A store location with
// a password never goes into the script (Slurm keeps a copy of it): it is written to
// `job_dir`/store_location (0600, the directory made 0700) and the script names that file
// (DSRUN_DB_FILE). Better still, keep the password out of the URL: libpq's ~/.pgpass or a service file.
SlurmJobSpec slurm_job_from_plan(const Recipe& recipe, const Plan& plan, const std::string& name, const std::string& db_path, const std::string& job_dir);
// Slurm's job ids are numbers ("123"), array tasks "123_4"; anything else (a rendezvous key) is not Slurm's.
bool is_slurm_job_id(const std::string& id);
std::string shell_quote(const std::string& s);

// "" when sbatch, squeue and scancel are on PATH; otherwise what is missing.
std::string slurm_missing();
// Submits the script; returns the job id. A rejection throws with Slurm's own message.
std::string submit_job(const std::string& script_path);
void cancel_job(const std::string& job_id);

struct SlurmJobState {
  std::string state;   // PENDING, RUNNING, COMPLETED, CANCELLED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...
  std::string nodes;   // the node list
  std::string reason;  // Slurm's reason (Resources, TimeLimit, ...); "" for none
};
// What Slurm says of each job now (finished ones while it remembers them); a job id missing from
// the answer is unknown to Slurm (never submitted, or aged out of its memory).
std::map<std::string, SlurmJobState> query_jobs(const std::vector<std::string>& job_ids);
bool slurm_state_is_final(const std::string& state);

// Runs recorded with a Slurm job and still planned or running: their job's state, nodes and
// reason recorded; a job Slurm ended without the run's own final report (killed outright at a
// time limit, out of memory, a node failure) gives the run Slurm's verdict; a job Slurm no longer
// knows marks the run lost at its last step. Quiet when Slurm's commands are absent.
void refresh_slurm_runs(Store& store);

}  // namespace dsrun
