#include "engine/recipe/load.hpp"

#include <nlohmann/json.hpp>

#include "engine/common/environment.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/schema.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

namespace dsrun {

// ---------------------------------------------------------------- Value, Source, Diagnostic

Value Value::of_int(int64_t v) { Value x; x.kind = Kind::Int; x.i = v; return x; }
Value Value::of_float(double v) { Value x; x.kind = Kind::Float; x.f = v; return x; }
Value Value::of_bool(bool v) { Value x; x.kind = Kind::Bool; x.b = v; return x; }
Value Value::of_string(std::string v) { Value x; x.kind = Kind::String; x.s = std::move(v); return x; }

static std::string quote_toml(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string Value::toml() const {
  switch (kind) {
    case Kind::Int: return std::to_string(i);
    case Kind::Float: {
      if (std::isnan(f)) return "nan";
      if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
      std::string t = format_double_exact(f);
      if (t.find_first_of(".e") == std::string::npos) t += ".0";  // stays a TOML float
      return t;
    }
    case Kind::Bool: return b ? "true" : "false";
    case Kind::String: return quote_toml(s);
    case Kind::Array: {
      std::vector<std::string> parts;
      for (const auto& item : items) parts.push_back(item.toml());
      return "[" + join(parts, ", ") + "]";
    }
    case Kind::Other: return quote_toml(s);
  }
  return "";
}

std::string Value::type_name() const {
  switch (kind) {
    case Kind::Int: return "integer";
    case Kind::Float: return "float";
    case Kind::Bool: return "boolean";
    case Kind::String: return "string";
    case Kind::Array: return "array";
    case Kind::Other: return s;
  }
  return "?";
}

std::string Source::describe() const {
  switch (layer) {
    case Layer::Default: return "(default)";
    case Layer::CommandLine: return "command line (--set " + file + ")";
    default: break;
  }
  std::string out = file;
  if (line > 0) out += ":" + std::to_string(line);
  if (column > 0) out += ":" + std::to_string(column);
  return out;
}

std::string Diagnostic::format() const {
  std::string out = source.describe() + ": " + (severity == Severity::Error ? "error: " : "warning: ");
  if (!key.empty()) out += key + ": ";
  out += message;
  if (!fix.empty()) out += "\n    fix: " + fix;
  return out;
}

bool LoadedRecipe::ok() const {
  for (const auto& d : diagnostics)
    if (d.severity == Diagnostic::Severity::Error) return false;
  return true;
}

std::string LoadedRecipe::report() const {
  std::string out;
  int errors = 0;
  for (auto severity : {Diagnostic::Severity::Error, Diagnostic::Severity::Warning})
    for (const auto& d : diagnostics)
      if (d.severity == severity) {
        out += d.format() + "\n";
        errors += severity == Diagnostic::Severity::Error;
      }
  if (errors) out += std::to_string(errors) + (errors == 1 ? " error" : " errors") + " in the recipe; nothing was run.\n";
  return out;
}

void require_valid(const LoadedRecipe& loaded) {
  if (loaded.ok()) return;
  ErrorContext c;
  c.file = loaded.recipe.path;
  throw Error("invalid recipe\n" + loaded.report(), c);
}

// ---------------------------------------------------------------- parse: TOML -> flat config

namespace {

constexpr int kMaxBaseDepth = 16;

Value to_value(const toml::node& node) {
  if (auto v = node.as_integer()) return Value::of_int(v->get());
  if (auto v = node.as_floating_point()) return Value::of_float(v->get());
  if (auto v = node.as_boolean()) return Value::of_bool(v->get());
  if (auto v = node.as_string()) return Value::of_string(v->get());
  if (auto arr = node.as_array()) {
    Value out;
    out.kind = Value::Kind::Array;
    for (const auto& item : *arr) out.items.push_back(to_value(item));
    return out;
  }
  Value other;
  other.kind = Value::Kind::Other;
  other.s = node.is_table() ? "table" : node.is_date() ? "date" : node.is_time() ? "time" : "date-time";
  return other;
}

// Where a TOML node was written.
Source source_of(const toml::node& node, Layer layer, const std::string& file) {
  Source s;
  s.layer = layer;
  s.file = file;
  s.line = static_cast<int>(node.source().begin.line);
  s.column = static_cast<int>(node.source().begin.column);
  return s;
}

// ---------------------------------------------------------------- [[alerts]]

// Each table of an [[alerts]] array as an AlertRule; every problem an error naming file, line and key.
void parse_alert_rules(const toml::node& node, Layer layer, const std::string& file, std::vector<AlertRule>& out, std::vector<Diagnostic>& diagnostics) {
  auto where = [&](const toml::node& n) { return source_of(n, layer, file); };
  auto error = [&](const toml::node& n, const std::string& key, const std::string& message, const std::string& fix) {
    diagnostics.push_back({Diagnostic::Severity::Error, where(n), key, message, fix});
  };
  const toml::array* rules = node.as_array();
  if (!rules || !rules->is_array_of_tables()) {
    error(node, "alerts", "alerts is a list of rules, one table each", "write each rule as [[alerts]] followed by its keys (docs/alerts.md)");
    return;
  }
  static const std::vector<std::string> keys = {"on", "name", "when", "minutes", "url", "run"};
  for (const toml::node& each : *rules) {
    const toml::table& t = *each.as_table();
    AlertRule r;
    r.written_at = where(each).describe();
    bool ok = true;
    for (auto&& [k, v] : t) {
      const std::string key(k.str());
      if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
        const std::string guess = nearest(key, keys);
        error(v, "alerts." + key, "unknown key in an alert rule", (guess.empty() ? std::string() : "did you mean " + guess + "? ") + "an alert rule takes on, name, when, minutes, url and run");
        ok = false;
      }
    }
    const toml::node* on = t.get("on");
    const std::optional<AlertOn> kind = on && on->is_string() ? enum_from_string<AlertOn>(**on->as_string()) : std::nullopt;
    if (!kind) {
      const std::string given = on && on->is_string() ? **on->as_string() : "";
      error(on ? *on : each, "alerts.on", on ? "unknown alert \"" + given + "\"" : "an alert rule needs `on`",
            "on = one of: " + join(enum_names<AlertOn>(), ", ") + (given.empty() ? "" : " (did you mean " + nearest(given, enum_names<AlertOn>()) + "?)"));
      ok = false;
    } else {
      r.on = *kind;
    }
    if (const toml::node* n = t.get("name")) {
      if (n->is_string()) r.name = **n->as_string();
      else error(*n, "alerts.name", "name is a string", "name = \"loss diverged\""), ok = false;
    }
    if (const toml::node* w = t.get("when")) {
      if (w->is_string() && !(**w->as_string()).empty()) r.when = **w->as_string();
      else error(*w, "alerts.when", "when is a condition as `dsrun history --where` takes it", "when = \"val_loss > 3.0\""), ok = false;
    }
    if (const toml::node* m = t.get("minutes")) {
      const std::optional<double> v = m->value<double>();
      if (v && std::isfinite(*v) && *v > 0) r.minutes = *v;
      else error(*m, "alerts.minutes", "minutes is a positive number", "minutes = 10"), ok = false;
    }
    if (const toml::node* u = t.get("url")) {
      const std::string url = u->is_string() ? **u->as_string() : "";
      if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) r.url = url;
      else error(*u, "alerts.url", "url is an http:// or https:// address to POST the alert to", "url = \"https://hooks.slack.com/services/...\""), ok = false;
    }
    if (const toml::node* c = t.get("run")) {
      const toml::array* argv = c->as_array();
      if (argv && !argv->empty())
        for (const toml::node& a : *argv)
          if (a.is_string()) r.command.push_back(**a.as_string());
      if (!argv || argv->empty() || r.command.size() != argv->size()) {
        error(*c, "alerts.run", "run is a program and its arguments, a list of strings (run without a shell; the alert comes on its stdin as JSON)",
              "run = [\"notify-send\", \"dsrun\"]");
        ok = false;
      }
    }
    if (kind && ok) {
      if (r.on == AlertOn::Metric && r.when.empty()) error(each, "alerts.when", "an `on = \"metric\"` rule needs `when`", "when = \"val_loss > 3.0\""), ok = false;
      if (r.on != AlertOn::Metric && !r.when.empty()) error(*t.get("when"), "alerts.when", "only `on = \"metric\"` rules take `when`", "remove when, or set on = \"metric\""), ok = false;
      if (r.on == AlertOn::Stalled && r.minutes <= 0) error(each, "alerts.minutes", "an `on = \"stalled\"` rule needs `minutes`", "minutes = 10"), ok = false;
      if (r.on != AlertOn::Stalled && r.minutes > 0) error(*t.get("minutes"), "alerts.minutes", "only `on = \"stalled\"` rules take `minutes`", "remove minutes"), ok = false;
      if (r.url.empty() && r.command.empty()) error(each, "alerts", "an alert rule needs somewhere to go: url (a webhook) or run (a program)", "url = \"https://...\" or run = [\"program\", \"arg\"]"), ok = false;
    }
    if (!ok) continue;
    if (r.name.empty()) {
      std::ostringstream minutes;
      minutes << r.minutes;
      r.name = r.on == AlertOn::Metric ? r.when : r.on == AlertOn::Stalled ? "no step for " + minutes.str() + " min" : to_string(r.on);
    }
    out.push_back(std::move(r));
  }
}

struct Parser {
  const LoadOptions& options;
  Config config;
  std::vector<Diagnostic> diagnostics;
  std::vector<std::string> files;
  std::vector<std::string> stack;  // bases being loaded, for cycle detection
  bool has_sweep = false;          // a [sweep] section was seen (and left to dsrun sweep)
  std::vector<AlertRule> alerts;   // [[alerts]], checked here (parse_alert_rules)

