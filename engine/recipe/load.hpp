// Recipe text -> validated Recipe, in three steps: parse (toml++, bases, --set) into a flat config
// of dotted keys that remember where they were written; validate every key against the schema,
// collecting every error; resolve into the Recipe struct and check the rules that span keys.
#pragma once

#include "engine/recipe/alert_rules.hpp"

#include "engine/common/host.hpp"
#include "engine/recipe/recipe.hpp"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dsrun {

// A TOML value, detached from toml++ so that only the loader compiles its headers.
struct Value {
  enum class Kind { Int, Float, Bool, String, Array, Other };
  Kind kind = Kind::Other;
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;              // String; for Other, what it was (e.g. "date")
  std::vector<Value> items;   // Array

  static Value of_int(int64_t v);
  static Value of_float(double v);
  static Value of_bool(bool v);
  static Value of_string(std::string v);
  std::string toml() const;       // as a TOML literal
  std::string type_name() const;  // for messages: "integer", "float", ...
  double number() const { return kind == Kind::Int ? static_cast<double>(i) : f; }
  bool is_auto() const { return kind == Kind::String && s == "auto"; }
};

// Where a setting came from; later layers win.
enum class Layer { Default, Base, Recipe, CommandLine };

struct Source {
  Layer layer = Layer::Default;
  std::string file;  // recipe/base path, or the --set argument for the command line
  int line = 0, column = 0;
  std::string describe() const;  // "recipes/a.toml:3:1", "--set run.steps=5", "default"
};

struct Setting {
  Value value;
  Source source;
};

// Dotted key -> setting, sorted; the resolved config of a run is exactly this map.
using Config = std::map<std::string, Setting>;

// How a warning about what this machine lacks (a data file) ends: `plan` only warns (it may plan
// for another machine), while `run` and `resume` refuse to start ranks on such a recipe.
constexpr const char* kLackedHere = "a run here would fail";

struct Diagnostic {
  enum class Severity { Error, Warning } severity = Severity::Error;
  Source source;
  std::string key;
  std::string message;
  std::string fix;
  std::string format() const;  // "file:line:col: error: key: message\n    fix: ..."
};

struct LoadOptions {
  std::vector<std::string> overrides;  // "section.key=value", in command-line order
  HostFacts host;                      // fills hardware "auto" values
};

struct LoadedRecipe {
  Recipe recipe;                        // meaningful only when ok()
  Config config;                        // every schema key, defaults included
  std::vector<Diagnostic> diagnostics;  // errors and warnings: parsing first, then key checks in key order, then cross-key rules
  std::string text;                     // the recipe file's own text, as written
  std::vector<std::string> files;       // the recipe and every base it pulled in
  bool has_sweep = false;               // the file has a [sweep] section (for `dsrun sweep`; `run` ignores it)
  std::vector<AlertRule> alerts;        // its [[alerts]] (and its bases'), checked; the launcher's, not the ranks'

  bool ok() const;
  std::string report() const;           // every diagnostic, formatted, errors first
};

LoadedRecipe load_recipe_file(const std::string& path, const LoadOptions& options);
// For tests and the fuzzer: `name` is used in messages and to resolve relative bases.
LoadedRecipe load_recipe_text(const std::string& text, const std::string& name, const LoadOptions& options);
// The user's own alert rules for every run: the file $DSRUN_ALERTS names, else
// ~/.config/dsrun/alerts.toml if it exists ([[alerts]] and nothing else). Problems go to
// `diagnostics`, naming that file, line and key.
std::vector<AlertRule> load_user_alert_rules(std::vector<Diagnostic>& diagnostics);

// Throws dsrun::Error carrying the full report when the recipe has errors.
void require_valid(const LoadedRecipe& loaded);

// The schema's default for a key, typed as validation would type it (2 for a float key is 2.0).
Value default_value(const std::string& key);

// The resolved config as a nested TOML document (what `dsrun show` prints and the store keeps).
std::string config_to_toml(const Config& config);
// The config as one flat JSON object {"section.key": value} (the store queries it).
std::string config_to_json(const Config& config);

// Step 3 (build.cpp): typed Recipe from a schema-validated config, plus cross-key rules.
Recipe build_recipe(const Config& config, const HostFacts& host, const std::string& recipe_dir,
                    std::vector<Diagnostic>& diagnostics);

}  // namespace dsrun
