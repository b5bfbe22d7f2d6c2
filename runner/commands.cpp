#include "runner/commands.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"
#include "engine/recipe/load.hpp"
#include "engine/recipe/schema.hpp"
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

int command_run(const RecipeArgs& args, const std::string& db_path) {
  HostFacts host = read_host_facts();
  LoadedRecipe loaded = load_or_report(args, host);
  Plan plan = make_plan(loaded.recipe, host);
  std::string plan_text = render_plan(plan);
  std::cout << plan_text;
  if (!plan.hardware_present) {
    std::cout << "\nnot running: " << plan.hardware_message << "\n";
    return kExitHardwareMissing;
  }

  make_directories(parent_directory(db_path));
  Store store(db_path);
  NewRun run;
  run.name = loaded.recipe.run.name.empty() ? file_stem(args.path) : loaded.recipe.run.name;
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
  store.add_event(id, "planned", -1, "plan recorded; " + std::to_string(plan.world_size) + " ranks, ZeRO stage " + std::to_string(plan.zero_stage));
  std::cout << "\nrun " << id << " recorded in " << db_path << " (status planned).\n"
            << "This build plans and records runs; training itself arrives with the engine.\n"
            << "See it with: dsrun show " << id << "\n";
  return kExitOk;
}

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
