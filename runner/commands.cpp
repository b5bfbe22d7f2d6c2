#include "runner/commands.hpp"

#include "engine/checkpoint/checkpoint.hpp"
#include "engine/checkpoint/export.hpp"
#include "engine/common/environment.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/data/data_identity.hpp"
#include "engine/data/token_source.hpp"
#include "engine/hooks/hooks.hpp"
#include "engine/plan/plan.hpp"
#include "engine/recipe/hf_model_config.hpp"
#include "engine/recipe/load.hpp"
#include "engine/recipe/schema.hpp"
#include "runner/launcher.hpp"
#include "runner/slurm.hpp"
#include "runner/terminal.hpp"
#include "storage/store.hpp"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <cmath>
#include <csignal>
#include <functional>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <iostream>
#include <optional>

namespace dsrun {

namespace {

// What rank 0 will find when it opens token data, found now, before a run is recorded: the corpus
// is opened as the ranks open it (files mapped; headers, indexes, vocabulary and the mixture
// checked). Data missing on this machine was a warning of the recipe's and is not opened here.
void check_token_data(const Recipe& r) {
  if (r.data.kind != DataKind::Tokens) return;
  const TokenCorpusOptions o = token_corpus_options(r.data, r.model.vocab, r.batch.seq_len, r.run.seed);
  std::vector<std::string> all = o.paths;
  if (!o.val_path.empty()) all.push_back(o.val_path);
  for (const std::string& p : all)
    if (!file_exists(p) && !(file_exists(p + ".bin") && file_exists(p + ".idx"))) return;
  const TokenCorpus corpus(o);
  for (const std::string& w : corpus.warnings()) std::cerr << "dsrun: warning: data: " << w << "\n";
}

// What the recipe names and this machine lacks (the loader's kLackedHere warnings: data files):
// a run or resume here is refused before any rank starts (they would fail at their first batch).
void refuse_missing_data(const LoadedRecipe& loaded) {
  for (const Diagnostic& d : loaded.diagnostics)
    if (d.severity == Diagnostic::Severity::Warning && ends_with(d.message, kLackedHere)) {
      ErrorContext c;
      c.file = d.source.file;
      c.line = d.source.line;
      c.key = d.key;
      c.hint = "fix the path (dsrun prepare writes token shards), or --set " + d.key + " to data this machine has";
      throw Error(d.message.substr(0, d.message.find(';')) + ": nothing trained", c);
    }
}

// A validation split too small for one sequence would fail in the ranks at their first evaluation:
// refused here, before a run is recorded. Text is a token a byte; synthetic data is what
// engine/data/dataset.cpp makes (at least 1 Mi tokens, 64 sequences).
void check_validation_split(const Recipe& r) {
  const DataOptions& d = r.data;
  if (r.eval.every <= 0 || !d.val_path.empty() || d.val_fraction <= 0 || r.model.arch != ModelArch::DeepSeek) return;
  double tokens = 0;
  if (d.kind == DataKind::Synthetic) {
    tokens = static_cast<double>(std::max<int64_t>(1 << 20, 64 * (r.batch.seq_len + 1)));
  } else if (d.kind == DataKind::Text) {
    for (const std::string& f : is_directory(d.path) ? data_directory_files(d.path, "") : std::vector<std::string>{d.path})
      tokens += static_cast<double>(std::max<int64_t>(0, file_size(f)));
  } else {
    return;  // token corpora split each file in whole documents and say so themselves (check_token_data)
  }
  const double held_out = std::floor(tokens * d.val_fraction), needed = static_cast<double>(r.batch.seq_len + 1);
  if (tokens <= 0 || held_out >= needed) return;
  ErrorContext c;
  c.key = "data.val_fraction";
  c.hint = "raise data.val_fraction to at least " + format_double(needed / tokens, 3) + ", give data.val_path, or set eval.every = 0";
  throw Error("data.val_fraction = " + format_double(d.val_fraction, 3) + " holds out " + format_double(held_out, 6) + " of the data's " + format_double(tokens, 6) +
                  " tokens: not one validation sequence of " + std::to_string(r.batch.seq_len + 1),
              c);
}

// The free space where the run's checkpoints will go (checkpoint.dir, else beside the store), for
// the plan's disk check.
void note_checkpoint_disk(HostFacts& host, const Recipe& r, const std::string& db_path) {
  host.checkpoint_free_bytes = free_disk_bytes(r.checkpoint.dir.empty() ? runs_directory(db_path) : r.checkpoint.dir);
}

}  // namespace

// Loads and validates; prints every diagnostic (warnings too) to stderr. Throws when invalid.
LoadedRecipe load_or_report(const RecipeArgs& args, const HostFacts& host) {
  LoadOptions options;
  options.overrides = args.sets;
  options.host = host;
  LoadedRecipe loaded = load_recipe_file(args.path, options);
  if (!loaded.ok()) {
    std::cerr << loaded.report();
    ErrorContext c;
    c.file = args.path;
    c.hint = "fix the errors above; docs/recipe.md lists every key";
    throw Error("invalid recipe", c);
  }
  std::string warnings = loaded.report();
  if (!warnings.empty()) std::cerr << warnings;
  check_token_data(loaded.recipe);
  check_validation_split(loaded.recipe);
  return loaded;
}

namespace {

// The commit of the recipe's directory, "+dirty" when the recipe has uncommitted changes; "" outside git.
std::string git_revision_of(const std::string& recipe_path) {
  std::string dir = parent_directory(recipe_path);
  auto capture = [](const std::string& cmd) {
    std::string out;
    if (FILE* f = popen(cmd.c_str(), "r")) {
      char buf[256];
      while (fgets(buf, sizeof buf, f)) out += buf;
      if (pclose(f) != 0) return std::string();
    }
    return trim(out);
  };
  auto quoted = [](const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::string rev = capture("git -C " + quoted(dir) + " rev-parse --short=12 HEAD 2>/dev/null");
  if (rev.empty()) return "";
  std::string dirty = capture("git -C " + quoted(dir) + " status --porcelain -- " + quoted(recipe_path.substr(recipe_path.find_last_of('/') + 1)) + " 2>/dev/null");
  return dirty.empty() ? rev : rev + "+dirty";
}

std::string first_comment_line(const std::string& path) {
  for (const auto& line : split(read_file(path), '\n')) {
    std::string t = trim(line);
    if (starts_with(t, "#")) return trim(t.substr(1));
    if (!t.empty()) break;
  }
  return "";
}

// The recipe's on_plan hook, when its script defines one: it may reject the plan (the returned
// reason) or change settings, which re-resolve the recipe (`args`, `loaded` and `plan` updated).
// Loading the script here also reports its syntax errors before any rank starts.
std::string apply_plan_hook(RecipeArgs& args, LoadedRecipe& loaded, Plan& plan, const HostFacts& host) {
  if (loaded.recipe.hooks.script.empty()) return "";
  RecipeHooks hooks(loaded.recipe.hooks);
  if (!hooks.defines("on_plan")) return "";
  PlanVerdict verdict = hooks.on_plan(nlohmann::json::parse(plan_to_json(plan)));
  if (!verdict.reject.empty()) return verdict.reject;
  if (verdict.sets.empty()) return "";
  std::cerr << "dsrun: on_plan (" << hooks.script() << ") set: " << join(verdict.sets, " ") << "\n";
  for (const auto& kv : verdict.sets) args.sets.push_back(kv);
  loaded = load_or_report(args, host);
  plan = make_plan(loaded.recipe, host);
  return "";
}

// What the store records of a run to be launched: its resolved config and plan (the caller adds
// the name, the recipe as written and lineage).
NewRun run_record(const LoadedRecipe& loaded, const Plan& plan, const std::string& plan_text, const HostFacts& host) {
  NewRun run;
  run.config_toml = config_to_toml(loaded.config);
  run.config_json = config_to_json(loaded.config);
  run.plan_json = plan_to_json(plan);
  run.plan_text = plan_text;
  run.model = plan.model;
  run.hardware = plan.hardware;
  run.zero_stage = plan.layout.zero_stage;
  run.world_size = plan.world_size;
  run.host = host.hostname;
  return run;
}

// How a run's ending reads as the command's exit status.
static int exit_code_of(RunStatus status) {
  if (status == RunStatus::Finished || status == RunStatus::Pruned) return kExitOk;
  return status == RunStatus::Killed ? static_cast<int>(kExitInterrupted) : static_cast<int>(kExitError);
}

// Launches a recorded run (from step 0, or from a checkpoint) and prints how it ended.
// `on_started`: a resume's overrides, recorded only once training runs on them (LaunchOptions::config_pending).
int launch_and_report(const LoadedRecipe& loaded, const Plan& plan, Store& store, const std::string& id, const RunFlags& flags,
                      const std::string& db_path, const std::string& resume_from, bool accept_data_change = false, std::function<void()> on_started = {},
                      bool run_claimed = false) {
  LaunchOptions launch;
  launch.run_claimed = run_claimed;
  launch.config_pending = static_cast<bool>(on_started);
  launch.on_started = std::move(on_started);
  launch.accept_data_change = accept_data_change;
  launch.run_dir = path_join(runs_directory(db_path), id);
  launch.nnodes = flags.nnodes;
  launch.node_rank = flags.node_rank;
  launch.master_addr = flags.master_addr;
  launch.master_port = flags.master_port;
  launch.nccl_debug = flags.nccl_debug;
  launch.debug_rank = flags.debug_rank;
  launch.progress = loaded.recipe.logging.progress;
  launch.resume_from = resume_from;
  launch.owns_run = flags.run_id.empty() && flags.node_rank == 0;
  launch.reports_node = flags.nnodes > 1;
  RunStatus status = launch_run(loaded, plan, store, id, launch);
  auto latest = store.latest_metrics(id);
  std::cout << "run " << id << " " << to_string(status);
  if (latest.count("loss")) std::cout << ": loss " << format_double(latest["loss"].value, 5) << " at step " << latest["loss"].step;
  if (latest.count("val_loss")) std::cout << ", val_loss " << format_double(latest["val_loss"].value, 5);
  std::cout << "\nsee it with: dsrun show " << id << "\n";
  return exit_code_of(status);
}

Store open_existing_store(const std::string& db_path) {
  if (!store_exists(db_path)) {
    ErrorContext c;
    c.file = db_path;
    c.hint = "run a recipe first, or pass --db";
    throw Error("no run store here", c);
  }
  return Store(db_path);
}

// A recorded run's resolved config (RUNS/<id>/config.toml, what its ranks ran), with overrides.
LoadedRecipe load_run_config(const std::string& db_path, const RunRecord& r, const std::vector<std::string>& sets, const HostFacts& host) {
  const std::string path = path_join(path_join(runs_directory(db_path), r.id), "config.toml");
  if (!file_exists(path)) {
    ErrorContext c;
    c.file = path;
    c.hint = "only runs that were launched have a resolved config; start this one with dsrun run";
    throw Error("run " + r.id + " has no resolved config", c);
  }
  return load_or_report(RecipeArgs{path, sets}, host);
}

std::string steps_available(const std::string& root) {
  std::vector<std::string> steps;
  for (const auto& c : list_checkpoints(root))
    if (c.complete) steps.push_back(std::to_string(c.step));
  return steps.empty() ? "none" : join(steps, ", ");
}

}  // namespace

std::string default_store_path() {
  if (const char* env = std::getenv("DSRUN_DB")) return env;
  // A job script names a file that holds the location (one with a password: slurm_job_from_plan).
  if (const char* file = std::getenv("DSRUN_DB_FILE")) return trim(read_file(file));
  return "runs/dsrun.db";
}

std::vector<std::string> smoke_overrides(const Recipe& r, const Plan& p, std::vector<std::string>& changes);

int command_plan(const RecipeArgs& given, bool json, bool layouts, bool smoke) {
  HostFacts host = read_host_facts();
  RecipeArgs args = given;
  LoadedRecipe loaded = load_or_report(args, host);
  note_checkpoint_disk(host, loaded.recipe, default_store_path());
  if (layouts) {
    const LayoutSearch search = search_layouts(loaded.recipe, host, /*every_key=*/true);
    std::cout << (json ? layouts_to_json(search) + "\n" : render_layouts(search, loaded.recipe));
    return !search.rows.empty() && search.rows.front().fits ? kExitOk : kExitDoesNotFit;
  }
  Plan plan = make_plan(loaded.recipe, host);
  if (smoke) {  // the plan `dsrun run --smoke` would run
    std::vector<std::string> changes;
    for (auto& s : smoke_overrides(loaded.recipe, plan, changes)) args.sets.push_back(s);
    loaded = load_or_report(args, host);
    plan = make_plan(loaded.recipe, host);
  }
  const std::string rejected = apply_plan_hook(args, loaded, plan, host);
  std::cout << (json ? plan_to_json(plan) + "\n" : render_plan(plan));
  if (!rejected.empty()) {
    std::cout << (json ? "" : "\nrejected by on_plan (" + loaded.recipe.hooks.script + "): " + rejected + "\n");
    if (json) std::cerr << "dsrun: rejected by on_plan: " << rejected << "\n";
    return kExitDoesNotFit;
  }
  return plan.fits ? kExitOk : kExitDoesNotFit;
}

// Keys the recipe language has but this build's engine does not act on yet: said, never ignored.
static void warn_unimplemented(const LoadedRecipe& loaded) {
  static const std::pair<const char*, const char*> pending[] = {
      {"logging.level", "log levels"}, {"logging.every", "logging intervals"}};
  for (const auto& [key, setting] : loaded.config) {
    if (setting.source.layer == Layer::Default || (!starts_with(key, "hooks.options.") && setting.value.toml() == default_value(key).toml())) continue;
    for (const auto& [prefix, what] : pending)
      if (starts_with(key, prefix))
        std::cerr << setting.source.describe() << ": warning: " << key << ": " << what
                  << " are not implemented in this build yet; the run goes ahead without them\n";
  }
}

// --smoke: the plan's layout, every degree and choice as planned (the keys the ranks read), with a
// model small enough for CPU ranks, shrunk to multiples of those degrees, and this machine's
// memory. Returns the --set overrides and what they change.
std::vector<std::string> smoke_overrides(const Recipe& r, const Plan& p, std::vector<std::string>& changes) {
  std::vector<std::string> sets;
  auto set = [&](const std::string& kv) { sets.push_back(kv); };
  const Layout& l = p.layout;
  set("hardware.device=cpu");
  set("hardware.nodes=1");
  set("hardware.devices_per_node=" + std::to_string(p.world_size));
  set("hardware.memory_gib=\"auto\"");
  set("hardware.host_memory_gib=\"auto\"");
  set("hardware.link=\"shm\"");
  set("hardware.peak_tflops_bf16=0.01");
  // The interleaved schedule needs micro-batches in multiples of the stages: exactly one round.
  const bool interleaved = l.pipeline > 1 && l.schedule == PipelineScheduleKind::Interleaved;
  Layout small = l;
  small.micro = std::min<int64_t>(l.micro, 2);
  const int64_t accumulation = interleaved ? l.pipeline : std::min<int64_t>(p.accumulation, 4);
  for (const auto& [key, value] : small.to_config_keys()) set(key + "=" + value.toml());
  set("parallel.tensor_across_nodes=true");  // one node now: nothing crosses
  changes.push_back(std::string(to_string(r.hardware.device)) + " \"" + r.hardware.name + "\" -> " + std::to_string(p.world_size) + " CPU ranks (" + l.describe() + ")");
  if (r.precision.fp8 != Fp8Scaling::None) {
    set("precision.fp8=none");
    changes.push_back("precision.fp8 = \"" + std::string(to_string(r.precision.fp8)) + "\" -> \"none\" (CPU ranks have no FP8 products)");
  }
  if (p.dtype == DType::Fp16) {
    set("precision.dtype=bf16");
    changes.push_back("fp16 -> bf16 (libtorch has no CPU fp16 matmul)");
  }
  set("batch.global=" + std::to_string(small.micro * accumulation * l.data));
  changes.push_back("batch " + std::to_string(p.global_batch) + " = " + std::to_string(l.micro) + " x " + std::to_string(p.accumulation) + " x " +
                    std::to_string(l.data) + " -> " + std::to_string(small.micro * accumulation * l.data) + " = " + std::to_string(small.micro) +
                    " x " + std::to_string(accumulation) + " x " + std::to_string(l.data));
  if (r.model.arch == ModelArch::DeepSeek) {
    // Sizes the tensor degree splits are multiples of it (whole heads and KV heads on every rank,
    // GQA kept when the recipe has it); layers a multiple of the pipeline's pieces; routed
    // experts a multiple of the expert degree.
    const int t = l.tensor;
    auto multiple = [&](int64_t near, int64_t of) { return std::to_string(of * std::max<int64_t>(1, near / of)); };
    const int groups = std::min(r.model.heads / r.model.kv_heads, 4);
    int kv = std::max(1, 4 / groups);
    if (kv % t != 0) kv = t;
    const int heads = kv * groups;
    set("model.hidden=" + std::to_string(16 * heads));
    set("model.intermediate=" + multiple(128, t));
    set("model.vocab=" + multiple(256, t));
    set("model.max_seq_len=128");
    // The sequence: whole tensor shares (sequence parallelism) and 2 × context chunks.
    const int64_t sequence_unit = std::lcm<int64_t>(t, 2 * l.context);
    const std::string seq_len = multiple(std::max<int64_t>(32, 4 * sequence_unit), sequence_unit);
    set("batch.seq_len=" + seq_len);
    const int pieces = l.pipeline * l.virtual_stages;
    const int layers = pieces * std::max(1, (2 + pieces - 1) / pieces);
    set("model.layers=" + std::to_string(layers));
    set("model.heads=" + std::to_string(heads));
    set("model.kv_heads=" + std::to_string(kv));
    std::string experts;
    if (r.model.moe.enabled()) {
      const int e = l.expert, routed = e * std::max(1, std::min(r.model.moe.routed_experts, 4) / e);
      set("model.moe.routed_experts=" + std::to_string(routed));
      set("model.moe.top_k=" + std::to_string(std::min({r.model.moe.top_k, 2, routed})));
      set("model.moe.shared_experts=" + std::to_string(std::min(r.model.moe.shared_experts, 1)));
      set("model.moe.intermediate=" + multiple(32, t));
      set("model.moe.first_dense_layers=" + std::to_string(std::min({r.model.moe.first_dense_layers, 1, layers - 1})));
      if (!r.model.moe.route_bias.empty()) set("model.moe.route_bias=[]");
      experts = ", " + std::to_string(routed) + " routed experts";
    }
    changes.push_back(r.model.name + " (" + format_count(p.cost.params) + " parameters) -> hidden " + std::to_string(16 * heads) + ", " + std::to_string(layers) + " layers, " +
                      std::to_string(heads) + " heads (" + std::to_string(kv) + " KV)" + experts + ", vocab " + multiple(256, t) + ", sequence " + seq_len);
  } else {
    set("model.resnet.depth=18");
    set("model.resnet.width=8");
    set("model.resnet.image_size=16");
    set("model.resnet.classes=10");
    changes.push_back(r.model.name + " -> ResNet-18 of width 8 on 16x16 images");
  }
  set("data.kind=\"synthetic\"");
  changes.push_back(std::string("data ") + to_string(r.data.kind) + " -> synthetic");
  set("run.steps=" + std::to_string(std::min<int64_t>(r.run.steps, 6)));
  set("schedule.warmup_steps=" + std::to_string(std::min<int64_t>(r.schedule.warmup_steps, 2)));
  if (r.schedule.kind == ScheduleKind::MultiStep) set("schedule.milestones=[0.5, 0.75]");
  if (r.eval.every > 0) set("eval.every=3");
  changes.push_back("steps " + std::to_string(r.run.steps) + " -> " + std::to_string(std::min<int64_t>(r.run.steps, 6)));
  return sets;
}

std::string job_key(const std::string& master_addr, int master_port) {
  for (const char* name : {"DSRUN_JOB_KEY", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"}) {
    const char* v = std::getenv(name);
    if (v && *v && std::string(v) != "none") return v;  // torchrun's default rendezvous id is "none"
  }
  return "rendezvous " + master_addr + ":" + std::to_string(master_port);
}

// Node 0 records the run; the other nodes wait for it (as their ranks would wait for the rendezvous).
static std::string wait_for_job_run(const Store& store, const std::string& key, double timeout_seconds) {
  const double since = unix_now() - 24 * 3600, deadline = unix_now() + std::max(30.0, timeout_seconds);
  while (true) {
    const std::string id = store.find_job_run(key, since);
    if (!id.empty()) return id;
    if (unix_now() > deadline) {
      ErrorContext c;
      c.file = store.path();
      c.key = "--run-id";
      c.hint = "start node 0 with the same --db (a store every node reaches: postgresql://...) and the same --master-addr/--master-port, or pass --run-id";
      throw Error("node 0 recorded no planned or running run for \"" + key + "\" within " + format_seconds(std::max(30.0, timeout_seconds)), c);
    }
    ::usleep(300000);
  }
}

static int submit_to_slurm(const LoadedRecipe& loaded, const Plan& plan, Store& store, const std::string& id, const std::string& db_path);

int command_run(const RecipeArgs& given, const RunFlags& flags, const std::string& db_path) {
  HostFacts host = read_host_facts();
  RecipeArgs args = given;
  LoadedRecipe loaded = load_or_report(args, host);
  note_checkpoint_disk(host, loaded.recipe, db_path);
  Plan plan = make_plan(loaded.recipe, host);
  const std::string rejected = apply_plan_hook(args, loaded, plan, host);
  std::string plan_text = render_plan(plan);
  std::cout << plan_text;
  if (!flags.smoke && loaded.recipe.precision.fp8 != Fp8Scaling::None && !host.kernels.fp8_products) {
    ErrorContext c;
    c.file = args.path;
    c.key = "precision.fp8";
    c.hint = "build dsrun against PyTorch 2.5 or later with CUDA (scripts/gpu_build.sh), or set precision.fp8 = \"none\"";
    throw Error("precision.fp8 = \"" + std::string(to_string(loaded.recipe.precision.fp8)) + "\" needs torch's scaled FP8 products; this build has none (a CPU libtorch, or one older than 2.5)", c);
  }
  if (flags.smoke) {
    std::vector<std::string> changes;
    RecipeArgs smoke = args;
    for (auto& s : smoke_overrides(loaded.recipe, plan, changes)) smoke.sets.push_back(s);
    loaded = load_or_report(smoke, host);
    plan = make_plan(loaded.recipe, host);
    plan_text = render_plan(plan);
    std::cout << "\nsmoke run: the plan above, shrunk to run on this machine's CPU:\n";
    for (const auto& c : changes) std::cout << "  " << c << "\n";
  } else if (!plan.hardware_present) {
    std::cout << "\nnot running: " << plan.hardware_message << "\n"
              << "To try the plan's layout on CPU ranks with a shrunk model: dsrun " << args.path << " --smoke\n";
    return kExitHardwareMissing;
  }

  if (flags.nnodes > 1 && flags.master_port == 0) {
    ErrorContext c;
    c.key = "--master-port";
    c.hint = "give every node the same --master-addr and --master-port (node 0 hosts the rendezvous)";
    throw Error("a multi-node run needs an agreed rendezvous port", c);
  }
  warn_unimplemented(loaded);
  // A trial of a sweep: the sweep driver says which (runner/sweep.cpp).
  const char* sweep_id = std::getenv("DSRUN_SWEEP_ID");
  // (A Slurm job's nodes may hold data this one lacks; a sweep's trial is recorded failed instead.)
  if (!flags.slurm && !sweep_id) refuse_missing_data(loaded);
  if (loaded.has_sweep && !sweep_id)
    std::cerr << args.path << ": warning: the [sweep] section is ignored by `dsrun run`, which runs the recipe once; use `dsrun sweep " << args.path << "`\n";
  make_directories(runs_directory(db_path));
  Store store(db_path);
  if (!flags.run_id.empty() || flags.node_rank > 0) {
    // Another node's launcher created the run: this one joins it (its ranks, its node's row).
    const std::string id = flags.run_id.empty() ? wait_for_job_run(store, job_key(flags.master_addr, flags.master_port), plan.startup_timeout_seconds)
                                                : store.resolve_run(flags.run_id);
    std::cout << "\nrun " << id << ": node " << flags.node_rank << " of " << flags.nnodes << ", logs in " << path_join(runs_directory(db_path), id + "/logs") << "\n";
    return launch_and_report(loaded, plan, store, id, flags, db_path, "");
  }
  NewRun run = run_record(loaded, plan, plan_text, host);
  run.name = loaded.recipe.run.name.empty() ? file_stem(args.path) : loaded.recipe.run.name;
  if (flags.smoke) run.name += " (smoke)";
  run.recipe_path = args.path;
  run.recipe_text = loaded.text;
  run.git_revision = git_revision_of(args.path);
  if (sweep_id) {
    run.sweep_id = sweep_id;
    run.trial_index = std::atoll(std::getenv("DSRUN_TRIAL_INDEX") ? std::getenv("DSRUN_TRIAL_INDEX") : "-1");
    run.trial_params = std::getenv("DSRUN_TRIAL_PARAMS") ? std::getenv("DSRUN_TRIAL_PARAMS") : "";
    run.name += " #" + std::to_string(run.trial_index);
  }
  // A Slurm sweep's task recorded the trial's run when it claimed it; this fills in the plan.
  const char* claimed = std::getenv("DSRUN_TRIAL_RUN");
  std::string id;
  if (claimed && *claimed) {
    id = claimed;
    store.complete_run(id, run);
  } else {
    id = store.create_run(run);
  }
  if (flags.nnodes > 1) store.set_job(id, job_key(flags.master_addr, flags.master_port), "", "", "");
  if (!rejected.empty()) {
    store.set_status(id, RunStatus::Infeasible, "rejected by on_plan: " + rejected);
    std::cout << "\nrun " << id << " recorded as infeasible: rejected by on_plan (" << loaded.recipe.hooks.script << "): " << rejected << "\n";
    return kExitDoesNotFit;
  }
  if (!plan.fits) {
    store.set_status(id, RunStatus::Infeasible, plan.verdict.empty() ? "does not fit" : plan.verdict.front());
    std::cout << "\nrun " << id << " recorded as infeasible: the plan does not fit (see the suggestions above)\n";
    return kExitDoesNotFit;
  }
  if (flags.slurm) return submit_to_slurm(loaded, plan, store, id, db_path);
  std::cout << "\nrun " << id << ": " << plan.world_size << " rank(s), logs in " << path_join(runs_directory(db_path), id + "/logs") << "\n";
  return launch_and_report(loaded, plan, store, id, flags, db_path, "");
}

// `dsrun run --slurm`: the run is recorded (planned), its resolved config and job script written
// to its directory, and the job submitted; its ranks are `srun dsrun worker` tasks that report
// into this store under this run's id. A job Slurm starts again resumes from the newest checkpoint.
static int submit_to_slurm(const LoadedRecipe& loaded, const Plan& plan, Store& store, const std::string& id, const std::string& db_path) {
  const std::string run_dir = absolute(path_join(runs_directory(db_path), id));
  try {
    make_directories(path_join(run_dir, "logs"));
    const std::string config_path = path_join(run_dir, "config.toml");
    write_file_atomic(config_path, rank_config_toml(loaded, plan));
    write_file_atomic(path_join(run_dir, "plan.json"), plan_to_json(plan));
    SlurmJobSpec job = slurm_job_from_plan(loaded.recipe, plan, "dsrun-" + store.get_run(id).name, db_path, run_dir);
    job.output = path_join(run_dir, "logs/slurm-%j.out");
    job.env.push_back({"DSRUN_RUN_ID", id});
    job.env.push_back({"DSRUN_CHECKPOINT_DIR", checkpoint_root_of(loaded.recipe, run_dir, id)});
    job.task_command = shell_quote(path_join(executable_directory(), "dsrun")) + " worker " + shell_quote(config_path);
    const std::string script = path_join(run_dir, "job.sh");
    write_file_atomic(script, sbatch_script(job), 0700);  // the submitter's alone
    const std::string job_id = submit_job(script);
    store.set_job(id, job_id, "PENDING", "", "");
    store.add_event(id, "submitted", -1, "Slurm job " + job_id + ": " + std::to_string(job.nodes) + " node(s) x " + std::to_string(job.tasks_per_node) + " task(s), script " + script);
    std::cout << "\nrun " << id << " submitted to Slurm as job " << job_id << " (" << job.nodes << " node(s) x " << job.tasks_per_node << " task(s)); logs in "
              << path_join(run_dir, "logs") << "\nfollow it: dsrun watch " << id << "   stop it: dsrun cancel " << id << "\n";
    return kExitOk;
  } catch (const Error& e) {
    store.set_status(id, RunStatus::Failed, "not submitted: " + e.describe());
    throw;
  }
}

int command_cancel(const std::string& query, const std::string& db_path) {
  Store store = open_existing_store(db_path);
  refresh_slurm_runs(store);
  const RunRecord r = store.get_run(store.resolve_run(query));
  if (r.status != RunStatus::Running && r.status != RunStatus::Planned) {
    std::cout << "run " << r.id << " is " << to_string(r.status) << ": nothing to cancel\n";
    return kExitOk;
  }
  if (is_slurm_job_id(r.job_id) && slurm_missing().empty()) {
    cancel_job(r.job_id);
    store.add_event(r.id, "cancel", -1, "scancel " + r.job_id + " (dsrun cancel)");
    std::cout << "cancelled Slurm job " << r.job_id << " of run " << r.id << "\n";
    return kExitOk;
  }
  if (r.pid > 0 && r.host == read_host_facts().hostname && process_alive(r.pid)) {
    if (::kill(static_cast<pid_t>(r.pid), SIGTERM) != 0) fail_at(__FILE__, __LINE__, std::string("kill: ") + std::strerror(errno));
    store.add_event(r.id, "cancel", -1, "SIGTERM to the launcher, process " + std::to_string(r.pid) + " (dsrun cancel)");
    std::cout << "asked run " << r.id << "'s launcher (process " << r.pid << ") to stop; its ranks save and exit\n";
    return kExitOk;
  }
  ErrorContext c;
  c.key = r.id;
  c.hint = r.host.empty() ? "" : "its launcher runs on " + r.host + ": run dsrun cancel there";
  throw Error("run " + r.id + " has no Slurm job and no launcher on this host to stop", c);
}

// The data files a checkpoint recorded, against the same paths now. A difference is refused
// unless `force`; forced, the differences are returned, to be said and recorded. The ranks check
// again against the files they open (the launcher's restarts included).
// `moved`: the resume names the data elsewhere (data.path, val_path or blend overridden): the files
// are compared in order by the ranks, which read them there (a corpus moved to another directory
// is the same data).
static std::vector<std::string> check_checkpoint_data(const CheckpointInfo& found, const CheckpointManifest& m, bool force, bool moved = false) {
  if (moved) return {};
  const DataChanges changes = compare_with_disk(m.data_files);
  for (const std::string& t : changes.touched) std::cerr << "dsrun: note: " << t << "\n";
  if (changes.same() || force) return changes.differ;
  ErrorContext c;
  c.file = path_join(found.path, kManifestFile);
  c.key = "data.path";
  c.hint = "put the data back as it was, or pass --force to train on it as it is now (recorded as a resume_change event)";
  throw Error("the data differs from what the checkpoint at step " + std::to_string(found.step) + " trained on: " + join(changes.differ, "; "), c);
}

int command_store_replay(const std::string& run, const std::string& db_path) {
  Store store = open_existing_store(db_path);
  const RunRecord r = store.get_run(store.resolve_run(run));
  const int replayed = replay_run_journals(store, r, path_join(runs_directory(db_path), r.id));
  if (replayed == 0 && r.status == RunStatus::Running && launcher_gone(r, read_host_facts().hostname, unix_now()).empty()) {
    std::cout << "run " << r.id << ": its launcher is alive and replays its own journal\n";
    return kExitOk;
  }
  std::cout << "run " << r.id << ": " << (replayed == 0 ? "no journal waits beside it" : std::to_string(replayed) + " journal(s) replayed into the store") << "; it is "
            << to_string(store.get_run(r.id).status) << "\n";
  return kExitOk;
}

int command_resume(const ResumeArgs& args, const RunFlags& flags, const std::string& db_path) {
  Store store = open_existing_store(db_path);
  RunRecord r = store.get_run(store.resolve_run(args.run));
  // What its launchers journaled goes into the store first: the run may have finished there.
  if (replay_run_journals(store, r, path_join(runs_directory(db_path), r.id)) > 0) {
    r = store.get_run(r.id);
    if (r.status == RunStatus::Finished) {
      std::cout << "run " << r.id << " finished: its journaled writes are now in the store; nothing to resume\n";
      return kExitOk;
    }
  }
  ErrorContext c;
  c.key = "run " + r.id;
  const std::string this_host = read_host_facts().hostname;
  std::string launcher_vanished;  // why a running run's launcher counts as gone (resume --force)
  if (r.status == RunStatus::Running) {
    launcher_vanished = launcher_gone(r, this_host, unix_now());
    const std::string launcher = "its launcher, process " + std::to_string(r.pid) + " on " + (r.host.empty() ? std::string("an unknown host") : r.host) +
                                 (r.heartbeat_at > 0 ? ", last heard from " + format_seconds(std::max(0.0, unix_now() - r.heartbeat_at)) + " ago" : "");
    // A live launcher (another resume's, say) is never worth a --force.
    if (launcher_vanished.empty()) {
      c.hint = "follow it with dsrun watch " + r.id + ", or stop it first (dsrun cancel " + r.id + ", or Ctrl-C in its terminal)";
      throw Error("run is still training: " + launcher + " is alive", c);
    }
    if (!args.force) {
      c.hint = launcher + " is gone (" + launcher_vanished + "): pass --force to take the run over";
      throw Error("run is marked running", c);
    }
  }
  if (r.status == RunStatus::Finished) {
    c.hint = "to train further, start a child run: dsrun rollback " + r.id + " --to-step N --set run.steps=MORE";
    throw Error("run already finished", c);
  }
  if (r.status != RunStatus::Failed && r.status != RunStatus::Killed && r.status != RunStatus::Running && r.status != RunStatus::Lost) {
    c.hint = "only failed, killed, lost or stopped runs resume";
    throw Error(std::string("run is ") + to_string(r.status), c);
  }
  HostFacts host = read_host_facts();
  LoadedRecipe loaded = load_run_config(db_path, r, args.sets, host);
  if (r.job_id.empty() && !flags.slurm) refuse_missing_data(loaded);
  note_checkpoint_disk(host, loaded.recipe, db_path);
  Plan plan = make_plan(loaded.recipe, host);
  if (!plan.fits) {
    std::cout << render_plan(plan);
    return kExitDoesNotFit;
  }
  const std::string run_dir = path_join(runs_directory(db_path), r.id);
  const std::string root = checkpoint_root_of(loaded.recipe, run_dir, r.id);
  std::vector<std::string> skipped;
  auto found = find_checkpoint(root, -1, args.fallback, &skipped);
  for (const auto& why : skipped) std::cerr << "dsrun: warning: skipped: " << why << "\n";
  if (!found) {
    c.file = root;
    c.hint = "this run saved no complete checkpoint; set checkpoint.every (or keep checkpoint.at_end) and start it again with dsrun run";
    throw Error("no complete checkpoint to resume from", c);
  }
  // What a --set changes that a resume cannot take back: said, recorded, or refused.
  std::vector<std::string> changes;
  std::optional<LoadedRecipe> recorded;  // the run's config without the overrides
  if (!args.sets.empty()) recorded = load_run_config(db_path, r, {}, host);
  auto changed = [&](const std::string& key) { return recorded && recorded->config.at(key).value.toml() != loaded.config.at(key).value.toml(); };
  const bool data_moved = changed("data.path") || changed("data.val_path") || changed("data.blend");
  const std::vector<std::string> data_changes = check_checkpoint_data(*found, read_checkpoint(found->path, /*verify_files=*/false), args.force, data_moved);
  for (const std::string& d : data_changes) {
    changes.push_back("data file changed since the checkpoint (--force): " + d);
    std::cerr << "dsrun: warning: resume of " << r.id << ": " << changes.back() << "\n";
  }
  const size_t first_config_change = changes.size();  // (the data changes above are said already)
  if (recorded) {
    const LoadedRecipe& before = *recorded;
    auto was = [&](const std::string& key) { return key + " " + before.config.at(key).value.toml() + " -> " + loaded.config.at(key).value.toml(); };
    if (loaded.recipe.run.steps <= found->step) {
      c.key = "run.steps";
      c.hint = "set run.steps above " + std::to_string(found->step) + " to train further";
      throw Error("the checkpoint is at step " + std::to_string(found->step) + " and run.steps = " + std::to_string(loaded.recipe.run.steps) + ": nothing would be trained", c);
    }
    if (changed("batch.global"))
      changes.push_back(was("batch.global") + ": the data position is step x global batch, so the resumed run reads from sample " +
                        std::to_string(found->step * loaded.recipe.batch.global) + ", not from where the run stopped (sample " +
                        std::to_string(found->step * before.recipe.batch.global) + ")");
    if (changed("run.seed")) changes.push_back(was("run.seed") + ": the data order and every random draw from here differ from the uninterrupted run's");
    if (changed("data.path") || changed("data.blend")) changes.push_back("the data changes (" + was(changed("data.path") ? "data.path" : "data.blend") + ")");
    // Whatever else changes the arithmetic from the checkpoint on (another optimizer, rotary base,
    // precision, schedule): said and recorded. Layouts, logging, checkpoints and evaluation are not.
    for (const auto& [key, setting] : loaded.config) {
      const bool trains_differently = starts_with(key, "model.") || starts_with(key, "optimizer.") || starts_with(key, "schedule.") || starts_with(key, "precision.");
      if (trains_differently && key != "model.init_from" && changed(key))
        changes.push_back(was(key) + ": from the checkpoint on, training differs from the uninterrupted run's");
    }
    for (size_t i = first_config_change; i < changes.size(); ++i) std::cerr << "dsrun: warning: resume of " << r.id << ": " << changes[i] << "\n";
  }
  // Compare-and-set: of two concurrent resumes one takes the run; the other changes nothing.
  if (!store.claim_run(r.id, r.status, r.heartbeat_at, this_host, ::getpid())) {
    const RunRecord now = store.get_run(r.id);
    c.hint = "another dsrun took it first (process " + std::to_string(now.pid) + " on " + now.host + "): follow it with dsrun watch " + r.id;
    throw Error("run changed while this resume prepared: it is " + std::string(to_string(now.status)) + " now", c);
  }
  if (!launcher_vanished.empty()) store.add_event(r.id, "resume", -1, "resumed with --force: " + launcher_vanished);
  for (const std::string& change : changes) store.add_event(r.id, "resume_change", -1, change);
  std::string message = "resume from step " + std::to_string(found->step) + " (" + found->path + ")";
  // Overrides become the run's config once its first step trains on them: a resume the ranks
  // refuse (a model that no longer matches the checkpoint) leaves the run as it was.
  std::function<void()> record_overrides;
  if (!args.sets.empty()) {
    message += " with " + join(args.sets, " ");
    record_overrides = [&store, &r, &loaded, &plan, sets = args.sets] {
      store.update_plan(r.id, config_to_toml(loaded.config), plan_to_json(plan), render_plan(plan), plan.layout.zero_stage, plan.world_size);
      store.add_event(r.id, "resume_config", -1, "training runs on " + join(sets, " ") + ": the run's config now");
    };
  }
  for (const auto& why : skipped) store.add_event(r.id, "checkpoint", -1, "skipped a checkpoint that does not verify", why);
  store.add_event(r.id, "resume", -1, message);
  std::cout << "run " << r.id << ": " << message << "; " << plan.world_size << " rank(s), ZeRO stage " << plan.layout.zero_stage << "\n";
  return launch_and_report(loaded, plan, store, r.id, flags, db_path, found->path, !data_changes.empty(), std::move(record_overrides), /*run_claimed=*/true);
}

int command_rollback(const std::string& run, int64_t to_step, const std::vector<std::string>& sets, bool force, bool fallback, const RunFlags& flags, const std::string& db_path) {
  Store store = open_existing_store(db_path);
  RunRecord parent = store.get_run(store.resolve_run(run));
  HostFacts host = read_host_facts();
  LoadedRecipe parent_config = load_run_config(db_path, parent, {}, host);
  const std::string root = checkpoint_root_of(parent_config.recipe, path_join(runs_directory(db_path), parent.id), parent.id);
  std::vector<std::string> skipped;
  auto found = find_checkpoint(root, to_step, fallback, &skipped);
  for (const auto& why : skipped) std::cerr << "dsrun: warning: skipped: " << why << "\n";
  if (!found) {
    ErrorContext c;
    c.file = root;
    c.key = "--to-step";
    c.hint = "complete checkpoints of run " + parent.id + " are at steps: " + steps_available(root);
    throw Error("no complete checkpoint at or before step " + std::to_string(to_step), c);
  }
  // The checkpoint's own config (what ran up to that step), plus the overrides.
  CheckpointManifest manifest = read_checkpoint(found->path, false);
  const std::vector<std::string> data_changes = check_checkpoint_data(*found, manifest, force);
  for (const std::string& d : data_changes) std::cerr << "dsrun: warning: rollback of " << parent.id << ": data file changed since the checkpoint (--force): " << d << "\n";
  LoadOptions options;
  options.overrides = sets;
  options.host = host;
  LoadedRecipe loaded = load_recipe_text(manifest.config_toml, path_join(found->path, kManifestFile), options);
  if (!loaded.ok()) {
    std::cerr << loaded.report();
    throw Error("invalid config for the rollback", ErrorContext{found->path, 0, 0, "", -1, "fix the --set overrides"});
  }
  note_checkpoint_disk(host, loaded.recipe, db_path);
  Plan plan = make_plan(loaded.recipe, host);
  std::string plan_text = render_plan(plan);
  NewRun child = run_record(loaded, plan, plan_text, host);
  child.name = parent.name + "@" + std::to_string(found->step);
  child.recipe_path = parent.recipe_path;
  child.recipe_text = parent.recipe_text;
  child.git_revision = parent.git_revision;
  child.parent_run = parent.id;
  child.parent_step = found->step;
  std::string id = store.create_run(child);
  if (!plan.fits) {
    std::cout << plan_text;
    store.set_status(id, RunStatus::Infeasible, plan.verdict.empty() ? "does not fit" : plan.verdict.front());
    return kExitDoesNotFit;
  }
  store.add_event(id, "rollback", -1, "from run " + parent.id + " at step " + std::to_string(found->step) + (sets.empty() ? "" : " with " + join(sets, " ")));
  for (const auto& why : skipped) store.add_event(id, "checkpoint", -1, "skipped a checkpoint of run " + parent.id + " that does not verify", why);
  for (const std::string& d : data_changes) store.add_event(id, "resume_change", -1, "data file changed since the checkpoint (--force): " + d);
  std::cout << "run " << id << ": rolled back from run " << parent.id << " at step " << found->step << (found->step != to_step ? " (the newest checkpoint at or before " + std::to_string(to_step) + ")" : "")
            << "; " << plan.world_size << " rank(s)\n";
  return launch_and_report(loaded, plan, store, id, flags, db_path, found->path, !data_changes.empty());
}

int command_export(const std::string& run, int64_t step, const std::string& to, const std::string& dtype, const std::string& db_path) {
  Store store = open_existing_store(db_path);
  RunRecord r = store.get_run(store.resolve_run(run));
  HostFacts host = read_host_facts();
  LoadedRecipe config = load_run_config(db_path, r, {}, host);
  const std::string root = checkpoint_root_of(config.recipe, path_join(runs_directory(db_path), r.id), r.id);
  auto found = find_checkpoint(root, step, /*fallback=*/false);
  if (!found) {
    ErrorContext c;
    c.file = root;
    c.key = "--step";
    c.hint = "complete checkpoints are at steps: " + steps_available(root);
    throw Error(step < 0 ? "run " + r.id + " has no complete checkpoint" : "no complete checkpoint at or before step " + std::to_string(step), c);
  }
  ExportResult out = export_checkpoint(found->path, to, dtype);
  std::cout << "exported run " << r.id << " step " << out.step << ": " << out.tensors << " tensors, " << format_bytes(static_cast<double>(out.bytes)) << "\n  "
            << out.weights_path << "\n  " << out.config_path << "\n";
  store.add_event(r.id, "export", -1, "step " + std::to_string(out.step) + " exported (" + dtype + ") to " + out.weights_path);
  return kExitOk;
}

namespace {

// srun sets SLURM_*; the rank reads torchrun's names. Mapped here when the outside launcher is
// Slurm, so `srun dsrun worker CONFIG` needs nothing else (the batch script exports MASTER_ADDR and
// MASTER_PORT: the first node of the job and a port from the job id).
void map_slurm_environment() {
  if (std::getenv("RANK") || !std::getenv("SLURM_PROCID")) return;
  auto set = [](const char* name, const std::string& value) { ::setenv(name, value.c_str(), 0); };
  set("RANK", std::getenv("SLURM_PROCID"));
  set("WORLD_SIZE", std::getenv("SLURM_NTASKS") ? std::getenv("SLURM_NTASKS") : "1");
  set("LOCAL_RANK", std::getenv("SLURM_LOCALID") ? std::getenv("SLURM_LOCALID") : "0");
  // SLURM_TASKS_PER_NODE reads "2(x3)" for 2 tasks on each of 3 nodes: the leading count.
  const char* per_node = std::getenv("SLURM_TASKS_PER_NODE");
  set("LOCAL_WORLD_SIZE", per_node ? std::to_string(std::max(1, std::atoi(per_node))) : std::string("1"));
  set("GROUP_RANK", std::getenv("SLURM_NODEID") ? std::getenv("SLURM_NODEID") : "0");
  const char* job = std::getenv("SLURM_JOB_ID");
  set("MASTER_PORT", std::to_string(20000 + (job ? std::atoi(job) : 0) % 20000));
  if (!std::getenv("MASTER_ADDR")) {
    const char* nodes = std::getenv("SLURM_JOB_NODELIST");
    if (nodes && !std::strpbrk(nodes, "[,")) set("MASTER_ADDR", nodes);  // one node; a list needs `scontrol show hostnames`
  }
}

}  // namespace

int command_worker(const std::string& config_path, const std::string& db_path, bool db_given) {
  map_slurm_environment();
  const char* run_env = std::getenv("DSRUN_RUN_ID");
  if (!db_given && !std::getenv("DSRUN_DB") && !std::getenv("DSRUN_DB_FILE") && !(run_env && *run_env)) exec_rank_process(config_path);  // nothing to record into

  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1);
  const int local_rank = env_int("LOCAL_RANK", 0), local_world = std::max(1, env_int("LOCAL_WORLD_SIZE", 1));
  const std::string master_addr = std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1";
  const int master_port = env_int("MASTER_PORT", 0);
  if (master_port <= 0) {
    ErrorContext c;
    c.key = "MASTER_PORT";
    c.hint = "the outside launcher sets MASTER_ADDR and MASTER_PORT (torchrun does; under srun, export them in the batch script)";
    throw Error("dsrun worker needs the rendezvous port", c);
  }
  HostFacts host = read_host_facts();
  LoadedRecipe loaded = load_or_report(RecipeArgs{config_path, {}}, host);
  note_checkpoint_disk(host, loaded.recipe, db_path);
  Plan plan = make_plan(loaded.recipe, host);
  if (plan.world_size != world) {
    ErrorContext c;
    c.file = config_path;
    c.key = "WORLD_SIZE";
    c.hint = "start as many ranks as the plan has (dsrun plan " + config_path + "), or change the recipe's layout";
    throw Error("the outside launcher started " + std::to_string(world) + " rank(s) but the plan has " + std::to_string(plan.world_size), c);
  }
  make_directories(runs_directory(db_path));
  Store store(db_path);
  std::string id = run_env && *run_env ? store.resolve_run(run_env) : "";
  if (id.empty() && rank == 0) {
    NewRun run = run_record(loaded, plan, render_plan(plan), host);
    run.name = loaded.recipe.run.name.empty() ? file_stem(config_path) : loaded.recipe.run.name;
    run.recipe_path = config_path;
    run.recipe_text = loaded.text;
    id = store.create_run(run);
    store.set_job(id, job_key(master_addr, master_port), "", "", "");
  } else if (id.empty()) {
    id = wait_for_job_run(store, job_key(master_addr, master_port), plan.startup_timeout_seconds);
  }

  LaunchOptions launch;
  launch.run_dir = path_join(runs_directory(db_path), id);
  launch.single_rank = rank;
  launch.local_rank = local_rank;
  launch.local_world = local_world;
  launch.nnodes = std::max(1, world / local_world);
  launch.node_rank = env_int("GROUP_RANK", rank / local_world);
  launch.master_addr = master_addr;
  launch.master_port = master_port;
  launch.progress = false;
  launch.owns_run = rank == 0;
  launch.reports_node = local_rank == 0;
  if (const char* dir = std::getenv("DSRUN_CHECKPOINT_DIR")) launch.checkpoint_root = dir;
  // A job the scheduler started again (Slurm's requeue) goes on from its newest checkpoint; every
  // rank finds the same one on the shared file system.
  if (const char* from = std::getenv("DSRUN_RESUME_FROM")) launch.resume_from = from;
  else if (env_int("SLURM_RESTART_COUNT", 0) > 0 || env_int("DSRUN_RESUME_LATEST", 0) > 0) {
    const std::string root = launch.checkpoint_root.empty() ? checkpoint_root_of(loaded.recipe, launch.run_dir, id) : launch.checkpoint_root;
    if (auto found = find_checkpoint(root, -1, /*fallback=*/true)) {
      launch.resume_from = found->path;
      if (rank == 0) store.add_event(id, "requeued", -1, "the scheduler started the job again (restart " + std::to_string(env_int("SLURM_RESTART_COUNT", 0)) +
                                                           "): resuming from step " + std::to_string(found->step));
    }
  }
  return exit_code_of(launch_run(loaded, plan, store, id, launch));
}

int command_show(const std::string& db_path, const std::string& query, bool json) {
  Store store = open_existing_store(db_path);
  refresh_slurm_runs(store);
  RunRecord r = store.get_run(store.resolve_run(query));
  replay_run_journals(store, r, path_join(runs_directory(db_path), r.id));  // (first: a journal may say how the run ended)
  mark_lost_runs(store);
  r = store.get_run(r.id);
  if (!json) {
    std::cout << render_run(store, r);
    return kExitOk;
  }
  nlohmann::json j = {{"id", r.id}, {"name", r.name}, {"status", to_string(r.status)}, {"error", r.error},
                      {"created_at", r.created_at}, {"started_at", r.started_at}, {"ended_at", r.ended_at},
                      {"recipe_path", r.recipe_path}, {"recipe_text", r.recipe_text}, {"config_toml", r.config_toml},
                      {"plan", nlohmann::json::parse(r.plan_json.empty() ? "null" : r.plan_json)}, {"host", r.host},
                      {"git_revision", r.git_revision}, {"parent_run", r.parent_run}, {"parent_step", r.parent_step}};
  j["checkpoints"] = nlohmann::json::array();
  for (const auto& c : store.checkpoints(r.id))
    j["checkpoints"].push_back({{"step", c.step}, {"path", c.path}, {"bytes", c.bytes}, {"checksum", c.checksum}, {"created_at", c.created_at}});
  j["job"] = {{"id", r.job_id}, {"state", r.job_state}, {"nodes", r.job_nodes}, {"reason", r.job_reason}};
  j["nodes"] = nlohmann::json::array();
  for (const auto& n : store.nodes(r.id))
    j["nodes"].push_back({{"node", n.node_rank}, {"host", n.host}, {"pid", n.pid}, {"status", n.status}, {"restarts", n.restarts}, {"heartbeat_at", n.heartbeat_at},
                          {"error", n.error}});
  j["children"] = nlohmann::json::array();
  for (const auto& c : store.children(r.id)) j["children"].push_back({{"id", c.id}, {"parent_step", c.parent_step}, {"status", to_string(c.status)}});
  std::cout << j.dump(2) << "\n";
  return kExitOk;
}

namespace {

// A template's `base = [...]` without its "models/..." entries: the model comes from elsewhere.
std::string without_model_bases(std::string text) {
  const size_t base = text.find("base = [");
  if (base == std::string::npos) return text;
  const size_t end = text.find(']', base);
  std::string list = text.substr(base, end - base);
  for (size_t at; (at = list.find("\"models/")) != std::string::npos;) {
    size_t close = list.find('"', at + 1) + 1;
    if (list.compare(close, 2, ", ") == 0) close += 2;                                // "models/x", ...
    else if (at >= 2 && list.compare(at - 2, 2, ", ") == 0) at -= 2;                  // ..., "models/x"
    list.erase(at, close - at);
  }
  return text.replace(base, end - base, list);
}

// The template's text with its model replaced by the one of a Hugging Face checkpoint.
std::string with_hf_model(std::string text, const std::string& from_hf) {
  ErrorContext c;
  c.key = "--from-hf";
  c.file = is_directory(from_hf) ? path_join(from_hf, "config.json") : from_hf;
  if (!file_exists(c.file)) {
    c.hint = "give a Hugging Face checkpoint directory (config.json and *.safetensors) or its config.json";
    throw Error("no config.json", c);
  }
  const std::string config_path = absolute(c.file);  // (init_from must hold wherever the recipe goes)
  if (text.find("\n[model") != std::string::npos) {
    c.hint = "choose a template without a [model] table (gpu-decoder, quickstart)";
    throw Error("the template sets the model itself", c);
  }
  const HfModelSection model = model_section_from_hf_config(config_path);
  std::string section = model.toml;
  const std::string dir = parent_directory(config_path);
  const auto files = list_directory(dir);
  if (std::any_of(files.begin(), files.end(), [](const std::string& f) { return ends_with(f, ".safetensors"); })) {
    const std::string header = "[model]\n";
    section.insert(section.find(header) + header.size(), "init_from = " + Value::of_string(dir).toml() + "   # its weights (FP8 blocks are dequantised on load)\n");
  }
  std::string note = "\n# The model: " + config_path + " (" + model.model_type + "), by dsrun init --from-hf.\n";
  if (!model.ignored.empty()) note += "# Read without effect on training: " + join(model.ignored, ", ") + ".\n";
  return without_model_bases(std::move(text)) + note + section;
}

}  // namespace

int command_init(const InitArgs& args) {
  const bool from_hf = !args.from_hf.empty();
  const std::string template_name = !args.template_name.empty() ? args.template_name : from_hf ? "gpu-decoder" : "quickstart";
  std::string source = path_join(templates_directory(), "recipes/" + template_name + ".toml");
  if (!file_exists(source)) {
    std::vector<std::string> known;
    for (const auto& f : list_directory(path_join(templates_directory(), "recipes"))) known.push_back(file_stem(f));
    std::string guess = nearest(template_name, known);
    ErrorContext c;
    c.key = "--template";
    c.hint = guess.empty() ? "choose one of: " + join(known, ", ") : "did you mean " + guess + "?";
    throw Error("no recipe template named \"" + template_name + "\"", c);
  }
  std::string target = ends_with(args.name, ".toml") ? args.name : args.name + ".toml";
  if (file_exists(target) && !args.force) {
    ErrorContext c;
    c.file = target;
    c.hint = "choose another name, or pass --force to overwrite";
    throw Error("file exists", c);
  }
  std::string text = read_file(source);
  std::string run_name = file_stem(target);
  // Name the run after the new file so history tells copies apart (recipe templates leave run.name unset).
  std::string marker = "[run]\n";
  size_t at = text.find(marker);
  if (at != std::string::npos) text.insert(at + marker.size(), "name = \"" + run_name + "\"\n");
  else text += "\n[run]\nname = \"" + run_name + "\"\n";
  if (from_hf) {
    text = with_hf_model(std::move(text), args.from_hf);
    // What was written must load: a model dsrun refuses is refused here, not at `dsrun plan`.
    LoadOptions options;
    options.host = read_host_facts();
    const LoadedRecipe loaded = load_recipe_text(text, target, options);
    if (!loaded.ok()) {
      std::cerr << loaded.report();
      ErrorContext c;
      c.key = "--from-hf";
      c.file = args.from_hf;
      c.hint = "the config.json's values break the rules above (its keys become the model.* keys of the same meaning)";
      throw Error("the recipe written from this config.json is invalid; nothing was written", c);
    }
  }
  write_file_atomic(target, text);
  std::cout << "wrote " << target << " from template " << template_name << (from_hf ? " and " + args.from_hf : "") << "\n"
            << "next: dsrun plan " << target << "\n";
  return kExitOk;
}

int command_templates() {
  std::string root = templates_directory();
  for (const char* kind : {"recipes", "hardware", "models"}) {
    std::string dir = path_join(root, kind);
    if (!is_directory(dir)) continue;
    std::cout << kind << (std::string(kind) == "recipes" ? " (dsrun init NAME --template T)" : " (base = \"" + std::string(kind) + "/NAME\")") << "\n";
    TextTable t({"name", "description"});
    for (const auto& f : list_directory(dir))
      if (ends_with(f, ".toml")) t.add({std::string(kind) == "recipes" ? file_stem(f) : std::string(kind) + "/" + file_stem(f), first_comment_line(path_join(dir, f))});
    std::cout << t.render("  ") << "\n";
  }
  return kExitOk;
}

int command_docs(const std::string& topic) {
  if (topic != "recipe") {
    ErrorContext c;
    c.hint = "available: recipe";
    throw Error("no generated document named \"" + topic + "\"", c);
  }
  std::cout << recipe_reference_markdown();
  return kExitOk;
}

}  // namespace dsrun
