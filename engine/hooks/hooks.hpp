// Recipe hooks: the Lua functions a recipe's script may define (on_plan, on_start, on_step,
// on_eval, on_checkpoint, on_end, lr, metrics), the actions they return, the error policy and the
// hook state. Torch-free; the launcher runs on_plan, rank 0 runs the rest (docs/hooks.md).
#pragma once

#include "engine/common/error.hpp"
#include "engine/hooks/lua_sandbox.hpp"
#include "engine/recipe/recipe.hpp"

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace dsrun {

// What one hook call may hand back, and one run in all (docs/hooks.md). Exceeding one is a hook
// error, under hooks.on_error like any other.
struct HookOutputLimits {
  static constexpr size_t log_messages_per_call = 16;
  static constexpr size_t log_message_bytes = 4096;
  static constexpr int64_t log_bytes_per_run = 1 << 20;
  static constexpr size_t metrics_per_call = 64;
  static constexpr size_t metric_name_bytes = 64;
};

// What on_step and on_eval may ask for. Rank 0 decides; every rank applies the same decision.
struct HookActions {
  std::string stop;                       // non-empty: stop the run after this step, with this reason
  bool save = false;                      // save a checkpoint after this step
  bool skip = false;                      // on_step: do not apply this step's update
  std::optional<double> lr;               // the learning rate from the next update on
  std::vector<std::string> logs;          // messages recorded as events
  std::map<std::string, double> metrics;  // recorded with the step's metrics
};

// on_plan's answer: nothing, a rejection, or settings to change (dotted keys, TOML values).
struct PlanVerdict {
  std::string reject;
  std::vector<std::string> sets;  // "section.key=value", applied like --set
};

class RecipeHooks {
 public:
  explicit RecipeHooks(const HookOptions& options);
  const std::string& script() const { return sandbox_->script(); }
  // Whether the script defines `hook` and it is not disabled. Looking it up runs script code (a
  // metatable on _G), so it is guarded like a call.
  bool defines(const std::string& hook);

  PlanVerdict on_plan(const nlohmann::json& plan);
  void on_start(const nlohmann::json& ctx);
  HookActions on_step(const nlohmann::json& ctx);
  HookActions on_eval(const nlohmann::json& ctx, const nlohmann::json& metrics);
  void on_checkpoint(const nlohmann::json& ctx);
  void on_end(const nlohmann::json& ctx, const nlohmann::json& summary);
  std::optional<double> lr(int64_t step, const nlohmann::json& ctx);  // nullopt: no lr hook (or disabled)
  std::map<std::string, double> metrics(const nlohmann::json& ctx);

  // The script's `state` table as JSON text, and back (checkpoints).
  std::string save_state();
  void restore_state(const std::string& json_text);

  // Errors of hooks disabled by hooks.on_error = "disable", since the last call (for events).
  std::vector<std::string> take_errors();

 private:
  // Calls `hook` under the error policy: fail rethrows; disable records, disables, returns null.
  nlohmann::json guarded(const std::string& hook, const std::vector<nlohmann::json>& args);
  // The error policy for an error of `hook`: "fail" rethrows; "disable" records and disables it.
  void fail_or_disable(const std::string& hook, const Error& e);
  HookActions actions_of(const std::string& hook, const nlohmann::json& result, bool may_skip);

  HookOptions options_;
  std::unique_ptr<LuaSandbox> sandbox_;
  std::set<std::string> disabled_;
  std::vector<std::string> errors_;
  int64_t log_bytes_ = 0;        // log text returned so far (capped per run)
  std::string last_state_ = "null";  // the last hook state that could be saved (JSON)
};

// The recipe's [hooks.options] as a JSON object (TOML values converted).
nlohmann::json hook_options_json(const HookOptions& options);

}  // namespace dsrun
