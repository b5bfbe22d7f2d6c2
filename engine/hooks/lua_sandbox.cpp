#include "engine/hooks/lua_sandbox.hpp"

#include "engine/common/clock.hpp"
#include "engine/common/error.hpp"

#include <lua.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <chrono>
#include <cstdio>

namespace dsrun {

namespace {

constexpr int kCountStep = 1000;       // instructions between budget checks
constexpr int kMaxDepth = 32;          // nesting of converted tables (a cycle ends here)
constexpr double kPatternSteps = 1e9;  // worst-case steps one pattern call may take (about a second)

LuaSandbox::Budget& budget_of(lua_State* L) {
  void* ud = nullptr;
  lua_getallocf(L, &ud);
  return *static_cast<LuaSandbox::Budget*>(ud);
}

// The allocator enforces the memory cap, and the deadline for C functions that allocate but run no
// Lua instructions: a refused allocation becomes Lua's "not enough memory", which the caller
// reports as the limit that was hit. Shrinking never fails (Lua relies on that).
void* capped_alloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* b = static_cast<LuaSandbox::Budget*>(ud);
  const double old = ptr ? static_cast<double>(osize) : 0.0;  // without ptr, osize is a type tag
  if (nsize == 0) {
    b->memory_used -= old;
    std::free(ptr);
    return nullptr;
  }
  if (static_cast<double>(nsize) > old) {
    if (b->memory_used + (static_cast<double>(nsize) - old) > b->limits.memory_limit_bytes) return nullptr;
    if (b->deadline > 0 && (b->timed_out || steady_seconds() > b->deadline)) {
      b->timed_out = true;
      return nullptr;
    }
  }
  void* p = std::realloc(ptr, nsize);
  if (p) b->memory_used += static_cast<double>(nsize) - old;
  return p;
}

// Every kCountStep instructions (every instruction once a limit is hit, on that thread): counts the
// instructions and reads the clock. Past a limit it raises on every instruction, so a script that
// catches the error with pcall is stopped again at its next instruction outside it.
void count_hook(lua_State* L, lua_Debug*) {
  LuaSandbox::Budget& b = budget_of(L);
  b.used += lua_gethookcount(L);
  const bool over = b.used > b.limits.instruction_limit;
  if (!over && !b.timed_out) {
    if (b.deadline <= 0 || steady_seconds() <= b.deadline) return;
    b.timed_out = true;
  }
  lua_sethook(L, count_hook, LUA_MASKCOUNT, 1);
  if (b.timed_out) luaL_error(L, "time limit of %f s exceeded (hooks.time_limit_s)", static_cast<lua_Number>(b.limits.time_limit_seconds));
  luaL_error(L, "instruction limit of %I exceeded (hooks.instruction_limit)", static_cast<lua_Integer>(b.limits.instruction_limit));
}

// Raises a Lua error with a message formatted by snprintf (lua_pushfstring knows few formats).
// Called only where no C++ object with a destructor is alive: the error unwinds with longjmp.
template <typename... A>
int raise(lua_State* L, const char* format, A... args) {
  char message[512];
  std::snprintf(message, sizeof message, format, args...);
  return luaL_error(L, "%s", message);
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

// setmetatable without finalizers: a __gc runs at collection or at lua_close, with hooks off,
// outside any budget. (An object is finalized only if its metatable had __gc when it was set.)
int safe_setmetatable(lua_State* L) {
  const int t = lua_type(L, 2);
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_argexpected(L, t == LUA_TNIL || t == LUA_TTABLE, 2, "nil or table");
  if (t == LUA_TTABLE) {
    lua_pushliteral(L, "__gc");
    const bool has_gc = lua_rawget(L, 2) != LUA_TNIL;
    lua_pop(L, 1);
    if (has_gc) return luaL_error(L, "setmetatable: __gc finalizers are not allowed in hooks (they would run outside the hook's budget)");
  }
  if (luaL_getmetafield(L, 1, "__metatable") != LUA_TNIL) return luaL_error(L, "cannot change a protected metatable");
  lua_settop(L, 2);
  lua_setmetatable(L, 1);
  return 1;
}

// coroutine.close of a coroutine that died by an error: Lua would run its pending __close
// handlers on a thread whose hooks may be off (the error came from the budget's own hook), so
// they are not run; the error is returned as coroutine.close returns it.
int safe_coroutine_close(lua_State* L) {
  lua_State* co = lua_tothread(L, 1);
  luaL_argexpected(L, co != nullptr, 1, "coroutine");
  const int status = lua_status(co);
  if (status != LUA_OK && status != LUA_YIELD) {
    lua_pushboolean(L, 0);
    if (lua_gettop(co) > 0) {
      lua_pushvalue(co, -1);
      lua_xmove(co, L, 1);
    } else {
      lua_pushnil(L);
    }
    return 2;
  }
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

// Calls the original C function (upvalue 1) with this call's arguments.
int call_original(lua_State* L) {
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

// string.find/match/gmatch/gsub: refused when the pattern could backtrack past kPatternSteps on
// this subject. Lua's matcher runs no instructions, so neither the count hook nor the clock can
// stop it once it has started. Upvalue 2 names the function.
int guarded_pattern(lua_State* L) {
  size_t n = 0, m = 0;
  luaL_checklstring(L, 1, &n);
  const char* p = luaL_checklstring(L, 2, &m);
  const char* name = lua_tostring(L, lua_upvalueindex(2));
  const bool find = std::strcmp(name, "find") == 0, gmatch = std::strcmp(name, "gmatch") == 0;
  const double cost = find && lua_toboolean(L, 4) ? static_cast<double>(n + 1) * static_cast<double>(m + 1) : lua_pattern_cost(std::string(p, m), n, !gmatch);
  if (cost > kPatternSteps)
    return raise(L, "string.%s: pattern \"%.40s%s\" may take ~%.0e steps on a %zu-byte string (limit %.0e); shorten the string or use fewer repetition items (docs/hooks.md)",
                 name, p, m > 40 ? "..." : "", cost, n, kPatternSteps);
  return call_original(L);
}

// string.rep: n repetitions of "" would loop n times without allocating; more repetitions than
// the memory cap has bytes are refused before they start.
int guarded_rep(lua_State* L) {
  size_t l = 0, lsep = 0;
  luaL_checklstring(L, 1, &l);
  const lua_Integer n = luaL_checkinteger(L, 2);
  luaL_optlstring(L, 3, "", &lsep);
  const double limit = budget_of(L).limits.memory_limit_bytes;
  if (n > 0 && static_cast<double>(n) * static_cast<double>(std::max<size_t>(1, l + lsep)) > limit)
    return raise(L, "string.rep: %lld repetitions exceed the hook memory cap of %.0f bytes (hooks.memory_limit_mb)", static_cast<long long>(n), limit);
  return call_original(L);
}

// table.move/insert/remove loop in C over a range (or a __len) the script chooses; a range longer
// than the memory cap could hold runs no instructions for a very long time.
int guarded_table(lua_State* L) {
  const char* name = lua_tostring(L, lua_upvalueindex(2));
  const double limit = budget_of(L).limits.memory_limit_bytes / 16;  // a table slot is at least 16 bytes
  double count = 0;
  if (std::strcmp(name, "move") == 0) {
    const lua_Integer f = luaL_checkinteger(L, 2), e = luaL_checkinteger(L, 3);
    count = e >= f ? static_cast<double>(e) - static_cast<double>(f) + 1 : 0;
  } else {
    luaL_checktype(L, 1, LUA_TTABLE);
    count = static_cast<double>(luaL_len(L, 1));
  }
  if (count > limit) return raise(L, "table.%s: %.0f elements are more than the hook memory cap can hold (hooks.memory_limit_mb)", name, count);
  return call_original(L);
}

// print() to the rank's log, up to print_bytes_per_call per call and print_bytes_per_run in all.
int capped_print(lua_State* L) {
  LuaSandbox::Budget& b = budget_of(L);
  const int n = lua_gettop(L);
  luaL_Buffer buffer;
  luaL_buffinit(L, &buffer);
  for (int i = 1; i <= n; ++i) {
    if (i > 1) luaL_addchar(&buffer, '\t');
    luaL_tolstring(L, i, nullptr);
    luaL_addvalue(&buffer);
  }
  luaL_addchar(&buffer, '\n');
  luaL_pushresult(&buffer);
  size_t length = 0;
  const char* text = lua_tolstring(L, -1, &length);
  const int64_t room = std::max<int64_t>(0, std::min(b.limits.print_bytes_per_call - b.printed_call, b.limits.print_bytes_per_run - b.printed_run));
  const size_t kept = std::min<size_t>(length, static_cast<size_t>(room));
  std::fwrite(text, 1, kept, stdout);
  b.printed_call += static_cast<int64_t>(kept);
  b.printed_run += static_cast<int64_t>(kept);
  // One notice when a call reaches its cap, and one when the run reaches its own; then silence.
  const bool run_full = b.printed_run >= b.limits.print_bytes_per_run;
  if (kept < length && !b.run_notice_given && (run_full || !b.call_notice_given)) {
    b.call_notice_given = true;
    b.run_notice_given = run_full;
    std::fprintf(stdout, "\n[hooks] print output cap reached (%lld bytes per call, %lld per run); further output of this %s is dropped\n",
                 static_cast<long long>(b.limits.print_bytes_per_call), static_cast<long long>(b.limits.print_bytes_per_run),
                 run_full ? "run's hooks" : "hook call");
  }
  std::fflush(stdout);
  return 0;
}

// Lua-level replacements, counted by the budget like the script itself. xpcall's message handler
// runs after the failed call has unwound: Lua would run it inside the error (and so inside the
// count hook, with hooks off, when the budget raised it). coroutine.wrap does not reset a
// coroutine that died by an error (that would run its __close handlers with hooks off).
const char* const kPrelude = R"lua(
local pcall, error, create, resume, pack, unpack = pcall, error, coroutine.create, coroutine.resume, table.pack, table.unpack
function xpcall(f, handler, ...)
  local r = pack(pcall(f, ...))
  if r[1] then return unpack(r, 1, r.n) end
  local ok, v = pcall(handler, r[2])
  return false, v
end
coroutine.wrap = function(f)
  local co = create(f)
  return function(...)
    local r = pack(resume(co, ...))
    if r[1] then return unpack(r, 2, r.n) end
    error(r[2], 0)
  end
end
)lua";

void remove_field(lua_State* L, const char* table, const char* field) {
  lua_getglobal(L, table);
  lua_pushnil(L);
  lua_setfield(L, -2, field);
  lua_pop(L, 1);
}

// Replaces table.field by `guard`, which finds the original as upvalue 1 and the name as upvalue 2.
void guard_field(lua_State* L, const char* table, const char* field, lua_CFunction guard) {
  lua_getglobal(L, table);
  lua_getfield(L, -1, field);
  lua_pushstring(L, field);
  lua_pushcclosure(L, guard, 2);
  lua_setfield(L, -2, field);
  lua_pop(L, 1);
}

// Opens the safe libraries and installs the guards. Runs inside a protected call.
int open_sandbox(lua_State* L) {
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
  lua_pushcfunction(L, safe_setmetatable);
  lua_setglobal(L, "setmetatable");
  lua_pushcfunction(L, capped_print);
  lua_setglobal(L, "print");
  remove_field(L, LUA_STRLIBNAME, "dump");
  for (const char* f : {"find", "match", "gmatch", "gsub"}) guard_field(L, LUA_STRLIBNAME, f, guarded_pattern);
  guard_field(L, LUA_STRLIBNAME, "rep", guarded_rep);
  for (const char* f : {"move", "insert", "remove"}) guard_field(L, LUA_TABLIBNAME, f, guarded_table);
  guard_field(L, LUA_COLIBNAME, "close", safe_coroutine_close);
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
  if (luaL_loadbufferx(L, kPrelude, std::strlen(kPrelude), "=(dsrun prelude)", "t") != LUA_OK) return lua_error(L);
  lua_call(L, 0, 0);
  return 0;
}

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
    case nlohmann::json::value_t::string: {
      const std::string& s = v.get_ref<const std::string&>();
      lua_pushlstring(L, s.data(), s.size());
      break;
    }
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
      for (auto it = v.begin(); it != v.end(); ++it) {
        push_json(L, it.value(), depth + 1);
        lua_setfield(L, -2, it.key().c_str());
      }
      break;
    }
    default: lua_pushnil(L);
  }
}

