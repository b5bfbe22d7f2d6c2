// Runs a recorded plan as real processes: one dsrun-rank per rank with the torchrun environment,
// watched until all finish, one fails, one hangs, or the user presses Ctrl-C. The launcher alone
// writes the store; ranks report over pipes.
#pragma once

#include "engine/plan/plan.hpp"
#include "engine/recipe/load.hpp"
#include "storage/store.hpp"

#include <functional>
#include <string>

namespace dsrun {

struct LaunchOptions {
  std::string run_dir;            // runs/<id>: resolved config, plan, logs/
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;            // 0: pick a free port
  bool nccl_debug = false;        // NCCL_DEBUG=INFO into the rank logs
  int debug_rank = -1;            // this rank waits for a debugger
  bool progress = true;           // the live progress line
  std::string resume_from;        // a checkpoint directory the ranks start from ("": step 0)
  std::string checkpoint_root;    // "": checkpoint_root_of(recipe, run_dir, run_id)
  bool accept_data_change = false;  // dsrun resume --force: the ranks train on data changed since the checkpoint
  // dsrun resume --set: the overrides become the run's recorded config only once training has
  // started from them (its first step), so that a resume refused by the ranks leaves the run as
  // it was. The ranks read config.resume.toml until then; at the first step it replaces
  // config.toml (and plan.resume.json plan.json) and on_started records the plan in the store.
  bool config_pending = false;
  bool run_claimed = false;  // the caller already made the run `running` (Store::claim_run)
  std::function<void()> on_started;
  // Several nodes record one run: the launcher that owns it (node 0, or rank 0's worker) sets its
  // status and heartbeat; every node's reporter (its launcher, or its local rank 0's worker)
  // keeps its own row in run_nodes.
  bool owns_run = true;
  bool reports_node = false;
  // Under an outside launcher (dsrun worker): supervise only this rank, which the outside launcher
  // placed (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE); the outside launcher restarts, not this one.
  int single_rank = -1;
  int local_rank = 0, local_world = 1;
};

// Where a run's step_N/ checkpoint directories go: RUN_DIR/checkpoints, or checkpoint.dir/RUN_ID
// when the recipe names a directory (so runs sharing it never mix their checkpoints).
std::string checkpoint_root_of(const Recipe& recipe, const std::string& run_dir, const std::string& run_id);

// A file of the run directory as node `node_rank` writes it: node 0 (and a one-node run) under
// its own name, node k as NAME-nodeK.EXT, so that nodes sharing one run directory (a shared file
// system, or one host) never read each other's config: each runs what it was started with, and the
// rendezvous compares them (config.resume.toml -> config-node1.resume.toml).
std::string node_file_name(const std::string& name, int node_rank);

// The resolved config that ranks load: the recipe's config with every "auto" replaced by the
// plan's choice and every relative path made absolute, so all ranks run exactly the plan.
std::string rank_config_toml(const LoadedRecipe& loaded, const Plan& plan);

// Returns the run's final status (Finished, Failed or Killed), recorded in the store. A rank that
// dies or hangs restarts all ranks from the newest checkpoint, up to run.max_restarts times.
RunStatus launch_run(const LoadedRecipe& loaded, const Plan& plan, Store& store, const std::string& run_id, const LaunchOptions& options);

// Where a rank sits, in torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT), which dsrun-rank reads: set in a child before it execs the rank.
struct RankPlace {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
};
void set_rank_environment(const RankPlace& place);

// A port for the rendezvous store that is free now. Chosen at random below the kernel's ephemeral
// range (32768+), so that outgoing connections made meanwhile cannot take it before rank 0 binds it.
int free_port();
// The last `lines` lines of a file ("" when it does not exist).
// (from_byte: only what follows it, e.g. this attempt's part of a log earlier attempts wrote to.)
std::string tail_of_file(const std::string& path, int lines, int64_t from_byte = 0);

// `path` from the working directory ("" and absolute paths as they are).
std::string absolute(const std::string& path);
// The running dsrun binary, and its directory (dsrun-rank sits beside it).
std::string executable_path();
std::string executable_directory();

// One node's row in the store as it goes: status starting, running, finished, failed, killed.
void report_node(Store& store, const std::string& run_id, const LaunchOptions& options, const std::string& status, int restarts,
                 const std::string& error = "");

// A process that exists and is not a zombie (a killed launcher may linger unreaped as one).
bool process_alive(int64_t pid);

// A launcher that heartbeats every 10 s and has been silent this long is taken for dead.
constexpr double kLauncherSilentSeconds = 600;

// Why a run marked running has no live launcher, or "" when it may still be running: on the
// launcher's own host its process has exited; on any host, no heartbeat for
// kLauncherSilentSeconds (a killed -9 launcher or a rebooted machine never marks its run ended).
std::string launcher_gone(const RunRecord& run, const std::string& this_host, double now);

// Readers (history, show, watch) keep the record true: a run marked running without a Slurm job
// whose launcher is gone (launcher_gone) is marked lost at its last step, naming why. Its launcher,
// if it was only silent (a store that was away), takes it back at its next heartbeat.
void mark_lost_runs(Store& store);

// The journals a run's launchers left beside it in run_dir (the store was away when they ended),
// replayed into the store in node order; nothing while a launcher of the run is alive (it replays
// its own). Returns how many were replayed. resume, show, history and `dsrun store replay` call it.
int replay_run_journals(Store& store, const RunRecord& r, const std::string& run_dir);
// replay_run_journals for every run directory under the store's runs directory.
void replay_stranded_journals(Store& store, const std::string& db_path);
// " at step N" (the run's last recorded loss), or " before its first step": where a lost run stopped.
std::string last_step_text(const Store& store, const std::string& run_id);

// `dsrun worker CONFIG`: become a rank under an outside launcher (torchrun, Slurm, Kubernetes).
[[noreturn]] void exec_rank_process(const std::string& config_path);

}  // namespace dsrun