  void error(Source src, std::string key, std::string message, std::string fix = "") {
    diagnostics.push_back({Diagnostic::Severity::Error, std::move(src), std::move(key), std::move(message), std::move(fix)});
  }

  void flatten(const toml::table& table, const std::string& prefix, Layer layer, const std::string& file) {
    for (auto&& [k, node] : table) {
      // A [sweep] section belongs to `dsrun sweep` (engine/sweep reads it); the recipe is the rest.
      if (prefix.empty() && k.str() == "sweep" && node.is_table()) {
        has_sweep = true;
        continue;
      }
      if (prefix.empty() && k.str() == "alerts") {  // rules for the launcher, not config keys
        parse_alert_rules(node, layer, file, alerts, diagnostics);
        continue;
      }
      std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
      if (const toml::table* sub = node.as_table()) {
        flatten(*sub, key, layer, file);
        continue;
      }
      config[key] = Setting{to_value(node), source_of(node, layer, file)};
    }
  }

  std::string find_base(const std::string& name, const std::string& including_dir, const Source& where) {
    std::string templates = templates_directory();
    std::vector<std::string> candidates;
    if (ends_with(name, ".toml")) {
      candidates = {path_join(including_dir, name), path_join(templates, name)};
    } else {
      candidates = {path_join(templates, name + ".toml"), path_join(including_dir, name + ".toml")};
    }
    for (const auto& c : candidates)
      if (file_exists(c) && !is_directory(c)) return c;
    std::vector<std::string> known;
    for (const char* kind : {"hardware", "models", "recipes"}) {
      std::string dir = path_join(templates, kind);
      if (!is_directory(dir)) continue;
      for (const auto& f : list_directory(dir))
        if (ends_with(f, ".toml")) known.push_back(std::string(kind) + "/" + file_stem(f));
    }
    std::string guess = nearest(name, known);
    error(where, "base", "no template or file named \"" + name + "\"",
          guess.empty() ? "`dsrun templates` lists the templates; a path is relative to the recipe"
                        : "did you mean \"" + guess + "\"?");
    return "";
  }

