#include "runner/commands.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"
#include "engine/recipe/load.hpp"
#include "engine/recipe/schema.hpp"
#include "runner/launcher.hpp"
#include "runner/terminal.hpp"
#include "storage/store.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <iostream>

namespace dsrun {

namespace {

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
  return loaded;
}

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

}  // namespace

std::string default_store_path() {
  if (const char* env = std::getenv("DSRUN_DB")) return env;
  return "runs/dsrun.db";
}

int command_plan(const RecipeArgs& args, bool json) {
  HostFacts host = read_host_facts();
  LoadedRecipe loaded = load_or_report(args, host);
  Plan plan = make_plan(loaded.recipe, host);
  std::cout << (json ? plan_to_json(plan) + "\n" : render_plan(plan));
  return plan.fits ? kExitOk : kExitDoesNotFit;
}

// Keys the recipe language has but this build's engine does not act on yet: said, never ignored.
static void warn_unimplemented(const LoadedRecipe& loaded) {
  static const std::pair<const char*, const char*> pending[] = {
      {"checkpoint.", "checkpoints"}, {"run.max_restarts", "restarts"}, {"hooks.", "Lua hooks"},
      {"logging.tensorboard", "TensorBoard files"}, {"logging.level", "log levels"}, {"logging.every", "logging intervals"}};
  for (const auto& [key, setting] : loaded.config) {
    if (setting.source.layer == Layer::Default || (!starts_with(key, "hooks.options.") && setting.value.toml() == default_value(key).toml())) continue;
    for (const auto& [prefix, what] : pending)
      if (starts_with(key, prefix))
        std::cerr << setting.source.describe() << ": warning: " << key << ": " << what
                  << " are not implemented in this build yet; the run goes ahead without them\n";
  }
}