// The value at `index` as JSON, with raw accesses only (no metamethod runs, nothing raises).
// Arrays are tables with keys 1..n exactly; other tables need string keys. Functions, coroutines
// and userdata cannot cross. `room` is what is left of the size cap, counted as JSON text.
nlohmann::json to_json(lua_State* L, int index, int depth, const std::string& path, int64_t& room) {
  index = lua_absindex(L, index);
  auto spend = [&](size_t bytes) {
    room -= static_cast<int64_t>(bytes);
    if (room < 0) throw Error(path + ": the value is too large to leave the hook (see the result size cap in docs/hooks.md; a cycle?)");
  };
  if (depth > kMaxDepth) throw Error(path + ": nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  switch (lua_type(L, index)) {
    case LUA_TNIL: spend(4); return nullptr;
    case LUA_TBOOLEAN: spend(5); return static_cast<bool>(lua_toboolean(L, index));
    case LUA_TNUMBER:
      spend(8);
      if (lua_isinteger(L, index)) return static_cast<int64_t>(lua_tointeger(L, index));
      return lua_tonumber(L, index);
    case LUA_TSTRING: {
      size_t length = 0;
      const char* s = lua_tolstring(L, index, &length);
      spend(length + 2);
      return std::string(s, length);
    }
    case LUA_TTABLE: {
      if (!lua_checkstack(L, 4)) throw Error(path + ": the Lua stack cannot grow (memory cap)");
      spend(2);
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
          a.push_back(to_json(L, -1, depth + 1, path + "[" + std::to_string(i) + "]", room));
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
        size_t length = 0;
        const char* k = lua_tolstring(L, -2, &length);
        const std::string key(k, length);
        spend(length + 3);
        o[key] = to_json(L, -1, depth + 1, path + "." + key, room);
        lua_pop(L, 1);
      }
      return o;
    }
    default: throw Error(path + ": a " + std::string(luaL_typename(L, index)) + " cannot leave the hook (only nil, booleans, numbers, strings and tables)");
  }
}