  // Parses one document (the recipe or a base), loading its own bases first.
  void load_document(const std::string& text, const std::string& file, Layer layer) {
    if (const size_t nul = text.find('\0'); nul != std::string::npos) {
      Source s;
      s.layer = layer;
      s.file = file;
      s.line = 1 + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<long>(nul), '\n'));
      const size_t line_start = text.rfind('\n', nul == 0 ? 0 : nul - 1);
      s.column = 1 + static_cast<int>(nul - (line_start == std::string::npos || nul == 0 ? 0 : line_start + 1));
      error(s, "", "a NUL byte; a recipe is UTF-8 text", "save the recipe as UTF-8 text (an editor or a binary copy left NUL bytes here)");
      return;
    }
    toml::table table;
    try {
      table = toml::parse(text, file);
    } catch (const toml::parse_error& e) {
      Source s;
      s.layer = layer;
      s.file = file;
      s.line = static_cast<int>(e.source().begin.line);
      s.column = static_cast<int>(e.source().begin.column);
      std::string hint = "check the TOML syntax at that position (strings need quotes; tables are [section])";
      if (starts_with(text, "\xFF\xFE") || starts_with(text, "\xFE\xFF"))
        hint = "the file looks like UTF-16; save it as UTF-8";
      error(s, "", "malformed TOML: " + std::string(e.description()), hint);
      return;
    }
    files.push_back(file);