// --smoke: the plan's layout (ranks, ZeRO stage, precision, accumulation, checkpointing, offload)
// with a model small enough for CPU ranks. Returns the --set overrides and what they change.
std::vector<std::string> smoke_overrides(const Recipe& r, const Plan& p, std::vector<std::string>& changes) {
  std::vector<std::string> sets;
  auto set = [&](const std::string& kv) { sets.push_back(kv); };
  set("hardware.device=cpu");
  set("hardware.nodes=1");
  set("hardware.devices_per_node=" + std::to_string(p.world_size));
  set("hardware.memory_gib=\"auto\"");
  set("hardware.link=\"shm\"");
  set("hardware.peak_tflops_bf16=0.01");
  set("parallel.data_parallel=" + std::to_string(p.data_parallel));
  set("parallel.zero_stage=" + std::to_string(p.zero_stage));
  set(std::string("parallel.activation_checkpointing=") + (p.activation_checkpointing ? "full" : "none"));
  changes.push_back(std::string(to_string(r.hardware.device)) + " \"" + r.hardware.name + "\" -> " + std::to_string(p.world_size) + " CPU ranks");
  if (p.dtype == DType::Fp16) {
    set("precision.dtype=bf16");
    changes.push_back("fp16 -> bf16 (libtorch has no CPU fp16 matmul)");
  }
  const int64_t micro = std::min<int64_t>(p.micro_batch, 2), accumulation = std::min<int64_t>(p.accumulation, 4);
  set("batch.micro=" + std::to_string(micro));
  set("batch.global=" + std::to_string(micro * accumulation * p.data_parallel));
  changes.push_back("batch " + std::to_string(p.global_batch) + " = " + std::to_string(p.micro_batch) + " x " + std::to_string(p.accumulation) + " x " +
                    std::to_string(p.data_parallel) + " -> " + std::to_string(micro * accumulation * p.data_parallel) + " = " + std::to_string(micro) +
                    " x " + std::to_string(accumulation) + " x " + std::to_string(p.data_parallel));
  if (r.model.arch == ModelArch::DeepSeek) {
    const int kv_groups = r.model.heads / r.model.kv_heads;
    const int heads = 4, kv = std::max(1, heads / std::min(kv_groups, 4));  // keeps GQA when the recipe has it
    for (const char* kv_set : {"model.hidden=64", "model.layers=2", "model.intermediate=128", "model.vocab=256", "model.max_seq_len=128", "batch.seq_len=32"})
      set(kv_set);
    set("model.heads=" + std::to_string(heads));
    set("model.kv_heads=" + std::to_string(kv));
    if (r.model.moe.enabled()) {
      set("model.moe.routed_experts=" + std::to_string(std::min(r.model.moe.routed_experts, 4)));
      set("model.moe.top_k=" + std::to_string(std::min(r.model.moe.top_k, 2)));
      set("model.moe.shared_experts=" + std::to_string(std::min(r.model.moe.shared_experts, 1)));
      set("model.moe.intermediate=32");
      set("model.moe.first_dense_layers=" + std::to_string(std::min(r.model.moe.first_dense_layers, 1)));
    }
    changes.push_back(r.model.name + " (" + format_count(p.cost.params) + " parameters) -> hidden 64, 2 layers, " + std::to_string(heads) + " heads (" +
                      std::to_string(kv) + " KV), vocab 256, sequence 32");
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

int command_run(const RecipeArgs& args, const RunFlags& flags, const std::string& db_path) {
  HostFacts host = read_host_facts();
  LoadedRecipe loaded = load_or_report(args, host);
  Plan plan = make_plan(loaded.recipe, host);
  std::string plan_text = render_plan(plan);
  std::cout << plan_text;
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
  make_directories(parent_directory(db_path));
  Store store(db_path);
  NewRun run;
  run.name = loaded.recipe.run.name.empty() ? file_stem(args.path) : loaded.recipe.run.name;
  if (flags.smoke) run.name += " (smoke)";
  run.recipe_path = args.path;
  run.recipe_text = loaded.text;
  run.config_toml = config_to_toml(loaded.config);
  run.plan_json = plan_to_json(plan);
  run.plan_text = plan_text;
  run.model = plan.model;
  run.hardware = plan.hardware;
  run.zero_stage = plan.zero_stage;
  run.world_size = plan.world_size;
  run.host = host.hostname;
  run.git_revision = git_revision_of(args.path);
  std::string id = store.create_run(run);
  if (!plan.fits) {
    store.set_status(id, RunStatus::Infeasible, plan.verdict.empty() ? "does not fit" : plan.verdict.front());
    std::cout << "\nrun " << id << " recorded as infeasible: the plan does not fit (see the suggestions above)\n";
    return kExitDoesNotFit;
  }
  std::cout << "\nrun " << id << ": " << plan.world_size << " rank(s), logs in " << path_join(parent_directory(db_path), id + "/logs") << "\n";
  LaunchOptions launch;
  launch.run_dir = path_join(parent_directory(db_path), id);
  launch.nnodes = flags.nnodes;
  launch.node_rank = flags.node_rank;
  launch.master_addr = flags.master_addr;
  launch.master_port = flags.master_port;
  launch.nccl_debug = flags.nccl_debug;
  launch.debug_rank = flags.debug_rank;
  launch.progress = loaded.recipe.logging.progress;
  RunStatus status = launch_run(loaded, plan, store, id, launch);
  auto latest = store.latest_metrics(id);
  std::cout << "run " << id << " " << to_string(status);
  if (latest.count("loss")) std::cout << ": loss " << format_double(latest["loss"].value, 5) << " at step " << latest["loss"].step;
  if (latest.count("val_loss")) std::cout << ", val_loss " << format_double(latest["val_loss"].value, 5);
  std::cout << "\nsee it with: dsrun show " << id << "\n";
  if (status == RunStatus::Finished) return kExitOk;
  return status == RunStatus::Killed ? static_cast<int>(kExitInterrupted) : static_cast<int>(kExitError);
}

void command_worker(const std::string& config_path) { exec_rank_process(config_path); }

int command_history(const std::string& db_path, int limit, const std::string& status, bool json) {
  if (!status.empty()) run_status_from_string(status);  // a typo is an error, not an empty list
  if (!file_exists(db_path)) {
    std::cout << "no runs yet (no store at " << db_path << ")\n";
    return kExitOk;
  }
  Store store(db_path);
  RunListOptions options;
  options.limit = limit;
  options.status = status;
  std::vector<RunRecord> runs = store.list_runs(options);
  if (!json) {
    std::cout << render_history(store, runs);
    return kExitOk;
  }
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json metrics = nlohmann::json::object();
    for (const auto& [k, m] : store.latest_metrics(r.id)) metrics[k] = {{"step", m.step}, {"value", m.value}};
    out.push_back({{"id", r.id}, {"name", r.name}, {"status", to_string(r.status)}, {"model", r.model}, {"hardware", r.hardware},
                   {"zero_stage", r.zero_stage}, {"world_size", r.world_size}, {"created_at", r.created_at},
                   {"started_at", r.started_at}, {"ended_at", r.ended_at}, {"latest_metrics", metrics}});
  }
  std::cout << out.dump(2) << "\n";
  return kExitOk;
}

int command_show(const std::string& db_path, const std::string& query, bool json) {
  if (!file_exists(db_path)) {
    ErrorContext c;
    c.file = db_path;
    c.hint = "run a recipe first, or pass --db";
    throw Error("no run store here", c);
  }
  Store store(db_path);
  RunRecord r = store.get_run(store.resolve_run(query));
  if (!json) {
    std::cout << render_run(store, r);
    return kExitOk;
  }
  nlohmann::json j = {{"id", r.id}, {"name", r.name}, {"status", to_string(r.status)}, {"error", r.error},
                      {"created_at", r.created_at}, {"started_at", r.started_at}, {"ended_at", r.ended_at},
                      {"recipe_path", r.recipe_path}, {"recipe_text", r.recipe_text}, {"config_toml", r.config_toml},
                      {"plan", nlohmann::json::parse(r.plan_json.empty() ? "null" : r.plan_json)}, {"host", r.host},
                      {"git_revision", r.git_revision}, {"parent_run", r.parent_run}, {"parent_step", r.parent_step}};
  std::cout << j.dump(2) << "\n";
  return kExitOk;
}

int command_init(const std::string& name, const std::string& template_name, bool force) {
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
  std::string target = ends_with(name, ".toml") ? name : name + ".toml";
  if (file_exists(target) && !force) {
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
  write_file_atomic(target, text);
  std::cout << "wrote " << target << " from template " << template_name << "\n"
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