// What a protected trampoline does with global `name`.
struct Request {
  LuaSandbox::Op op;
  const std::string* name;
  const std::vector<nlohmann::json>* args;
};

int trampoline(lua_State* L) {
  auto* req = static_cast<Request*>(lua_touserdata(L, 1));
  const char* name = req->name->c_str();
  if (req->op == LuaSandbox::Op::RunChunk) {
    lua_call(L, 0, 0);  // the chunk, argument 2
    return 0;
  }
  lua_settop(L, 0);
  switch (req->op) {
    case LuaSandbox::Op::Set:
      push_json(L, (*req->args)[0], 0);
      lua_setglobal(L, name);
      return 0;
    case LuaSandbox::Op::Get: lua_getglobal(L, name); return 1;
    case LuaSandbox::Op::IsFunction:
      lua_pushboolean(L, lua_getglobal(L, name) == LUA_TFUNCTION);
      return 1;
    case LuaSandbox::Op::RunChunk: return 0;
    case LuaSandbox::Op::Call:
      if (lua_getglobal(L, name) != LUA_TFUNCTION) return luaL_error(L, "%s is not a function", name);
      for (const auto& a : *req->args) push_json(L, a, 0);
      lua_call(L, static_cast<int>(req->args->size()), 1);
      return 1;
  }
  return 0;
}