    if (toml::node* base = table.get("base")) {
      Source where = source_of(*base, layer, file);
      std::vector<std::string> names;
      if (auto s = base->as_string()) {
        names.push_back(s->get());
      } else if (auto arr = base->as_array()) {
        for (auto& item : *arr) {
          if (auto s2 = item.as_string()) names.push_back(s2->get());
          else error(where, "base", "expected template names (strings), got " + to_value(item).type_name(),
                     "write base = [\"hardware/cpu\", \"models/deepseek-tiny\"]");
        }
      } else {
        error(where, "base", "expected a template name or an array of them, got " + to_value(*base).type_name(),
              "write base = \"models/deepseek-tiny\"");
      }
      for (const auto& name : names) load_base(name, parent_directory(file), where);
      table.erase("base");
    }
    flatten(table, "", layer, file);
  }

  void load_base(const std::string& name, const std::string& including_dir, const Source& where) {
    if (static_cast<int>(stack.size()) >= kMaxBaseDepth) {
      error(where, "base", "bases nest deeper than " + std::to_string(kMaxBaseDepth) + " levels", "flatten the chain of bases");
      return;
    }
    std::string path = find_base(name, including_dir, where);
    if (path.empty()) return;
    char* real = ::realpath(path.c_str(), nullptr);
    std::string canonical = real ? real : path;
    std::free(real);
    for (const auto& open : stack)
      if (open == canonical) {
        error(where, "base", "\"" + name + "\" includes itself (a cycle of bases)", "remove one of the base entries that form the cycle");
        return;
      }
    stack.push_back(canonical);
    load_document(read_file(path), path, Layer::Base);
    stack.pop_back();
  }

  void apply_override(const std::string& assignment) {
    Source src;
    src.layer = Layer::CommandLine;
    src.file = assignment;
    size_t eq = assignment.find('=');
    if (eq == std::string::npos || eq == 0) {
      error(src, "", "expected section.key=value", "write for example --set optimizer.lr=1e-3");
      return;
    }
    std::string key = trim(assignment.substr(0, eq));
    std::string text = trim(assignment.substr(eq + 1));
    Value value;
    try {
      toml::table t = toml::parse("v = " + text);
      value = to_value(*t.get("v"));
    } catch (const toml::parse_error&) {
      value = Value::of_string(text);  // bare words such as sgd or cuda are meant as strings
    }
    config[key] = Setting{value, src};
  }
};


// ---------------------------------------------------------------- validate: one key at a time

std::string range_text(const KeySpec& spec) {
  return format_double(spec.min, 10) + " .. " + format_double(spec.max, 10);
}

bool has_range(const KeySpec& spec) { return spec.min != 0 || spec.max != 0; }

