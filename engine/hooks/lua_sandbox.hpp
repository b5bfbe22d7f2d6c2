// A Lua 5.4 state for recipe hooks that cannot hurt its host: only safe libraries, an instruction
// budget per call and a memory cap. Values cross the boundary as JSON (tables <-> objects/arrays).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct lua_State;

namespace dsrun {

struct LuaSandboxOptions {
  int64_t instruction_limit = 10000000;     // per call (and for running the script's top level)
  double memory_limit_bytes = 64e6;         // the whole state
};

// An owned lua_State (closed on destruction).
struct LuaCloser {
  void operator()(lua_State* L) const;
};

class LuaSandbox {
 public:
  // Sets `globals` (a JSON object), then loads and runs the script's top level. Throws dsrun::Error
  // with script:line on syntax or runtime errors, or when the budget or memory cap is exceeded.
  LuaSandbox(const std::string& script_path, const LuaSandboxOptions& options, const nlohmann::json& globals = nlohmann::json::object());
  ~LuaSandbox();
  LuaSandbox(const LuaSandbox&) = delete;
  LuaSandbox& operator=(const LuaSandbox&) = delete;

  bool has_function(const std::string& name) const;
  // Calls the global function `name` with `args`; returns its first result (null for nil).
  // Errors: dsrun::Error "hook NAME: script:line: message", key hooks.script.
  nlohmann::json call(const std::string& name, const std::vector<nlohmann::json>& args);
  nlohmann::json get_global(const std::string& name);
  void set_global(const std::string& name, const nlohmann::json& value);
  const std::string& script() const { return script_; }
  double memory_used() const;

  // Budget accounting, public for the C callbacks.
  struct Budget {
    int64_t limit = 0, used = 0;
    bool exhausted = false;
    double memory_limit = 0, memory_used = 0;
  };

 private:
  void run_protected(int args, int results, const std::string& what);
  std::string script_;
  std::unique_ptr<Budget> budget_;
  std::unique_ptr<lua_State, LuaCloser> L_;
};

}  // namespace dsrun
