#include "engine/hooks/lua_sandbox.hpp"

#include "engine/common/error.hpp"

#include <lua.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace dsrun {

namespace {

constexpr int kCountStep = 1000;  // instructions between budget checks
constexpr int kMaxDepth = 32;      // nesting of converted tables (a cycle ends here)

LuaSandbox::Budget& budget_of(lua_State* L) {
  void* ud = nullptr;
  lua_getallocf(L, &ud);
  return *static_cast<LuaSandbox::Budget*>(ud);
}

// The allocator enforces the memory cap: a refused allocation becomes Lua's "not enough memory".
void* capped_alloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* b = static_cast<LuaSandbox::Budget*>(ud);
  const double old = ptr ? static_cast<double>(osize) : 0.0;  // without ptr, osize is a type tag
  if (nsize == 0) {
    b->memory_used -= old;
    std::free(ptr);
    return nullptr;
  }
  if (static_cast<double>(nsize) > old && b->memory_used + (static_cast<double>(nsize) - old) > b->memory_limit) return nullptr;
  void* p = std::realloc(ptr, nsize);
  if (p) b->memory_used += static_cast<double>(nsize) - old;
  return p;
}

// Every kCountStep instructions. Once the budget is spent it fires on every instruction, so a
// script that catches the error with pcall is stopped again at its next instruction outside it.
void count_hook(lua_State* L, lua_Debug*) {
  LuaSandbox::Budget& b = budget_of(L);
  b.used += b.exhausted ? 1 : kCountStep;
  if (b.used <= b.limit) return;
  if (!b.exhausted) {
    b.exhausted = true;
    lua_sethook(L, count_hook, LUA_MASKCOUNT, 1);
  }
  luaL_error(L, "instruction limit of %I exceeded (hooks.instruction_limit)", static_cast<lua_Integer>(b.limit));
}

// load() for text chunks only: no reader functions, no bytecode.
int safe_load(lua_State* L) {
  size_t length = 0;
  const char* text = luaL_checklstring(L, 1, &length);
  const char* name = luaL_optstring(L, 2, "=(load)");
  if (luaL_loadbufferx(L, text, length, name, "t") != LUA_OK) {
    luaL_pushfail(L);
    lua_insert(L, -2);
    return 2;  // nil, message
  }
  if (!lua_isnoneornil(L, 4)) {  // an environment for the chunk
    lua_pushvalue(L, 4);
    if (!lua_setupvalue(L, -2, 1)) lua_pop(L, 1);
  }
  return 1;
}

void remove_field(lua_State* L, const char* table, const char* field) {
  lua_getglobal(L, table);
  if (lua_istable(L, -1)) {
    lua_pushnil(L);
    lua_setfield(L, -2, field);
  }
  lua_pop(L, 1);
}

[[noreturn]] void lua_failure(const std::string& script, const std::string& what, const std::string& message, const char* file, int line) {
  ErrorContext c;
  c.file = script;
  c.key = "hooks.script";
  c.hint = "fix the script; docs/hooks.md lists what hooks may use";
  (void)file;
  (void)line;
  throw Error(what + ": " + message, c);
}

// Checks a Lua return code; the message Lua left on the stack says where in the script.
#define DSRUN_LUA_CHECK(L, rc, what)                                                                     \
  do {                                                                                                   \
    const int dsrun_lua_rc = (rc);                                                                       \
    if (dsrun_lua_rc != LUA_OK) {                                                                        \
      std::string dsrun_lua_msg = lua_isstring((L), -1) ? lua_tostring((L), -1) : "(error object is not a string)"; \
      lua_pop((L), 1);                                                                                   \
      if (dsrun_lua_rc == LUA_ERRMEM) dsrun_lua_msg += " (memory cap hooks.memory_limit_mb reached)";      \
      lua_failure(script_, (what), dsrun_lua_msg, __FILE__, __LINE__);                                   \
    }                                                                                                    \
  } while (0)