[[noreturn]] void lua_failure(const std::string& script, const std::string& what, const std::string& message) {
  ErrorContext c;
  c.file = script;
  c.key = "hooks.script";
  c.hint = "fix the script; docs/hooks.md lists what hooks may use and their limits";
  throw Error(what + ": " + message, c);
}

// A Lua status as a message: what Lua left on the stack (which says where in the script), or the
// limit that made the allocator refuse.
std::string failure_message(lua_State* L, int rc, const LuaSandbox::Budget& b) {
  std::string message = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "(error object is not a string)";
  lua_pop(L, 1);
  if (rc == LUA_ERRMEM && b.timed_out) {
    char text[96];
    std::snprintf(text, sizeof text, "time limit of %g s exceeded (hooks.time_limit_s)", b.limits.time_limit_seconds);
    return text;
  }
  if (rc == LUA_ERRMEM) message += " (memory cap hooks.memory_limit_mb reached)";
  return message;
}

// How an item of a pattern may repeat.
enum class Repeat { Once, Optional, Many };

// The end of a [set] starting at p[i] == '['.
size_t set_end(const std::string& p, size_t i) {
  ++i;
  if (i < p.size() && p[i] == '^') ++i;
  if (i < p.size()) ++i;  // a ']' right after '[' (or '[^') is a member
  while (i < p.size() && p[i] != ']') i += p[i] == '%' ? 2 : 1;
  return std::min(p.size(), i + 1);
}

}  // namespace

