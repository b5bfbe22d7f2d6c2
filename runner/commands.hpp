// The CLI's commands, one function each, called by main after CLI11 has parsed the arguments.
// Each returns the process exit code (docs/cli.md lists them); errors travel up as dsrun::Error.
#pragma once

#include "engine/common/host.hpp"
#include "engine/recipe/load.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

enum ExitCode { kExitOk = 0, kExitError = 1, kExitDoesNotFit = 2, kExitHardwareMissing = 3 };

struct RecipeArgs {
  std::string path;
  std::vector<std::string> sets;  // --set section.key=value
};

// How `dsrun run` launches (torchrun's spellings for the multi-node flags).
struct RunFlags {
  bool smoke = false;          // shrink the model to run the plan's layout on CPU ranks in seconds
  int nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool nccl_debug = false;
  int debug_rank = -1;
  bool slurm = false;          // submit as a Slurm batch job instead of starting ranks here
  std::string run_id;          // join this recorded run (another node created it); "" : node 0 creates, others find it
};

enum { kExitInterrupted = 130 };

std::string default_store_path();  // $DSRUN_DB, else runs/dsrun.db under the current directory
// Loads and validates; prints every diagnostic (warnings too) to stderr. Throws when invalid.
LoadedRecipe load_or_report(const RecipeArgs& args, const HostFacts& host);

// layouts: the table of every layout the hardware allows instead (render_layouts).
int command_plan(const RecipeArgs& args, bool json, bool layouts = false, bool smoke = false);
int command_run(const RecipeArgs& args, const RunFlags& flags, const std::string& db_path);
// One rank under an outside launcher (torchrun, Slurm's srun, Kubernetes). With a store to record
// into ($DSRUN_DB or --db given, or $DSRUN_RUN_ID), the worker supervises its rank and reports:
// rank 0 creates (or joins) the run, each node's local rank 0 its node's row. Without, it becomes
// the rank.
int command_worker(const std::string& config_path, const std::string& db_path, bool db_given);
// `dsrun cancel RUN`: scancel of its Slurm job, or SIGTERM to its launcher on this host.
int command_cancel(const std::string& run, const std::string& db_path);
// The key that every node of one job shares to find the run node 0 records: $DSRUN_JOB_KEY, Slurm's
// job id, torchrun's rendezvous id, else the rendezvous address.
std::string job_key(const std::string& master_addr, int master_port);
// `dsrun resume RUN`: the run goes on from its newest complete checkpoint (--fallback: the newest
// that verifies), with optional --set overrides (another world size or ZeRO stage re-cuts shards).
struct ResumeArgs {
  std::string run;
  std::vector<std::string> sets;
  bool fallback = false;
  bool force = false;  // a run still marked running whose launcher is gone, or data changed since the checkpoint
};
int command_resume(const ResumeArgs& args, const RunFlags& flags, const std::string& db_path);
// `dsrun rollback RUN --to-step N`: a new run (child of RUN) from RUN's checkpoint at or before N.
// force: start even if the data changed since the checkpoint (recorded).
// A checkpoint that fails verification is refused, as resume does, unless `fallback` (then the newest good one before it).
int command_rollback(const std::string& run, int64_t to_step, const std::vector<std::string>& sets, bool force, bool fallback, const RunFlags& flags, const std::string& db_path);
// `dsrun export RUN --to DIR`: consolidated safetensors + config.json from a checkpoint (-1: newest).
int command_export(const std::string& run, int64_t step, const std::string& to, const std::string& dtype, const std::string& db_path);
int command_show(const std::string& db_path, const std::string& run, bool json);
// `dsrun store replay RUN`: replay_run_journals (runner/launcher.hpp) for one run.
int command_store_replay(const std::string& run, const std::string& db_path);
// `dsrun init NAME`: a recipe from a template; with --from-hf, its model section from a Hugging
// Face config.json (every key honoured or refused by name) and init_from its safetensors.
struct InitArgs {
  std::string name;
  std::string template_name;  // empty: quickstart, or gpu-decoder with from_hf
  std::string from_hf;        // a checkpoint directory or its config.json
  bool force = false;
};
int command_init(const InitArgs& args);
int command_templates();
int command_docs(const std::string& topic);

}  // namespace dsrun
