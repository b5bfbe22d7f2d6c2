#include "engine/hooks/hooks.hpp"

#include "engine/common/error.hpp"
#include "engine/common/text.hpp"

#include <toml++/toml.h>

#include <cmath>

namespace dsrun {

namespace {

nlohmann::json toml_to_json(const toml::node& n) {
  if (auto v = n.as_integer()) return v->get();
  if (auto v = n.as_floating_point()) return v->get();
  if (auto v = n.as_boolean()) return v->get();
  if (auto v = n.as_string()) return v->get();
  if (auto a = n.as_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& e : *a) out.push_back(toml_to_json(e));
    return out;
  }
  if (auto t = n.as_table()) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [k, e] : *t) out[std::string(k.str())] = toml_to_json(e);
    return out;
  }
  return nullptr;  // dates and times: not given to hooks
}

// A plain Lua value as TOML text for a --set override.
std::string toml_text(const nlohmann::json& v, const std::string& key) {
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number_float()) return format_double(v.get<double>(), 17);
  if (v.is_string()) return nlohmann::json(v.get<std::string>()).dump();  // a JSON string is a TOML basic string
  throw Error("on_plan: set[\"" + key + "\"] must be a boolean, number or string");
}

const char* const kActionKeys[] = {"stop", "save", "skip", "lr", "log", "metrics"};

}  // namespace

nlohmann::json hook_options_json(const HookOptions& options) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [key, text] : options.options) {
    toml::table t = toml::parse("v = " + text);
    out[key] = toml_to_json(*t.get("v"));
  }
  return out;
}

RecipeHooks::RecipeHooks(const HookOptions& options) : options_(options) {
  LuaSandboxOptions so;
  so.instruction_limit = options.instruction_limit;
  so.memory_limit_bytes = options.memory_limit_bytes;
  so.time_limit_seconds = options.time_limit_seconds;
  sandbox_ = std::make_unique<LuaSandbox>(options.script, so, nlohmann::json{{"options", hook_options_json(options)}});
}

void RecipeHooks::fail_or_disable(const std::string& hook, const Error& e) {
  if (options_.on_error == HookErrorPolicy::Fail) throw e;
  disabled_.insert(hook);
  errors_.push_back(std::string(e.what()) + " (hook " + hook + " disabled: hooks.on_error = \"disable\")");
}

bool RecipeHooks::defines(const std::string& hook) {
  if (disabled_.count(hook)) return false;
  try {
    return sandbox_->has_function(hook);
  } catch (const Error& e) {
    fail_or_disable(hook, e);
    return false;
  }
}

nlohmann::json RecipeHooks::guarded(const std::string& hook, const std::vector<nlohmann::json>& args) {
  if (!defines(hook)) return nullptr;
  try {
    return sandbox_->call(hook, args);
  } catch (const Error& e) {
    fail_or_disable(hook, e);
    return nullptr;
  }
}

HookActions RecipeHooks::actions_of(const std::string& hook, const nlohmann::json& result, bool may_skip) {
  HookActions a;
  if (result.is_null()) return a;
  try {
    auto bad = [&](const std::string& what) { throw Error("hook " + hook + ": " + what, ErrorContext{script(), 0, 0, "hooks.script", -1, "docs/hooks.md lists the actions"}); };
    if (!result.is_object()) bad("must return nil or a table of actions, not " + std::string(result.type_name()));
    for (const auto& [key, v] : result.items()) {
      if (key == "stop") {
        if (v.is_string()) a.stop = v.get<std::string>();
        else if (v.is_boolean()) a.stop = v.get<bool>() ? "stopped by hook " + hook : "";
        else bad("stop must be a reason (string) or true");
      } else if (key == "save") {
        if (!v.is_boolean()) bad("save must be true or false");
        a.save = v.get<bool>();
      } else if (key == "skip") {
        if (!may_skip) bad("skip is only possible from on_step (the update happens after it)");
        if (!v.is_boolean()) bad("skip must be true or false");
        a.skip = v.get<bool>();
      } else if (key == "lr") {
        if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) bad("lr must be a finite number >= 0");
        a.lr = v.get<double>();
      } else if (key == "log") {
        if (v.is_string()) a.logs.push_back(v.get<std::string>());
        else if (v.is_array()) {
          for (const auto& m : v) {
            if (!m.is_string()) bad("log must be a string or a list of strings");
            a.logs.push_back(m.get<std::string>());
          }
        } else {
          bad("log must be a string or a list of strings");
        }
        using L = HookOutputLimits;
        if (a.logs.size() > L::log_messages_per_call)
          bad("returned " + std::to_string(a.logs.size()) + " log messages; at most " + std::to_string(L::log_messages_per_call) + " per call");
        for (const auto& m : a.logs) {
          if (m.size() > L::log_message_bytes)
            bad("a log message of " + std::to_string(m.size()) + " bytes; at most " + std::to_string(L::log_message_bytes) + " (print() writes longer text to the rank's log)");
          log_bytes_ += static_cast<int64_t>(m.size());
        }
        if (log_bytes_ > L::log_bytes_per_run)
          bad("log messages passed " + std::to_string(L::log_bytes_per_run) + " bytes in this run; log less often (they become events in the store)");
      } else if (key == "metrics") {
        if (!v.is_object()) bad("metrics must be a table of name = number");
        using L = HookOutputLimits;
        if (v.size() > L::metrics_per_call)
          bad(std::to_string(v.size()) + " custom metrics in one call; at most " + std::to_string(L::metrics_per_call));
        for (const auto& [name, value] : v.items()) {
          if (name.empty() || name.size() > L::metric_name_bytes)
            bad("a metric name must have 1 to " + std::to_string(L::metric_name_bytes) + " bytes: \"" + name.substr(0, 80) + "\"");
          if (!value.is_number()) bad("metrics." + name + " must be a number");
          a.metrics[name] = value.get<double>();
        }
      } else {
        std::vector<std::string> known(std::begin(kActionKeys), std::end(kActionKeys));
        std::string guess = nearest(key, known);
        bad("unknown action \"" + key + "\"" + (guess.empty() ? "" : " (did you mean " + guess + "?)"));
      }
    }
  } catch (const Error& e) {
    fail_or_disable(hook, e);
    return HookActions{};
  }
  return a;
}