// Runs inside a protected call (raises Lua errors, never C++ exceptions): memory errors while
// building the arguments must not escape to Lua's panic handler.
void push_json(lua_State* L, const nlohmann::json& v, int depth) {
  luaL_checkstack(L, 4, "converting a value for a hook");
  if (depth > kMaxDepth) luaL_error(L, "value nested deeper than %d levels", kMaxDepth);
  switch (v.type()) {
    case nlohmann::json::value_t::null: lua_pushnil(L); break;
    case nlohmann::json::value_t::boolean: lua_pushboolean(L, v.get<bool>()); break;
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: lua_pushinteger(L, v.get<lua_Integer>()); break;
    case nlohmann::json::value_t::number_float: lua_pushnumber(L, v.get<double>()); break;
    case nlohmann::json::value_t::string: lua_pushstring(L, v.get_ref<const std::string&>().c_str()); break;
    case nlohmann::json::value_t::array: {
      lua_createtable(L, static_cast<int>(v.size()), 0);
      lua_Integer i = 1;
      for (const auto& e : v) {
        push_json(L, e, depth + 1);
        lua_rawseti(L, -2, i++);
      }
      break;
    }
    case nlohmann::json::value_t::object: {
      lua_createtable(L, 0, static_cast<int>(v.size()));
      for (const auto& [k, e] : v.items()) {
        push_json(L, e, depth + 1);
        lua_setfield(L, -2, k.c_str());
      }
      break;
    }
    default: lua_pushnil(L);
  }
}

// The value at `index` as JSON. Arrays are tables with keys 1..n exactly; other tables need
// string keys. Functions, coroutines and userdata cannot cross.
nlohmann::json to_json(lua_State* L, int index, int depth, const std::string& path) {
  index = lua_absindex(L, index);
  if (depth > kMaxDepth) throw Error(path + ": nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  switch (lua_type(L, index)) {
    case LUA_TNIL: return nullptr;
    case LUA_TBOOLEAN: return static_cast<bool>(lua_toboolean(L, index));
    case LUA_TNUMBER:
      if (lua_isinteger(L, index)) return static_cast<int64_t>(lua_tointeger(L, index));
      return lua_tonumber(L, index);
    case LUA_TSTRING: return std::string(lua_tostring(L, index));
    case LUA_TTABLE: {
      luaL_checkstack(L, 4, "converting a table");
      const lua_Integer n = static_cast<lua_Integer>(lua_rawlen(L, index));
      lua_Integer count = 0;
      bool only_integer_keys = true;
      lua_pushnil(L);
      while (lua_next(L, index) != 0) {
        ++count;
        only_integer_keys &= lua_type(L, -2) == LUA_TNUMBER && lua_isinteger(L, -2);
        lua_pop(L, 1);
      }
      if (count > 0 && only_integer_keys && count == n) {
        nlohmann::json a = nlohmann::json::array();
        for (lua_Integer i = 1; i <= n; ++i) {
          lua_rawgeti(L, index, i);
          a.push_back(to_json(L, -1, depth + 1, path + "[" + std::to_string(i) + "]"));
          lua_pop(L, 1);
        }
        return a;
      }
      nlohmann::json o = nlohmann::json::object();
      lua_pushnil(L);
      while (lua_next(L, index) != 0) {
        if (lua_type(L, -2) != LUA_TSTRING) {
          lua_pop(L, 2);
          throw Error(path + ": a table key that is not a string (only strings and array indices 1..n can be kept)");
        }
        const std::string key = lua_tostring(L, -2);
        o[key] = to_json(L, -1, depth + 1, path + "." + key);
        lua_pop(L, 1);
      }
      return o;
    }
    default: throw Error(path + ": a " + std::string(luaL_typename(L, index)) + " cannot leave the hook (only nil, booleans, numbers, strings and tables)");
  }
}

// What a protected trampoline does: call global `name` with `args` (1 result), or set it.
struct CallRequest {
  const std::string* name;
  const std::vector<nlohmann::json>* args;
  bool set = false;  // set_global: args[0] becomes global `name`
};

int call_trampoline(lua_State* L) {
  auto* req = static_cast<CallRequest*>(lua_touserdata(L, 1));
  lua_settop(L, 0);
  if (req->set) {
    push_json(L, (*req->args)[0], 0);
    lua_setglobal(L, req->name->c_str());
    return 0;
  }
  lua_getglobal(L, req->name->c_str());
  for (const auto& a : *req->args) push_json(L, a, 0);
  lua_call(L, static_cast<int>(req->args->size()), 1);
  return 1;
}

}  // namespace

void LuaCloser::operator()(lua_State* L) const { lua_close(L); }

