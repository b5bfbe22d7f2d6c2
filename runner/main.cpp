// dsrun's entry point: the CLI11 command tree. `dsrun RECIPE` is short for `dsrun run RECIPE`.
#include "engine/common/error.hpp"
#include "runner/commands.hpp"
#include "engine/data/prepare.hpp"
#include "runner/data_commands.hpp"
#include "runner/history.hpp"
#include "runner/ui.hpp"
#include "runner/probe.hpp"
#include "runner/report.hpp"
#include "runner/sweep.hpp"
#include "storage/database.hpp"

#include <CLI/CLI.hpp>
#include <csignal>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

const char* const kCommands[] = {"run", "plan", "history", "show", "resume", "rollback", "export", "sweep", "compare", "watch", "delete", "restore", "gc", "report", "init", "templates", "docs", "worker", "tokenize", "prepare", "store", "cancel", "probe", "ui"};

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
  // Past a file-size limit (ulimit -f) a write fails with EFBIG, which the command reports, rather
  // than the process dying by SIGXFSZ mid-output.
  std::signal(SIGXFSZ, SIG_IGN);
  // Messages go to stderr, so `dsrun plan --json > plan.json` never mixes them into the output.
  spdlog::set_default_logger(spdlog::stderr_color_st("dsrun"));
  spdlog::set_pattern("dsrun: %^%l%$: %v");
  CLI::App app{"dsrun: declarative experiment runner for distributed training"};
  app.require_subcommand(1);
  app.fallthrough();  // global options such as --db work after the command too
  std::string db = dsrun::default_store_path();
  app.add_option("--db", db, "Run store: a SQLite file or postgresql://USER@HOST/DB; default $DSRUN_DB or runs/dsrun.db");

  dsrun::RecipeArgs recipe_args;
  auto add_recipe_args = [&](CLI::App* cmd) {
    cmd->add_option("recipe", recipe_args.path, "Recipe TOML file")->required();
    cmd->add_option("--set", recipe_args.sets, "Override a key: --set section.key=value (repeatable)");
  };
  CLI::App* run = app.add_subcommand("run", "Plan, record and run a recipe (also: dsrun RECIPE)");
  add_recipe_args(run);
  dsrun::RunFlags flags;
  run->add_flag("--smoke", flags.smoke, "Run the plan's layout with a shrunk model on CPU ranks, in seconds");
  run->add_flag("--slurm", flags.slurm, "Submit the run as a Slurm batch job (sbatch; [slurm] and run.time_limit in the recipe) and return");
  // Launch flags, shared by every command that starts ranks.
  auto add_launch_flags = [&](CLI::App* cmd) {
    cmd->add_option("--nnodes", flags.nnodes, "Nodes in the job (as torchrun)")->check(CLI::Range(1, 100000));
    cmd->add_option("--node-rank", flags.node_rank, "This node's index (as torchrun)")->check(CLI::Range(0, 100000));
    cmd->add_option("--master-addr", flags.master_addr, "Address of node 0 (as torchrun)");
    cmd->add_option("--master-port", flags.master_port, "Port of the rendezvous store; default: a free one")->check(CLI::Range(0, 65535));
    cmd->add_option("--run-id", flags.run_id, "Join this recorded run as one of its nodes (default: node 0 records it, the others find it)");
    cmd->add_flag("--nccl-debug", flags.nccl_debug, "NCCL_DEBUG=INFO (and TORCH_DISTRIBUTED_DEBUG=DETAIL) into the rank logs");
    cmd->add_option("--debug-rank", flags.debug_rank, "This rank prints its pid and waits for a debugger")->check(CLI::Range(0, 1000000));
  };
  add_launch_flags(run);
  bool json = false;
  CLI::App* plan = app.add_subcommand("plan", "Print the resolved plan; exit 2 if it does not fit");
  add_recipe_args(plan);
  plan->add_flag("--json", json, "JSON instead of the table");
  bool layouts = false;
  plan->add_flag("--layouts", layouts, "Every layout of the hardware (tensor, pipeline, schedule, data), planned and ranked, with why each loses");
  bool plan_smoke = false;
  plan->add_flag("--smoke", plan_smoke, "The plan `dsrun run --smoke` would run: the same layout, a shrunk model, CPU ranks on this machine");

  dsrun::ProbeArgs probe_args;
  CLI::App* probe = app.add_subcommand("probe", "Measure this machine (matrix products at the recipe's shapes, attention, host step, copies, collectives, disk) into a hardware template");
  probe->add_option("recipe", probe_args.recipe.path, "Recipe TOML file: the model's shapes, the dtype and the hardware table to start from")->required();
  probe->add_option("--set", probe_args.recipe.sets, "Override a key: --set section.key=value (repeatable)");
  probe->add_option("--name", probe_args.name, "The template's hardware.name and file name (default: the recipe's hardware name, -probed)");
  probe->add_option("--out,-o", probe_args.output, "Write the template here (default: templates/hardware/NAME.toml)");
  probe->add_flag("--print", probe_args.print, "Print the template instead of writing it");
  probe->add_flag("--quick", probe_args.quick, "Seconds, not minutes: small sizes, rough figures (CI)");
  probe->add_option("--disk", probe_args.disk, "Measure the disk under this directory (default: checkpoint.dir, else the run store's directory)");

  dsrun::HistoryArgs hist;
  CLI::App* history = app.add_subcommand("history", "List runs, newest first; filter, query, sort");
  history->add_option("--limit", hist.limit, "Most runs to list")->check(CLI::Range(1, 100000000));
  history->add_option("--status", hist.status, "Only runs with this status");
  history->add_option("--sweep", hist.sweep, "Only the trials of this sweep (id, prefix or name)");
  history->add_option("--model", hist.model, "Only runs whose model name contains this");
  history->add_option("--hardware", hist.hardware, "Only runs whose hardware name contains this");
  history->add_option("--recipe", hist.recipe, "Only runs whose recipe path contains this");
  history->add_option("--since", hist.since, "Only runs created within this long: 2 days, 3h, 30 min");
  history->add_option("--where", hist.where, "An expression: optimizer.lr > 1e-4 and metrics.val_loss < 2.5 and status = finished");
  history->add_option("--sort", hist.sort, "Sort by a column, config key or metrics.KEY (default: newest first)");
  history->add_flag("--asc", hist.ascending, "Ascending order");
  history->add_flag("--deleted", hist.deleted, "List soft-deleted runs instead");
  history->add_flag("--json", hist.json, "JSON instead of the table");
  history->add_flag("--csv", hist.csv, "CSV instead of the table");

  std::vector<std::string> run_list;
  CLI::App* del = app.add_subcommand("delete", "Soft-delete runs (hidden from history; restore brings them back; gc frees their files)");
  del->add_option("runs", run_list, "Run ids, prefixes or names")->required();
  bool delete_force = false;
  del->add_flag("--force", delete_force, "Delete a run still marked running whose launcher is gone");
  CLI::App* restore = app.add_subcommand("restore", "Restore soft-deleted runs");
  restore->add_option("runs", run_list, "Run ids, prefixes or names")->required();
  bool dry_run = false;
  CLI::App* gc = app.add_subcommand("gc", "Remove the files (run directories, checkpoints) of deleted runs; report bytes freed");
  gc->add_flag("--dry-run", dry_run, "Only report what would be freed");

  dsrun::CompareArgs cmp;
  CLI::App* compare = app.add_subcommand("compare", "Compare runs: config and plan differences, metrics, predicted vs measured");
  compare->add_option("runs", cmp.runs, "Two or more runs")->required();
  compare->add_flag("--all", cmp.all, "Every config key, not only those that differ");
  compare->add_option("--at-step", cmp.at_step, "Also each metric at this step");
  compare->add_flag("--json", cmp.json, "JSON instead of tables");

  std::vector<std::string> report_runs;
  std::string report_out = "report.html";
  CLI::App* report = app.add_subcommand("report", "Write one self-contained HTML page: charts, memory, recipes, plans, events");
  report->add_option("runs", report_runs, "Runs to put on the page (overlaid)")->required();
  report->add_option("-o,--output", report_out, "The HTML file");

  std::string watch_run;
  double watch_interval = 1.0;
  dsrun::UiOptions ui_options;
  CLI::App* ui = app.add_subcommand("ui", "Serve the store read-only on the web: runs (with --where), /api/runs, /metrics for Prometheus");
  ui->add_option("--host", ui_options.host, "Address to listen on (default 127.0.0.1; any other needs --token)");
  ui->add_option("--port", ui_options.port, "Port (default 8321; 0: any free one, printed)")->check(CLI::Range(0, 65535));
  ui->add_option("--token", ui_options.token, "A token every request must carry (Authorization: Bearer TOKEN, or ?token=)");
  ui->add_option("--token-file", ui_options.token_file, "Read the token from this file (it stays out of `ps`)");
  CLI::App* watch = app.add_subcommand("watch", "Follow a running run from the store until it ends");
  watch->add_option("run", watch_run, "Run id, prefix or name")->required();
  watch->add_option("--interval", watch_interval, "Seconds between polls")->check(CLI::Range(0.05, 3600.0));

  dsrun::SweepArgs sweep_args;
  CLI::App* sweep = app.add_subcommand("sweep", "Run a recipe's [sweep]: trials, search, pruning; --resume, --show");
  sweep->add_option("recipe", sweep_args.file, "Recipe with a [sweep] section");
  sweep->add_option("--set", sweep_args.sets, "Override a key for every trial (the trial's own values win)");
  sweep->add_option("--resume", sweep_args.resume, "Continue a stopped or crashed sweep: run only what is missing or failed");
  sweep->add_option("--show", sweep_args.show, "Print a sweep's leaderboard");
  sweep->add_flag("--json", sweep_args.json, "With --show: JSON");
  sweep->add_flag("--csv", sweep_args.csv, "With --show: CSV");
  sweep->add_flag("--slurm", sweep_args.slurm, "Submit the trials as a Slurm job array, sweep.concurrency at a time, and return");
  sweep->add_option("--slurm-task", sweep_args.slurm_task, "(inside the job array) claim and run this sweep's trials")->group("");

  std::string run_id;
  CLI::App* show = app.add_subcommand("show", "Show one run whole: recipe, config, plan, metrics, events");
  show->add_option("run", run_id, "Run id, id prefix or run name")->required();
  show->add_flag("--json", json, "JSON instead of text");

  dsrun::ResumeArgs resume_args;
  CLI::App* resume = app.add_subcommand("resume", "Continue a failed or killed run from its newest complete checkpoint");
  resume->add_option("run", resume_args.run, "Run id, id prefix or run name")->required();
  resume->add_option("--set", resume_args.sets, "Override a key, e.g. another world size or ZeRO stage (shards are re-cut)");
  resume->add_flag("--fallback", resume_args.fallback, "Skip checkpoints that fail verification and use the newest good one");
  resume->add_flag("--force", resume_args.force, "Resume a run still marked running whose launcher is gone, or whose data changed since its checkpoint");
  add_launch_flags(resume);

  std::string rollback_run;
  int64_t to_step = 0;
  std::vector<std::string> rollback_sets;
  CLI::App* rollback = app.add_subcommand("rollback", "Start a new run from a run's checkpoint at or before a step (the original is untouched)");
  rollback->add_option("run", rollback_run, "Run id, id prefix or run name")->required();
  rollback->add_option("--to-step", to_step, "Use the newest checkpoint at or before this step")->required()->check(CLI::Range(int64_t{0}, int64_t{1} << 50));
  rollback->add_option("--set", rollback_sets, "Override a key of the checkpoint's config (repeatable)");
  bool rollback_force = false;
  rollback->add_flag("--force", rollback_force, "Start even if the data changed since the checkpoint (recorded)");
  bool rollback_fallback = false;
  rollback->add_flag("--fallback", rollback_fallback, "Skip checkpoints that fail verification and use the newest good one before them (as resume --fallback)");
  add_launch_flags(rollback);

  std::string export_run, export_to, export_dtype = "fp32";
  int64_t export_step = -1;
  CLI::App* exporter = app.add_subcommand("export", "Write a checkpoint's weights as safetensors + config.json (Hugging Face names)");
  exporter->add_option("run", export_run, "Run id, id prefix or run name")->required();
  exporter->add_option("--step", export_step, "Newest checkpoint at or before this step; default: the newest");
  exporter->add_option("--to", export_to, "Output directory")->required();
  exporter->add_option("--dtype", export_dtype, "fp32 (exact) or bf16")->check(CLI::IsMember({"fp32", "bf16"}));

  dsrun::InitArgs init_args;
  CLI::App* init = app.add_subcommand("init", "Write a new recipe from a template (--from-hf: its model from a Hugging Face checkpoint)");
  init->add_option("name", init_args.name, "New recipe file (.toml added if missing)")->required();
  init->add_option("--template,-t", init_args.template_name, "Recipe template (see dsrun templates); default quickstart, or gpu-decoder with --from-hf");
  init->add_option("--from-hf", init_args.from_hf, "A Hugging Face checkpoint directory (or its config.json): the model section from its config.json, "
                                                  "model.init_from = its safetensors");
  init->add_flag("--force", init_args.force, "Overwrite an existing file");

  CLI::App* templates = app.add_subcommand("templates", "List recipe, hardware and model templates");
  std::string worker_config;
  CLI::App* worker = app.add_subcommand("worker", "Be one rank under torchrun, Slurm or Kubernetes (reads RANK, WORLD_SIZE, MASTER_ADDR, ...)");
  worker->add_option("config", worker_config, "Recipe or resolved config")->required();
  std::string cancel_run;
  CLI::App* cancel = app.add_subcommand("cancel", "Stop a run: scancel of its Slurm job, or SIGTERM to its launcher on this host");
  cancel->add_option("run", cancel_run, "Run id, id prefix or run name")->required();
  std::string copy_from, copy_to;
  CLI::App* store_cmd = app.add_subcommand("store", "Work on run stores as a whole");
  store_cmd->require_subcommand(1);
  CLI::App* store_copy = store_cmd->add_subcommand("copy", "Copy every run, metric, event, checkpoint record and sweep from SRC into DST (again: adds only what is new)");
  store_copy->add_option("src", copy_from, "A SQLite file or postgresql://USER@HOST/DB")->required();
  store_copy->add_option("dst", copy_to, "A SQLite file (created) or postgresql://USER@HOST/DB")->required();
  std::string replay_run;
  CLI::App* store_replay = store_cmd->add_subcommand("replay", "Replay into the store the journal a run's launcher left when the store was away");
  store_replay->add_option("run", replay_run, "Run id, id prefix or run name")->required();
  std::string topic;
  CLI::App* docs = app.add_subcommand("docs", "Print a generated reference page (recipe)");
  docs->add_option("topic", topic, "recipe")->required();

  dsrun::TokenizeArgs tok;
  CLI::App* tokenize = app.add_subcommand("tokenize", "Print each line of FILE as a JSON array of token ids (--decode: back to text)");
  tokenize->add_option("--tokenizer", tok.tokenizer, "tokenizer.json, tokenizer.model, or a directory holding one")->required();
  tokenize->add_option("file", tok.file, "Text file, one document per line; - for standard input");
  tokenize->add_flag("--special", tok.special, "Add the tokenizer's special tokens (BOS/EOS) around each line");
  tokenize->add_flag("--decode", tok.decode, "Read arrays of ids, one per line, and print their text");
  tokenize->add_flag("--skip-special", tok.skip_special, "With --decode: leave special tokens out of the text");
  tokenize->add_option("--threads", tok.threads, "Threads (default: every core)")->check(CLI::Range(1, 1024));
  tokenize->add_flag("--stats", tok.stats, "Print lines, tokens and MB/s to standard error");

  dsrun::PrepareOptions prep;
  CLI::App* prepare = app.add_subcommand("prepare", "Tokenize text, .jsonl, .gz and .zst files into token shards for data.kind = \"tokens\"");
  prepare->add_option("inputs", prep.inputs, "Files and directories")->required();
  prepare->add_option("--tokenizer", prep.tokenizer, "tokenizer.json, tokenizer.model, or a directory holding one")->required();
  prepare->add_option("--out,-o", prep.out, "Directory for the shards and manifest.json")->required();
  prepare->add_option("--field", prep.field, "The JSON-lines field holding the text (default: text)");
  prepare->add_flag("--line-documents", prep.line_documents, "Plain text: each line is a document (default: each file)");
  prepare->add_flag("--strict", prep.strict, "Stop at a JSON line that is not JSON or lacks the field (default: skip and count)");
  prepare->add_option("--threads", prep.threads, "Threads (default: every core)")->check(CLI::Range(1, 1024));
  int64_t shard_mb = 64;
  prepare->add_option("--shard-mb", shard_mb, "Input megabytes per shard (default 64)")->check(CLI::Range(1, 1 << 20));
  int64_t max_document_mb = 256;
  prepare->add_option("--max-document-mb", max_document_mb,
                      "The most text held whole: a JSON line, or a document with no safe cut; longer ones are skipped (default 256)")
      ->check(CLI::Range(1, 1 << 20));

  std::vector<std::string> args = with_default_command(argc, argv);
  std::reverse(args.begin(), args.end());  // CLI11 takes a reversed vector
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? dsrun::kExitOk : dsrun::kExitError;  // --help is success; any usage error is 1
  }
  if (app.get_option("--db")->count() > 0 && dsrun::location_has_password(db))
    spdlog::warn("the password in --db shows in `ps` to every user of this machine while dsrun runs: set DSRUN_DB instead, or keep the password out of the "
                 "location (libpq's ~/.pgpass or a service file)");

  try {
    if (*run) return dsrun::command_run(recipe_args, flags, db);
    if (*worker) return dsrun::command_worker(worker_config, db, app.get_option("--db")->count() > 0);
    if (*store_copy) return dsrun::command_store_copy(copy_from, copy_to);
    if (*store_replay) return dsrun::command_store_replay(replay_run, db);
    if (*cancel) return dsrun::command_cancel(cancel_run, db);
    if (*plan) return dsrun::command_plan(recipe_args, json, layouts, plan_smoke);
    if (*probe) return dsrun::command_probe(probe_args);
    if (*history) return dsrun::command_history(hist, db);
    if (*del) return dsrun::command_delete(run_list, delete_force, db);
    if (*restore) return dsrun::command_restore(run_list, db);
    if (*gc) return dsrun::command_gc(dry_run, db);
    if (*compare) return dsrun::command_compare(cmp, db);
    if (*watch) return dsrun::command_watch(watch_run, watch_interval, db);
    if (*ui) {
      ui_options.db_path = db;
      return dsrun::command_ui(ui_options);
    }
    if (*report) return dsrun::command_report(report_runs, report_out, db);
    if (*sweep) return dsrun::command_sweep(sweep_args, db);
    if (*show) return dsrun::command_show(db, run_id, json);
    if (*resume) return dsrun::command_resume(resume_args, flags, db);
    if (*rollback) return dsrun::command_rollback(rollback_run, to_step, rollback_sets, rollback_force, rollback_fallback, flags, db);
    if (*exporter) return dsrun::command_export(export_run, export_step, export_to, export_dtype, db);
    if (*init) return dsrun::command_init(init_args);
    if (*templates) return dsrun::command_templates();
    if (*docs) return dsrun::command_docs(topic);
    if (*tokenize) return dsrun::command_tokenize(tok);
    if (*prepare) {
      prep.shard_bytes = shard_mb << 20;
      prep.max_document_bytes = max_document_mb << 20;
      return dsrun::command_prepare(prep);
    }
  } catch (const dsrun::Error& e) {
    spdlog::error("{}", e.describe());
    return dsrun::kExitError;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return dsrun::kExitError;
  }
  return dsrun::kExitError;
}
