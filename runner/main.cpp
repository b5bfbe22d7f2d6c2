// dsrun's entry point: the CLI11 command tree. `dsrun RECIPE` is short for `dsrun run RECIPE`.
#include "engine/common/error.hpp"
#include "runner/commands.hpp"
#include "runner/sweep.hpp"

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

const char* const kCommands[] = {"run", "plan", "history", "show", "resume", "rollback", "export", "sweep", "init", "templates", "docs", "worker"};

// `dsrun recipes/x.toml ...` means `dsrun run recipes/x.toml ...`.
std::vector<std::string> with_default_command(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  size_t first = 0;
  while (first < args.size() && args[first].size() > 1 && args[first][0] == '-') {
    if (args[first] == "--db") ++first;  // the only global option that takes a value
    ++first;
  }
  if (first < args.size()) {
    bool is_command = false;
    for (const char* c : kCommands) is_command |= args[first] == c;
    if (!is_command && args[first] != "--help" && args[first] != "-h") args.insert(args.begin() + static_cast<long>(first), "run");
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  // Messages go to stderr, so `dsrun plan --json > plan.json` never mixes them into the output.
  spdlog::set_default_logger(spdlog::stderr_color_st("dsrun"));
  spdlog::set_pattern("dsrun: %^%l%$: %v");
  CLI::App app{"dsrun: declarative experiment runner for distributed training"};
  app.require_subcommand(1);
  app.fallthrough();  // global options such as --db work after the command too
  std::string db = dsrun::default_store_path();
  app.add_option("--db", db, "Run store (SQLite file); default $DSRUN_DB or runs/dsrun.db");

  dsrun::RecipeArgs recipe_args;
  auto add_recipe_args = [&](CLI::App* cmd) {
    cmd->add_option("recipe", recipe_args.path, "Recipe TOML file")->required();
    cmd->add_option("--set", recipe_args.sets, "Override a key: --set section.key=value (repeatable)");
  };
  CLI::App* run = app.add_subcommand("run", "Plan, record and run a recipe (also: dsrun RECIPE)");
  add_recipe_args(run);
  dsrun::RunFlags flags;
  run->add_flag("--smoke", flags.smoke, "Run the plan's layout with a shrunk model on CPU ranks, in seconds");
  // Launch flags, shared by every command that starts ranks.
  auto add_launch_flags = [&](CLI::App* cmd) {
    cmd->add_option("--nnodes", flags.nnodes, "Nodes in the job (as torchrun)")->check(CLI::Range(1, 100000));
    cmd->add_option("--node-rank", flags.node_rank, "This node's index (as torchrun)")->check(CLI::Range(0, 100000));
    cmd->add_option("--master-addr", flags.master_addr, "Address of node 0 (as torchrun)");
    cmd->add_option("--master-port", flags.master_port, "Port of the rendezvous store; default: a free one")->check(CLI::Range(0, 65535));
    cmd->add_flag("--nccl-debug", flags.nccl_debug, "NCCL_DEBUG=INFO (and TORCH_DISTRIBUTED_DEBUG=DETAIL) into the rank logs");
    cmd->add_option("--debug-rank", flags.debug_rank, "This rank prints its pid and waits for a debugger")->check(CLI::Range(0, 1000000));
  };
  add_launch_flags(run);
  bool json = false;
  CLI::App* plan = app.add_subcommand("plan", "Print the resolved plan; exit 2 if it does not fit");
  add_recipe_args(plan);
  plan->add_flag("--json", json, "JSON instead of the table");

  int limit = 50;
  std::string status, sweep_filter;
  bool csv = false;
  CLI::App* history = app.add_subcommand("history", "List runs, newest first");
  history->add_option("--limit", limit, "Most runs to list")->check(CLI::Range(1, 100000000));
  history->add_option("--status", status, "Only runs with this status");
  history->add_option("--sweep", sweep_filter, "Only the trials of this sweep (id, prefix or name)");
  history->add_flag("--json", json, "JSON instead of the table");
  history->add_flag("--csv", csv, "CSV instead of the table");

  dsrun::SweepArgs sweep_args;
  CLI::App* sweep = app.add_subcommand("sweep", "Run a recipe's [sweep]: trials, search, pruning; --resume, --show");
  sweep->add_option("recipe", sweep_args.file, "Recipe with a [sweep] section");
  sweep->add_option("--set", sweep_args.sets, "Override a key for every trial (the trial's own values win)");
  sweep->add_option("--resume", sweep_args.resume, "Continue a stopped or crashed sweep: run only what is missing or failed");
  sweep->add_option("--show", sweep_args.show, "Print a sweep's leaderboard");
  sweep->add_flag("--json", sweep_args.json, "With --show: JSON");
  sweep->add_flag("--csv", sweep_args.csv, "With --show: CSV");

  std::string run_id;
  CLI::App* show = app.add_subcommand("show", "Show one run whole: recipe, config, plan, metrics, events");
  show->add_option("run", run_id, "Run id, id prefix or run name")->required();
  show->add_flag("--json", json, "JSON instead of text");

  dsrun::ResumeArgs resume_args;
  CLI::App* resume = app.add_subcommand("resume", "Continue a failed or killed run from its newest complete checkpoint");
  resume->add_option("run", resume_args.run, "Run id, id prefix or run name")->required();
  resume->add_option("--set", resume_args.sets, "Override a key, e.g. another world size or ZeRO stage (shards are re-cut)");
  resume->add_flag("--fallback", resume_args.fallback, "Skip checkpoints that fail verification and use the newest good one");
  resume->add_flag("--force", resume_args.force, "Resume a run still marked running whose launcher is gone");
  add_launch_flags(resume);

  std::string rollback_run;
  int64_t to_step = 0;
  std::vector<std::string> rollback_sets;
  CLI::App* rollback = app.add_subcommand("rollback", "Start a new run from a run's checkpoint at or before a step (the original is untouched)");
  rollback->add_option("run", rollback_run, "Run id, id prefix or run name")->required();
  rollback->add_option("--to-step", to_step, "Use the newest checkpoint at or before this step")->required()->check(CLI::Range(int64_t{0}, int64_t{1} << 50));
  rollback->add_option("--set", rollback_sets, "Override a key of the checkpoint's config (repeatable)");
  add_launch_flags(rollback);

  std::string export_run, export_to, export_dtype = "fp32";
  int64_t export_step = -1;
  CLI::App* exporter = app.add_subcommand("export", "Write a checkpoint's weights as safetensors + config.json (Hugging Face names)");
  exporter->add_option("run", export_run, "Run id, id prefix or run name")->required();
  exporter->add_option("--step", export_step, "Newest checkpoint at or before this step; default: the newest");
  exporter->add_option("--to", export_to, "Output directory")->required();
  exporter->add_option("--dtype", export_dtype, "fp32 (exact) or bf16")->check(CLI::IsMember({"fp32", "bf16"}));

  std::string name, template_name = "quickstart";
  bool force = false;
  CLI::App* init = app.add_subcommand("init", "Write a new recipe from a template");
  init->add_option("name", name, "New recipe file (.toml added if missing)")->required();
  init->add_option("--template,-t", template_name, "Recipe template (see dsrun templates)");
  init->add_flag("--force", force, "Overwrite an existing file");

  CLI::App* templates = app.add_subcommand("templates", "List recipe, hardware and model templates");
  std::string worker_config;
  CLI::App* worker = app.add_subcommand("worker", "Be one rank under torchrun, Slurm or Kubernetes (reads RANK, WORLD_SIZE, MASTER_ADDR, ...)");
  worker->add_option("config", worker_config, "Recipe or resolved config")->required();
  std::string topic;
  CLI::App* docs = app.add_subcommand("docs", "Print a generated reference page (recipe)");
  docs->add_option("topic", topic, "recipe")->required();

  std::vector<std::string> args = with_default_command(argc, argv);
  std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? dsrun::kExitOk : dsrun::kExitError;  // --help is success; any usage error is 1
  }

  try {
    if (*run) return dsrun::command_run(recipe_args, flags, db);
    if (*worker) dsrun::command_worker(worker_config);
    if (*plan) return dsrun::command_plan(recipe_args, json);
    if (*history) return dsrun::command_history(db, limit, status, sweep_filter, json, csv);
    if (*sweep) return dsrun::command_sweep(sweep_args, db);
    if (*show) return dsrun::command_show(db, run_id, json);
    if (*resume) return dsrun::command_resume(resume_args, flags, db);
    if (*rollback) return dsrun::command_rollback(rollback_run, to_step, rollback_sets, flags, db);
    if (*exporter) return dsrun::command_export(export_run, export_step, export_to, export_dtype, db);
    if (*init) return dsrun::command_init(name, template_name, force);
    if (*templates) return dsrun::command_templates();
    if (*docs) return dsrun::command_docs(topic);
  } catch (const dsrun::Error& e) {
    spdlog::error("{}", e.describe());
    return dsrun::kExitError;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return dsrun::kExitError;
  }
  return dsrun::kExitError;
}
