// A Lua 5.4 state for recipe hooks that cannot hurt its host: only safe libraries, and one budget
// per call (instructions, wall-clock time, memory, output) that no Lua code or C function escapes.
// Values cross the boundary as JSON (tables <-> objects/arrays). docs/hooks.md says what it guarantees.
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
  double time_limit_seconds = 10;           // wall clock per call
  int64_t print_bytes_per_call = 64 << 10;  // print() output kept per call ...
  int64_t print_bytes_per_run = 1 << 20;    // ... and over the state's life; the rest is dropped, with one notice
  int64_t result_bytes = 16 << 20;          // a value leaving Lua, measured as JSON text
};

// An owned lua_State (closed on destruction).
struct LuaCloser {
  void operator()(lua_State* L) const;
};

class LuaSandbox {
 public:
  // Sets `globals` (a JSON object), then loads and runs the script's top level. Throws dsrun::Error
  // with script:line on syntax or runtime errors, or when a budget is exceeded.
  LuaSandbox(const std::string& script_path, const LuaSandboxOptions& options, const nlohmann::json& globals = nlohmann::json::object());
  ~LuaSandbox();
  LuaSandbox(const LuaSandbox&) = delete;
  LuaSandbox& operator=(const LuaSandbox&) = delete;

  bool has_function(const std::string& name);
  // Calls the global function `name` with `args`; returns its first result (null for nil).
  // Errors: dsrun::Error "hook NAME: script:line: message", key hooks.script.
  nlohmann::json call(const std::string& name, const std::vector<nlohmann::json>& args);
  nlohmann::json get_global(const std::string& name);
  void set_global(const std::string& name, const nlohmann::json& value);
  const std::string& script() const { return script_; }
  double memory_used() const;

  // What one call may spend, and what it has spent; public for the C callbacks.
  struct Budget {
    LuaSandboxOptions limits;
    int64_t used = 0;            // instructions this call
    double deadline = 0;         // steady-clock seconds; 0 while no call runs
    bool timed_out = false;
    double memory_used = 0;
    int64_t printed_call = 0, printed_run = 0;
    bool call_notice_given = false, run_notice_given = false;
  };
  // What a protected call does: run the loaded chunk, or call, set, read or test global `name`.
  enum class Op { RunChunk, Call, Set, Get, IsFunction };

 private:
  // Runs one operation on global `name` inside lua_pcall with the budget armed.
  void run_protected(Op op, const std::string& name, const std::vector<nlohmann::json>& args, const std::string& what);
  nlohmann::json result_to_json(const std::string& what, const std::string& path);
  std::string script_;
  std::unique_ptr<Budget> budget_;
  std::unique_ptr<lua_State, LuaCloser> L_;
};

// The worst-case number of steps a Lua pattern may take on a subject of `subject_length` bytes
// (each quantifier followed by more pattern can backtrack over the subject). Saturates at 1e30.
double lua_pattern_cost(const std::string& pattern, size_t subject_length, bool anchored_search);

}  // namespace dsrun