// Checks a value against its spec; on success returns true with `out` normalised
// (integers given for float keys become floats).
bool check_value(const KeySpec& spec, const Setting& setting, Value& out, Parser& p) {
  const Value& v = setting.value;
  auto type_error = [&](const std::string& expected, const std::string& fix) {
    p.error(setting.source, spec.key, "expected " + expected + ", got " + v.type_name() + " " + v.toml(), fix);
    return false;
  };
  auto in_range = [&](double x) { return !has_range(spec) || (x >= spec.min && x <= spec.max); };
  auto range_error = [&](const std::string& shown) {
    p.error(setting.source, spec.key, "value " + shown + " is out of range " + range_text(spec),
            "use a value between " + format_double(spec.min, 10) + " and " + format_double(spec.max, 10));
    return false;
  };
  auto number_ok = [&](const Value& x, bool integer) {
    if (x.kind == Value::Kind::Float && !std::isfinite(x.f)) {
      p.error(setting.source, spec.key, "value " + x.toml() + " is not a finite number", "use a finite number");
      return false;
    }
    if (integer && x.kind != Value::Kind::Int) return false;
    if (!integer && x.kind != Value::Kind::Int && x.kind != Value::Kind::Float) return false;
    return true;
  };
  out = v;
  switch (spec.type) {
    case ValueType::Int:
    case ValueType::IntOrAuto:
      if (spec.type == ValueType::IntOrAuto && v.is_auto()) return true;
      if (!number_ok(v, true)) {
        if (v.kind == Value::Kind::Float && std::isfinite(v.f))
          return type_error(value_type_name(spec.type), "write a whole number without a decimal point");
        if (v.kind == Value::Kind::Float) return false;
        return type_error(value_type_name(spec.type), "write for example " + spec.key.substr(spec.key.rfind('.') + 1) + " = " + spec.default_toml);
      }
      return in_range(static_cast<double>(v.i)) ? true : range_error(v.toml());
    case ValueType::Float:
    case ValueType::FloatOrAuto:
      if (spec.type == ValueType::FloatOrAuto && v.is_auto()) return true;
      if (!number_ok(v, false)) {
        if (v.kind == Value::Kind::Float) return false;  // non-finite, already reported
        return type_error(value_type_name(spec.type), "write a number, e.g. " + spec.default_toml);
      }
      out = Value::of_float(v.number());
      return in_range(out.f) ? true : range_error(v.toml());
    case ValueType::Bool:
    case ValueType::BoolOrAuto:
      if (spec.type == ValueType::BoolOrAuto && v.is_auto()) return true;
      if (v.kind != Value::Kind::Bool) return type_error(value_type_name(spec.type), "write true or false (without quotes)" + std::string(spec.type == ValueType::BoolOrAuto ? ", or \"auto\"" : ""));
      return true;
    case ValueType::String:
      if (v.kind != Value::Kind::String) return type_error("string", "put the value in double quotes");
      return true;
    case ValueType::Choice: {
      if (v.kind != Value::Kind::String) return type_error("one of " + join(spec.choices, ", "), "put the value in double quotes");
      for (const auto& c : spec.choices)
        if (c == v.s) return true;
      std::string guess = nearest(v.s, spec.choices);
      p.error(setting.source, spec.key, "\"" + v.s + "\" is not one of " + join(spec.choices, ", "),
              guess.empty() ? "choose one of " + join(spec.choices, ", ") : "did you mean \"" + guess + "\"?");
      return false;
    }
    case ValueType::FloatList: {
      if (v.kind != Value::Kind::Array) return type_error("array of numbers", "write for example " + spec.default_toml);
      out.items.clear();
      for (const auto& item : v.items) {
        if (!number_ok(item, false)) {
          if (item.kind == Value::Kind::Float) return false;
          return type_error("array of numbers", "every element must be a number");
        }
        if (!in_range(item.number())) return range_error(item.toml());
        out.items.push_back(Value::of_float(item.number()));
      }
      return true;
    }
    case ValueType::StringList:
      if (v.kind != Value::Kind::Array) return type_error("array of strings", "write for example [\"a\", \"b\"]");
      for (const auto& item : v.items)
        if (item.kind != Value::Kind::String) return type_error("array of strings", "every element must be a quoted string");
      return true;
  }
  return false;
}

std::vector<std::string> all_keys() {
  std::vector<std::string> keys;
  for (const auto& s : recipe_schema()) keys.push_back(s.key);
  return keys;
}

}  // namespace