double lua_pattern_cost(const std::string& p, size_t subject_length, bool anchored_search) {
  const double n = static_cast<double>(subject_length) + 1;
  size_t i = 0;
  bool anchored = false;
  if (anchored_search && !p.empty() && p[0] == '^') {
    anchored = true;
    i = 1;
  }
  // Each item: how it repeats, whether it is `.` (any byte), whether it scans the subject by itself
  // (%b, back-references), whether it is the final `$`.
  struct Item {
    Repeat repeat = Repeat::Once;
    bool any = false, scans = false, end = false;
  };
  std::vector<Item> items;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '(' || c == ')') {
      ++i;
      continue;
    }
    Item item;
    if (c == '$' && i + 1 == p.size()) {
      item.end = true;
      items.push_back(item);
      break;
    }
    if (c == '%' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 'b') {
        i += 4;
        item.scans = true;
      } else if (d == 'f') {
        i += 2;
        if (i < p.size() && p[i] == '[') i = set_end(p, i);
        continue;
      } else {
        item.scans = d >= '0' && d <= '9';
        i += 2;
      }
    } else if (c == '[') {
      i = set_end(p, i);
    } else {
      item.any = c == '.';
      ++i;
    }
    if (!item.scans && i < p.size() && (p[i] == '*' || p[i] == '+' || p[i] == '-')) item.repeat = Repeat::Many;
    else if (!item.scans && i < p.size() && p[i] == '?') item.repeat = Repeat::Optional;
    if (item.repeat != Repeat::Once && p[i++] == '+') {  // x+ is x then x*
      Item once = item;
      once.repeat = Repeat::Once;
      items.push_back(once);
    }
    items.push_back(item);
  }
  // always[k]: the items from k on match at any position, so nothing before them backtracks.
  // True when they can all be empty (no final `$`), or a `.*`/`.-` can run to the end and what
  // follows it can be empty there.
  const size_t count = items.size();
  auto empty_ok = [&](const Item& it) { return it.end || (!it.scans && it.repeat != Repeat::Once); };
  std::vector<bool> always(count + 1, true), empty_to_end(count + 1, true);
  for (size_t k = count; k-- > 0;) {
    empty_to_end[k] = empty_ok(items[k]) && empty_to_end[k + 1];
    const bool empty = !items[k].end && !items[k].scans && items[k].repeat != Repeat::Once;
    always[k] = (empty && always[k + 1]) || (items[k].any && items[k].repeat == Repeat::Many && empty_to_end[k + 1]);
  }
  // A repetition whose rest may fail can backtrack over every length it matched; an item that
  // scans costs the subject's length each time it is tried; an unanchored search tries every start.
  double cost = std::max<double>(1, static_cast<double>(p.size())) * (anchored ? 1 : n);
  for (size_t k = 0; k < count && cost < 1e30; ++k) {
    if (items[k].scans) cost *= n;
    else if (items[k].repeat == Repeat::Many && !always[k + 1]) cost *= n;
    else if (items[k].repeat == Repeat::Optional && !always[k + 1]) cost *= 2;
  }
  return std::min(cost, 1e30);
}