LuaSandbox::LuaSandbox(const std::string& script_path, const LuaSandboxOptions& options, const nlohmann::json& globals) : script_(script_path), budget_(std::make_unique<Budget>()) {
  budget_->limit = options.instruction_limit;
  budget_->memory_limit = options.memory_limit_bytes;
  L_.reset(lua_newstate(capped_alloc, budget_.get()));
  if (!L_) throw Error("cannot create a Lua state (memory cap too small?)", ErrorContext{script_, 0, 0, "hooks.memory_limit_mb", -1, "raise hooks.memory_limit_mb"});
  lua_State* L = L_.get();
  // Safe libraries only: no io, os beyond time and clock, package/require, debug.
  const std::pair<const char*, lua_CFunction> libraries[] = {{LUA_GNAME, luaopen_base}, {LUA_TABLIBNAME, luaopen_table}, {LUA_STRLIBNAME, luaopen_string},
                                                             {LUA_MATHLIBNAME, luaopen_math}, {LUA_UTF8LIBNAME, luaopen_utf8}, {LUA_COLIBNAME, luaopen_coroutine},
                                                             {LUA_OSLIBNAME, luaopen_os}};
  for (const auto& [name, open] : libraries) {
    luaL_requiref(L, name, open, 1);
    lua_pop(L, 1);
  }
  for (const char* f : {"dofile", "loadfile", "collectgarbage"}) {
    lua_pushnil(L);
    lua_setglobal(L, f);
  }
  lua_pushcfunction(L, safe_load);
  lua_setglobal(L, "load");
  remove_field(L, LUA_STRLIBNAME, "dump");
  lua_newtable(L);  // os: time and clock only
  for (const char* f : {"time", "clock"}) {
    lua_getglobal(L, LUA_OSLIBNAME);
    lua_getfield(L, -1, f);
    lua_setfield(L, -3, f);
    lua_pop(L, 1);
  }
  lua_setglobal(L, LUA_OSLIBNAME);
  lua_newtable(L);  // the table hooks keep across calls, saved in checkpoints
  lua_setglobal(L, "state");
  lua_sethook(L, count_hook, LUA_MASKCOUNT, kCountStep);
  for (const auto& [name, value] : globals.items()) set_global(name, value);

  DSRUN_LUA_CHECK(L, luaL_loadfilex(L, script_.c_str(), "t"), "loading the hook script");
  run_protected(0, 0, "running the hook script's top level");
}

LuaSandbox::~LuaSandbox() = default;

void LuaSandbox::run_protected(int args, int results, const std::string& what) {
  lua_State* L = L_.get();
  budget_->used = 0;
  if (budget_->exhausted) {
    budget_->exhausted = false;
    lua_sethook(L, count_hook, LUA_MASKCOUNT, kCountStep);
  }
  DSRUN_LUA_CHECK(L, lua_pcall(L, args, results, 0), what);
}

bool LuaSandbox::has_function(const std::string& name) const {
  lua_State* L = L_.get();
  lua_getglobal(L, name.c_str());
  const bool yes = lua_isfunction(L, -1);
  lua_pop(L, 1);
  return yes;
}

nlohmann::json LuaSandbox::call(const std::string& name, const std::vector<nlohmann::json>& args) {
  lua_State* L = L_.get();
  const int top = lua_gettop(L);
  lua_getglobal(L, name.c_str());
  if (!lua_isfunction(L, -1)) {
    lua_settop(L, top);
    throw Error("hook " + name + " is not a function in " + script_);
  }
  lua_pop(L, 1);
  CallRequest req{&name, &args, false};
  lua_pushcfunction(L, call_trampoline);
  lua_pushlightuserdata(L, &req);
  run_protected(1, 1, "hook " + name);
  nlohmann::json result;
  try {
    result = to_json(L, -1, 0, name + "'s result");
  } catch (const Error& e) {
    lua_settop(L, top);
    lua_failure(script_, "hook " + name, e.what(), __FILE__, __LINE__);
  }
  lua_settop(L, top);
  return result;
}

nlohmann::json LuaSandbox::get_global(const std::string& name) {
  lua_State* L = L_.get();
  const int top = lua_gettop(L);
  lua_getglobal(L, name.c_str());
  nlohmann::json v;
  try {
    v = to_json(L, -1, 0, name);
  } catch (const Error& e) {
    lua_settop(L, top);
    lua_failure(script_, "saving the hook state", e.what(), __FILE__, __LINE__);
  }
  lua_settop(L, top);
  return v;
}

void LuaSandbox::set_global(const std::string& name, const nlohmann::json& value) {
  lua_State* L = L_.get();
  std::vector<nlohmann::json> args{value};
  CallRequest req{&name, &args, true};
  lua_pushcfunction(L, call_trampoline);
  lua_pushlightuserdata(L, &req);
  run_protected(1, 0, "setting " + name + " for the hooks");
}

double LuaSandbox::memory_used() const { return budget_->memory_used; }

}  // namespace dsrun