Value default_value(const std::string& key) {
  const KeySpec* spec = find_key_spec(key);
  DSRUN_ASSERT(spec, "default of an unknown key " + key);
  toml::table t = toml::parse("v = " + spec->default_toml);
  Setting raw{to_value(*t.get("v")), Source{}};
  Value normalised;
  LoadOptions none;
  Parser p{none, {}, {}, {}, {}, false, {}};
  DSRUN_ASSERT(check_value(*spec, raw, normalised, p), "the schema's default for " + key + " is valid");
  return normalised;
}

namespace {

bool is_section_name(const std::string& key) {
  for (const auto& s : recipe_sections())
    if (s.name == key) return true;
  return key == "model.moe" || key == "model.resnet" || key == "precision.loss_scale" || key == "hooks.options";
}

// Keys earlier versions of dsrun had: configs they wrote (checkpoint manifests, stored runs)
// still load, with a warning; the key is ignored.
const char* retired_key_explanation(const std::string& key) {
  static const std::map<std::string, const char*> retired = {
      {"hardware.expert_call_ms", "routed experts run as grouped matrix products now; the plan prices them with hardware.grouped_matmul_efficiency"},
  };
  auto it = retired.find(key);
  return it == retired.end() ? nullptr : it->second;
}

void report_unknown_key(const std::string& key, const Setting& setting, Parser& p) {
  if (const char* why = derived_key_explanation(key)) {
    p.error(setting.source, key, "this key cannot be set", std::string(why) + "; remove the key");
    return;
  }
  if (is_section_name(key)) {
    p.error(setting.source, key, "`" + key + "` is a section, not a value", "write [" + key + "] and put its keys below it");
    return;
  }
  std::vector<std::string> keys = all_keys();
  std::string guess = nearest(key, keys);
  if (guess.empty() && key_for_foreign_name(key)) guess = key_for_foreign_name(key);
  if (guess.empty()) {
    // Try the last component alone against keys of any section (e.g. "lr" written in [batch]).
    std::string leaf = key.substr(key.rfind('.') + 1);
    for (const auto& k : keys)
      if (k.substr(k.rfind('.') + 1) == leaf) guess = k;
  }
  std::string section = key.substr(0, key.find('.'));
  p.error(setting.source, key, "unknown key",
          guess.empty() ? "see docs/recipe.md for the keys of [" + section + "]" : "did you mean `" + guess + "`?");
}

LoadedRecipe finish(Parser& p, const std::string& name, std::string text) {
  LoadedRecipe out;
  out.text = std::move(text);
  for (const auto& o : p.options.overrides) p.apply_override(o);

  // Validate what was written, then fill the defaults underneath.
  Config validated;
  for (const auto& [key, setting] : p.config) {
    if (is_open_table_key(key)) {
      bool bare = key.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") == std::string::npos;
      if (!bare) p.error(setting.source, key, "hook option names may use letters, digits, _ and - only", "rename the option");
      else if (setting.value.kind == Value::Kind::Other)
        p.error(setting.source, key, "hook options take strings, numbers, booleans or arrays, not a " + setting.value.type_name(),
                "write the value as a string");
      else validated[key] = setting;
      continue;
    }
    const KeySpec* spec = find_key_spec(key);
    if (!spec && retired_key_explanation(key)) {
      p.diagnostics.push_back({Diagnostic::Severity::Warning, setting.source, key, std::string("no longer used: ") + retired_key_explanation(key), "remove the key"});
      continue;
    }
    if (!spec) {
      report_unknown_key(key, setting, p);
      continue;
    }
    Value normalised;
    if (check_value(*spec, setting, normalised, p)) validated[key] = Setting{normalised, setting.source};
  }
  bool schema_ok = true;
  for (const auto& d : p.diagnostics) schema_ok &= d.severity != Diagnostic::Severity::Error;
  for (const auto& spec : recipe_schema())
    if (!validated.count(spec.key)) {
      static const std::map<std::string, Value> defaults = [] {
        std::map<std::string, Value> all;
        for (const auto& k : recipe_schema()) all[k.key] = default_value(k.key);
        return all;
      }();
      Setting s;
      s.value = defaults.at(spec.key);
      validated[spec.key] = s;
    }

  out.recipe.path = name;
  if (schema_ok) {
    out.recipe = build_recipe(validated, p.options.host, parent_directory(name), p.diagnostics);
    out.recipe.path = name;
  }
  out.config = std::move(validated);
  out.diagnostics = std::move(p.diagnostics);
  out.files = std::move(p.files);
  out.has_sweep = p.has_sweep;
  out.alerts = std::move(p.alerts);
  return out;
}

}  // namespace