void LuaCloser::operator()(lua_State* L) const { lua_close(L); }

LuaSandbox::LuaSandbox(const std::string& script_path, const LuaSandboxOptions& options, const nlohmann::json& globals) : script_(script_path), budget_(std::make_unique<Budget>()) {
  budget_->limits = options;
  L_.reset(lua_newstate(capped_alloc, budget_.get()));
  if (!L_) throw Error("cannot create a Lua state (memory cap too small?)", ErrorContext{script_, 0, 0, "hooks.memory_limit_mb", -1, "raise hooks.memory_limit_mb"});
  lua_State* L = L_.get();
  lua_sethook(L, count_hook, LUA_MASKCOUNT, kCountStep);
  budget_->deadline = steady_seconds() + options.time_limit_seconds;
  lua_pushcfunction(L, open_sandbox);
  const int rc = lua_pcall(L, 0, 0, 0);
  budget_->deadline = 0;
  if (rc != LUA_OK) lua_failure(script_, "setting up the hook sandbox", failure_message(L, rc, *budget_));
  for (const auto& [name, value] : globals.items()) set_global(name, value);

  const int loaded = luaL_loadfilex(L, script_.c_str(), "t");
  if (loaded != LUA_OK) lua_failure(script_, "loading the hook script", failure_message(L, loaded, *budget_));
  static const std::vector<nlohmann::json> none;
  run_protected(Op::RunChunk, "", none, "running the hook script's top level");
}

LuaSandbox::~LuaSandbox() = default;

void LuaSandbox::run_protected(Op op, const std::string& name, const std::vector<nlohmann::json>& args, const std::string& what) {
  lua_State* L = L_.get();
  Budget& b = *budget_;
  b.used = 0;
  b.timed_out = false;
  b.printed_call = 0;
  b.call_notice_given = false;
  b.deadline = steady_seconds() + b.limits.time_limit_seconds;
  lua_sethook(L, count_hook, LUA_MASKCOUNT, kCountStep);  // re-armed: a spent budget fired on every instruction
  Request req{op, &name, &args};
  lua_pushcfunction(L, trampoline);
  lua_pushlightuserdata(L, &req);
  int nargs = 1;
  if (op == Op::RunChunk) {  // the loaded chunk, below the two: it becomes the second argument
    lua_rotate(L, -3, 2);
    nargs = 2;
  }
  const bool result = op == Op::Call || op == Op::Get || op == Op::IsFunction;
  const int rc = lua_pcall(L, nargs, result ? 1 : 0, 0);
  b.deadline = 0;
  if (rc != LUA_OK) lua_failure(script_, what, failure_message(L, rc, b));
}

nlohmann::json LuaSandbox::result_to_json(const std::string& what, const std::string& path) {
  lua_State* L = L_.get();
  int64_t room = budget_->limits.result_bytes;
  nlohmann::json v;
  try {
    v = to_json(L, -1, 0, path, room);
  } catch (const Error& e) {
    lua_pop(L, 1);
    lua_failure(script_, what, e.what());
  }
  lua_pop(L, 1);
  return v;
}

bool LuaSandbox::has_function(const std::string& name) {
  static const std::vector<nlohmann::json> none;
  run_protected(Op::IsFunction, name, none, "looking up hook " + name);
  const bool yes = lua_toboolean(L_.get(), -1);
  lua_pop(L_.get(), 1);
  return yes;
}

nlohmann::json LuaSandbox::call(const std::string& name, const std::vector<nlohmann::json>& args) {
  run_protected(Op::Call, name, args, "hook " + name);
  return result_to_json("hook " + name, name + "'s result");
}

nlohmann::json LuaSandbox::get_global(const std::string& name) {
  static const std::vector<nlohmann::json> none;
  run_protected(Op::Get, name, none, "reading " + name);
  return result_to_json("saving the hook " + name, name);
}

void LuaSandbox::set_global(const std::string& name, const nlohmann::json& value) {
  std::vector<nlohmann::json> args{value};
  run_protected(Op::Set, name, args, "setting " + name + " for the hooks");
}

double LuaSandbox::memory_used() const { return budget_->memory_used; }

}  // namespace dsrun