PlanVerdict RecipeHooks::on_plan(const nlohmann::json& plan) {
  PlanVerdict v;
  nlohmann::json r = guarded("on_plan", {plan});
  if (r.is_null()) return v;
  auto bad = [&](const std::string& what) { throw Error("hook on_plan: " + what, ErrorContext{script(), 0, 0, "hooks.script", -1, "return nil, a reason (string), {reject = \"...\"} or {set = {[\"batch.micro\"] = 2}}"}); };
  if (r.is_string()) {
    v.reject = r.get<std::string>();
    return v;
  }
  if (!r.is_object()) bad("must return nil, a string or a table");
  for (const auto& [key, value] : r.items()) {
    if (key == "reject") {
      if (!value.is_string()) bad("reject must be a string");
      v.reject = value.get<std::string>();
    } else if (key == "set") {
      if (!value.is_object()) bad("set must be a table of \"section.key\" = value");
      for (const auto& [k, x] : value.items()) v.sets.push_back(k + "=" + toml_text(x, k));
    } else {
      bad("unknown field \"" + key + "\" (reject, set)");
    }
  }
  return v;
}

void RecipeHooks::on_start(const nlohmann::json& ctx) { guarded("on_start", {ctx}); }

HookActions RecipeHooks::on_step(const nlohmann::json& ctx) { return actions_of("on_step", guarded("on_step", {ctx}), true); }

HookActions RecipeHooks::on_eval(const nlohmann::json& ctx, const nlohmann::json& metrics) {
  return actions_of("on_eval", guarded("on_eval", {ctx, metrics}), false);
}

void RecipeHooks::on_checkpoint(const nlohmann::json& ctx) { guarded("on_checkpoint", {ctx}); }

void RecipeHooks::on_end(const nlohmann::json& ctx, const nlohmann::json& summary) { guarded("on_end", {ctx, summary}); }

std::optional<double> RecipeHooks::lr(int64_t step, const nlohmann::json& ctx) {
  if (!defines("lr")) return std::nullopt;
  nlohmann::json r = guarded("lr", {step, ctx});
  if (r.is_null()) return std::nullopt;
  if (!r.is_number() || !std::isfinite(r.get<double>()) || r.get<double>() < 0) {
    fail_or_disable("lr", Error("hook lr: must return a finite number >= 0 (or nil for the recipe's schedule), got " + r.dump().substr(0, 200),
                                ErrorContext{script(), 0, 0, "hooks.script", -1, ""}));
    return std::nullopt;
  }
  return r.get<double>();
}

std::map<std::string, double> RecipeHooks::metrics(const nlohmann::json& ctx) {
  nlohmann::json r = guarded("metrics", {ctx});
  if (r.is_null()) return {};
  return actions_of("metrics", nlohmann::json{{"metrics", r}}, false).metrics;
}

std::string RecipeHooks::save_state() {
  try {
    last_state_ = sandbox_->get_global("state").dump();
  } catch (const Error& e) {
    if (options_.on_error == HookErrorPolicy::Fail) throw;
    // The hooks go on; a checkpoint keeps the last state that could be saved.
    errors_.push_back(std::string(e.what()) + " (hooks.on_error = \"disable\": the checkpoint keeps the last hook state that could be saved" +
                      (last_state_ == "null" ? ", none" : "") + ")");
  }
  return last_state_;
}

void RecipeHooks::restore_state(const std::string& json_text) {
  if (json_text.empty()) return;
  nlohmann::json state = nlohmann::json::parse(json_text, nullptr, false);
  if (state.is_discarded()) throw Error("hook state in the checkpoint is not valid JSON", ErrorContext{script(), 0, 0, "hooks.script", -1, ""});
  sandbox_->set_global("state", state.is_object() || state.is_array() ? state : nlohmann::json::object());
}

std::vector<std::string> RecipeHooks::take_errors() {
  std::vector<std::string> out;
  out.swap(errors_);
  return out;
}

}  // namespace dsrun