std::vector<AlertRule> load_user_alert_rules(std::vector<Diagnostic>& diagnostics) {
  std::string path = env_string("DSRUN_ALERTS", "");
  if (path.empty()) {
    const std::string home = env_string("HOME", "");
    if (home.empty()) return {};
    path = path_join(home, ".config/dsrun/alerts.toml");
    if (!file_exists(path)) return {};
  }
  std::vector<AlertRule> rules;
  Source file;
  file.file = path;
  if (!file_exists(path)) {
    diagnostics.push_back({Diagnostic::Severity::Error, file, "DSRUN_ALERTS", "no such file", "point DSRUN_ALERTS at a file of [[alerts]] rules, or unset it"});
    return rules;
  }
  try {
    const toml::table doc = toml::parse(read_file(path), path);
    for (auto&& [k, node] : doc) {
      if (k.str() == "alerts") {
        parse_alert_rules(node, Layer::Recipe, path, rules, diagnostics);
      } else {
        Source s = file;
        s.line = static_cast<int>(node.source().begin.line);
        diagnostics.push_back({Diagnostic::Severity::Error, s, std::string(k.str()), "an alerts file holds [[alerts]] rules only", "move other keys to a recipe"});
      }
    }
  } catch (const toml::parse_error& e) {
    file.line = static_cast<int>(e.source().begin.line);
    diagnostics.push_back({Diagnostic::Severity::Error, file, "alerts", std::string(e.description()), "fix the TOML syntax"});
  }
  return rules;
}

LoadedRecipe load_recipe_text(const std::string& text, const std::string& name, const LoadOptions& options) {
  Parser p{options, {}, {}, {}, {}, false, {}};
  p.load_document(text, name, Layer::Recipe);
  return finish(p, name, text);
}

LoadedRecipe load_recipe_file(const std::string& path, const LoadOptions& options) {
  if (!file_exists(path)) {
    ErrorContext c;
    c.file = path;
    c.hint = "check the path; `dsrun templates` lists the shipped templates";
    throw Error("recipe file not found", c);
  }
  return load_recipe_text(read_file(path), path, options);
}

namespace {
nlohmann::json value_json(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Int: return v.i;
    case Value::Kind::Float: return v.f;
    case Value::Kind::Bool: return v.b;
    case Value::Kind::String: return v.s;
    case Value::Kind::Array: {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& item : v.items) a.push_back(value_json(item));
      return a;
    }
    default: return v.s;
  }
}
}  // namespace

std::string config_to_json(const Config& config) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, setting] : config) j[key] = value_json(setting.value);
  return j.dump();
}

std::string config_to_toml(const Config& config) {
  // Group keys by their table (everything before the last dot) and print tables in key order.
  std::map<std::string, std::vector<std::pair<std::string, const Value*>>> tables;
  for (const auto& [key, setting] : config) {
    size_t dot = key.rfind('.');
    std::string table = dot == std::string::npos ? "" : key.substr(0, dot);
    std::string leaf = dot == std::string::npos ? key : key.substr(dot + 1);
    tables[table].push_back({leaf, &setting.value});
  }
  std::string out;
  for (const auto& [table, entries] : tables) {
    if (!table.empty()) out += (out.empty() ? "[" : "\n[") + table + "]\n";
    for (const auto& [leaf, value] : entries) {
      bool bare = !leaf.empty() && leaf.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") == std::string::npos;
      out += (bare ? leaf : quote_toml(leaf)) + " = " + value->toml() + "\n";
    }
  }
  return out;
}

}  // namespace dsrun
