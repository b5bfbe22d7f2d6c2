// Lua hooks: the sandbox (refusals, instruction budget, memory cap, errors with script and line),
// actions and their validation, the shipped examples, and hooks in real runs on 1-3 ranks: every
// hook point, every action, rank agreement, the error policy and hook state across a resume.
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/hooks/hooks.hpp"
#include "engine/hooks/lua_sandbox.hpp"
#include "storage/store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>

using dsrun::test::contains;
using dsrun::test::error_of;
using dsrun::test::layout;
using dsrun::test::recorded_losses;
using dsrun::test::Run;
using dsrun::test::TempDir;
using dsrun::test::train;

namespace {

dsrun::HookOptions hook_options(const std::string& script, dsrun::HookErrorPolicy policy = dsrun::HookErrorPolicy::Fail) {
  dsrun::HookOptions o;
  o.script = script;
  o.on_error = policy;
  o.instruction_limit = 1000000;
  o.memory_limit_bytes = 4e6;
  return o;
}

// A script whose on_step(ctx) runs `body` and returns its value.
std::string on_step_script(const TempDir& dir, const std::string& body) { return dir.write("hook.lua", "function on_step(ctx)\n" + body + "\nend\n"); }

std::string result_of(const TempDir& dir, const std::string& body) {
  dsrun::LuaSandbox lua(on_step_script(dir, body), {1000000, 4e6});
  return lua.call("on_step", {nlohmann::json::object()}).dump();
}

std::string source(const std::string& relative) { return dsrun::test::source_dir() + "/" + relative; }

int count_events(const TempDir& dir, const std::string& run_id, const std::string& kind, const std::string& text = "") {
  dsrun::Store store(dir.file("runs.db"));
  int n = 0;
  for (const auto& e : store.events(run_id)) n += e.kind == kind && contains(e.message, text);
  return n;
}

double metric_at(const TempDir& dir, const std::string& run_id, const std::string& key, int64_t step) {
  dsrun::Store store(dir.file("runs.db"));
  for (const auto& m : store.metric_history(run_id, key))
    if (m.step == step) return m.value;
  return NAN;
}

std::string with_hook(const std::string& script, const std::string& policy = "fail") {
  return " --set hooks.script=\\\"" + script + "\\\" --set hooks.on_error=\\\"" + policy + "\\\"";
}

}  // namespace

TEST_CASE("the hook sandbox refuses io, os beyond time and clock, require, debug, bytecode and string.dump", "[hooks][sandbox]") {
  TempDir dir;
  CHECK(result_of(dir, "return {io == nil, debug == nil, require == nil, package == nil, dofile == nil, loadfile == nil, collectgarbage == nil}") ==
        "[true,true,true,true,true,true,true]");
  CHECK(result_of(dir, "return {os.execute == nil, os.getenv == nil, os.remove == nil, os.exit == nil, type(os.time()), type(os.clock())}") ==
        "[true,true,true,true,\"number\",\"number\"]");
  CHECK(result_of(dir, "return {string.dump == nil, (\"\").dump == nil}") == "[true,true]");
  CHECK(contains(error_of([&] { result_of(dir, "return io.open('/etc/passwd')"); }), "attempt to index a nil value (global 'io')"));
  CHECK(contains(error_of([&] { result_of(dir, "return os.execute('true')"); }), "attempt to call a nil value (field 'execute')"));
  CHECK(contains(error_of([&] { result_of(dir, "return require('os')"); }), "attempt to call a nil value (global 'require')"));
  CHECK(contains(error_of([&] { result_of(dir, "return debug.getinfo(1)"); }), "attempt to index a nil value (global 'debug')"));
  // Text chunks load; bytecode does not (its signature starts with ESC "Lua").
  CHECK(result_of(dir, "return load('return 1 + 1')()") == "2");
  CHECK(result_of(dir, "local f, err = load('\\27Lua\\84\\0'); return err") == "\"attempt to load a binary chunk (mode is 't')\"");
}

TEST_CASE("an infinite loop or a memory bomb ends the call with an error naming the hook, not the process", "[hooks][sandbox]") {
  TempDir dir;
  std::string e = error_of([&] { result_of(dir, "while true do end"); });
  CHECK(contains(e, "hook on_step"));
  CHECK(contains(e, "instruction limit of 1000000 exceeded"));
  // pcall cannot swallow the budget: the next instruction outside it raises again.
  e = error_of([&] { result_of(dir, "while true do pcall(function() while true do end end) end"); });
  CHECK(contains(e, "instruction limit"));
  e = error_of([&] { result_of(dir, "local t = {} for i = 1, 1e9 do t[i] = string.rep('x', 1000) .. i end"); });
  CHECK(contains(e, "hook on_step"));
  CHECK(contains(e, "not enough memory"));
  // The state is usable after both: the budget and the memory are per call.
  std::string script = dir.write("two.lua", "function spin() while true do end end\nfunction ok() return 42 end\n");
  dsrun::LuaSandbox lua(script, {100000, 4e6});
  CHECK_FALSE(error_of([&] { lua.call("spin", {}); }).empty());
  CHECK(lua.call("ok", {}) == 42);
}

// Every way out of the budget that the adversarial review found, and their relatives: each must
// end with an error naming what ran over, within the call, and leave a usable state.
TEST_CASE("no script escapes the budget: message handlers, finalizers, to-be-closed handlers, C functions", "[hooks][sandbox][budget]") {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> escapes = {
      // xpcall's handler runs after the failed call has unwound, so it is counted
      {"xpcall(function() while true do end end, function(e) while true do end end)", "instruction limit"},
      {"xpcall(function() error('x') end, function(e) while true do end end)", "instruction limit"},
      {"xpcall(function() xpcall(function() while true do end end, function() while true do end end) end, function() while true do end end)", "instruction limit"},
      {"xpcall(function() while true do end end, function(e) local t = {} while true do t[#t + 1] = e .. #t end end)", "instruction limit"},
      // finalizers would run at collection or lua_close, with hooks off: refused
      {"setmetatable({}, {__gc = function() while true do end end})", "__gc finalizers are not allowed"},
      {"local mt = {__gc = true}; for i = 1, 10 do setmetatable({}, mt) end", "__gc finalizers are not allowed"},
      // to-be-closed handlers run as ordinary calls, and a coroutine that died by the budget does not run them
      {"local x <close> = setmetatable({}, {__close = function() while true do end end})", "instruction limit"},
      {"local co = coroutine.create(function() local x <close> = setmetatable({}, {__close = function() while true do end end}) while true do end end)\n"
       "coroutine.resume(co); coroutine.close(co); while true do end",
       "instruction limit"},
      {"local f = coroutine.wrap(function() local x <close> = setmetatable({}, {__close = function() while true do end end}) while true do end end)\n"
       "pcall(f); while true do end",
       "instruction limit"},
      // C functions that would run for ages without an instruction
      {"return string.find(string.rep('a', 5000), '.-.-.-.-.-b')", "string.find: pattern"},
      {"return string.match(string.rep('a', 3000), '(a*)(a*)(a*)b')", "string.match: pattern"},
      {"return select('#', string.gsub(string.rep('a', 3000), 'a-a-a-b', ''))", "string.gsub: pattern"},
      {"for w in string.gmatch(string.rep('ab', 2000), '(.-)%1x') do end", "string.gmatch: pattern"},
      {"return ('x'):rep(10):find(string.rep('a?', 40) .. string.rep('a', 40))", "string.find: pattern"},
      {"return #string.rep('', 1e15)", "string.rep: 1000000000000000 repetitions"},
      {"return #string.rep('ab', 1e9, ',')", "string.rep:"},
      {"return table.move({}, 1, 1e15, 2)", "table.move:"},
      {"table.insert(setmetatable({}, {__len = function() return 1e15 end}), 1, 'x')", "table.insert:"},
      {"table.remove(setmetatable({}, {__len = function() return 1e15 end}), 1)", "table.remove:"},
  };
  for (const auto& [body, expected] : escapes) {
    INFO(body);
    const auto t0 = std::chrono::steady_clock::now();
    std::string e;
    {
      dsrun::LuaSandbox lua(dir.write("hook.lua", "function on_step(ctx)\n" + body + "\nend\nfunction ok() return 42 end\n"), {1000000, 4e6, 5.0});
      e = error_of([&] { lua.call("on_step", {nlohmann::json::object()}); });
      CHECK(lua.call("ok", {}) == 42);  // the state stays usable
    }  // lua_close runs no script code
    CHECK(contains(e, "hook on_step"));
    CHECK(contains(e, expected));
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 20);
  }
}

TEST_CASE("ordinary patterns, repetitions and table moves stay allowed", "[hooks][sandbox][budget]") {
  TempDir dir;
  CHECK(result_of(dir, "return (('a=1, b=2'):gsub('(%w+)=(%w+)', '%2=%1'))") == "\"1=a, 2=b\"");
  CHECK(result_of(dir, "return (string.rep(' ', 4000) .. 'x' .. string.rep(' ', 4000)):match('^%s*(.-)%s*$')") == "\"x\"");
  CHECK(result_of(dir, "local n = 0 for w in string.rep('word ', 20000):gmatch('%a+') do n = n + 1 end return n") == "20000");
  CHECK(result_of(dir, "return #string.rep('ab', 100000, ',')") == "299999");
  CHECK(result_of(dir, "local t = table.move({1, 2, 3}, 1, 3, 2) table.insert(t, 1, 0) return t") == "[0,1,1,2,3]");
  CHECK(result_of(dir, "return string.find(string.rep('a', 100000), 'aab', 1, true)") == "null");
  // The estimate: a repetition followed by more of the pattern multiplies by the subject length.
  CHECK(dsrun::lua_pattern_cost("%s+", 1000000, true) < 1e7);
  CHECK(dsrun::lua_pattern_cost("^%s*(.-)%s*$", 4000, true) < 1e9);
  CHECK(dsrun::lua_pattern_cost(".-.-.-.-.-b", 5000, true) > 1e18);
  CHECK(dsrun::lua_pattern_cost("a*b", 100, true) == Approx(3.0 * 101 * 101));
}

TEST_CASE("a wall-clock deadline ends a call that the instruction budget would let run", "[hooks][sandbox][budget]") {
  TempDir dir;
  dsrun::LuaSandbox lua(on_step_script(dir, "while true do end"), {int64_t(1e15), 4e6, 0.3});
  const auto t0 = std::chrono::steady_clock::now();
  std::string e = error_of([&] { lua.call("on_step", {nlohmann::json::object()}); });
  CHECK(contains(e, "time limit of 0.3 s exceeded (hooks.time_limit_s)"));
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 5);
  // Time spent inside C functions (here the compiler) counts too.
  dsrun::LuaSandbox allocating(on_step_script(dir, "local s = string.rep('a = 1 ', 500000) while true do load(s) end"), {int64_t(1e15), 64e6, 0.3});
  CHECK(contains(error_of([&] { allocating.call("on_step", {nlohmann::json::object()}); }), "time limit"));
}

TEST_CASE("a hostile metatable on _G cannot crash dsrun: lookups run protected, under the policy", "[hooks][sandbox]") {
  TempDir dir;
  std::string raising = dir.write("raising.lua", "setmetatable(_G, {__index = function(t, k) error('x') end})\n");
  dsrun::RecipeHooks fail(hook_options(raising));
  CHECK(contains(error_of([&] { fail.defines("on_step"); }), "raising.lua:1: x"));
  CHECK(contains(error_of([&] { fail.on_step(nlohmann::json::object()); }), "looking up hook on_step"));
  dsrun::RecipeHooks disable(hook_options(raising, dsrun::HookErrorPolicy::Disable));
  CHECK_FALSE(disable.defines("on_step"));
  CHECK(disable.on_step(nlohmann::json::object()).stop.empty());
  CHECK(disable.take_errors().size() == 1);
  // A lookup that loops is stopped by the budget; one that yields a function works.
  std::string looping = dir.write("looping.lua", "setmetatable(_G, {__index = function(t, k) while true do end end})\n");
  CHECK(contains(error_of([&] { dsrun::RecipeHooks(hook_options(looping)).defines("lr"); }), "instruction limit"));
  std::string giving = dir.write("giving.lua", "setmetatable(_G, {__index = function(t, k) if k == 'on_step' then return function() return {save = true} end end end})\n");
  dsrun::RecipeHooks works(hook_options(giving));
  CHECK(works.on_step(nlohmann::json::object()).save);
  // The same script through the command line: an error message, exit 1, never an abort.
  auto out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && '" DSRUN_BINARY "' plan recipes/quickstart.toml --set hooks.script=\\\"" + raising + "\\\"");
  INFO(out.text);
  CHECK(out.code == 1);
  CHECK(contains(out.text, "raising.lua:1: x"));
}

TEST_CASE("a hook's output is capped: prints, log messages, metrics, returned values", "[hooks][sandbox][caps]") {
  TempDir dir;
  // print: 64 KiB per call kept, then one notice; the call itself succeeds.
  auto printed = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && '" DSRUN_BINARY "' plan recipes/quickstart.toml --set hooks.script=\\\"" +
                                          dir.write("print.lua", "function on_plan(p) for i = 1, 300 do print(string.rep('x', 1 << 20)) end end\n") + "\\\"");
  CHECK(printed.code == 0);
  CHECK(printed.text.size() < 200000);
  CHECK(contains(printed.text, "[hooks] print output cap reached"));

  const std::vector<std::pair<std::string, std::string>> too_much = {
      {"return {log = string.rep('x', 30 << 20)}", "too large to leave the hook"},
      {"return {log = string.rep('x', 5000)}", "a log message of 5000 bytes"},
      {"local l = {} for i = 1, 17 do l[i] = 'm' end return {log = l}", "17 log messages"},
      {"local m = {} for i = 1, 200000 do m['k' .. i] = i end return {metrics = m}", "custom metrics in one call"},
      {"return {metrics = {[string.rep('n', 65)] = 1}}", "a metric name must have 1 to 64 bytes"},
      {"local t = {} t[1] = t t[2] = t return {metrics = t}", "nested deeper than 32 levels"},
  };
  for (const auto& [body, expected] : too_much) {
    INFO(body);
    dsrun::HookOptions roomy = hook_options(on_step_script(dir, body));
    roomy.memory_limit_bytes = 256e6;  // room for the 30 MiB string and the 200,000 names
    roomy.instruction_limit = 100000000;
    dsrun::RecipeHooks hooks(roomy);
    CHECK(contains(error_of([&] { hooks.on_step(nlohmann::json::object()); }), expected));
  }
  // Log text per run: 1 MiB, then the hook fails (or is disabled) like any other hook error.
  dsrun::RecipeHooks logging(hook_options(on_step_script(dir, "return {log = string.rep('y', 4000)}"), dsrun::HookErrorPolicy::Disable));
  int calls = 0;
  while (logging.defines("on_step") && calls < 1000) {
    logging.on_step(nlohmann::json::object());
    ++calls;
  }
  CHECK(calls == (1 << 20) / 4000 + 1);
  auto errors = logging.take_errors();
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "log messages passed 1048576 bytes in this run"));
}

TEST_CASE("under \"disable\" a hook state that cannot be saved keeps the last good one", "[hooks][sandbox]") {
  TempDir dir;
  std::string script = on_step_script(dir, "state.n = (state.n or 0) + 1; if state.n == 2 then state.bad = function() end end");
  dsrun::RecipeHooks fail(hook_options(script));
  fail.on_step(nlohmann::json::object());
  fail.on_step(nlohmann::json::object());
  CHECK(contains(error_of([&] { fail.save_state(); }), "a function cannot leave the hook"));

  dsrun::RecipeHooks disable(hook_options(script, dsrun::HookErrorPolicy::Disable));
  CHECK(disable.save_state() == "{}");
  disable.on_step(nlohmann::json::object());
  CHECK(disable.save_state() == "{\"n\":1}");
  disable.on_step(nlohmann::json::object());
  CHECK(disable.save_state() == "{\"n\":1}");  // the function cannot be saved: the last good state
  auto errors = disable.take_errors();
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "the checkpoint keeps the last hook state that could be saved"));
  CHECK(disable.defines("on_step"));  // the hooks go on
}

TEST_CASE("hook errors carry the script and line, and the recipe's policy decides", "[hooks]") {
  TempDir dir;
  std::string script = dir.write("bad.lua", "function on_step(ctx)\n  local x = nil\n  return x.field\nend\n");
  dsrun::RecipeHooks fail(hook_options(script));
  std::string e = error_of([&] { fail.on_step(nlohmann::json::object()); });
  CHECK(contains(e, script + ":3:"));
  CHECK(contains(e, "attempt to index a nil value"));

  dsrun::RecipeHooks disable(hook_options(script, dsrun::HookErrorPolicy::Disable));
  CHECK(disable.defines("on_step"));
  CHECK(error_of([&] { disable.on_step(nlohmann::json::object()); }).empty());
  CHECK_FALSE(disable.defines("on_step"));  // disabled after its error
  auto errors = disable.take_errors();
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "bad.lua:3:"));

  std::string syntax = dir.write("syntax.lua", "function on_step(ctx)\n  return {\nend\n");
  CHECK(contains(error_of([&] { dsrun::RecipeHooks h(hook_options(syntax)); }), "syntax.lua:3:"));
}

TEST_CASE("actions are checked: unknown names, wrong types, skip outside on_step", "[hooks]") {
  TempDir dir;
  auto actions = [&](const std::string& body) {
    std::string script = dir.write("a.lua", "function on_step(ctx)\n" + body + "\nend\nfunction on_eval(ctx, m)\n" + body + "\nend\n");
    dsrun::RecipeHooks h(hook_options(script));
    return h.on_step(nlohmann::json::object());
  };
  dsrun::HookActions a = actions("return {stop = 'done', save = true, skip = true, lr = 0.5, log = {'a', 'b'}, metrics = {m = 2}}");
  CHECK(a.stop == "done");
  CHECK(a.save);
  CHECK(a.skip);
  CHECK(a.lr == 0.5);
  CHECK(a.logs == std::vector<std::string>{"a", "b"});
  CHECK(a.metrics.at("m") == 2);
  CHECK(actions("return {stop = true}").stop == "stopped by hook on_step");
  CHECK(contains(error_of([&] { actions("return {stpo = 'x'}"); }), "unknown action \"stpo\" (did you mean stop?)"));
  CHECK(contains(error_of([&] { actions("return {lr = -1}"); }), "lr must be a finite number >= 0"));
  CHECK(contains(error_of([&] { actions("return 7"); }), "must return nil or a table of actions"));
  CHECK(contains(error_of([&] { actions("return {metrics = {m = 'high'}}"); }), "metrics.m must be a number"));
  std::string script = dir.write("e.lua", "function on_eval(ctx, m) return {skip = true} end\n");
  dsrun::RecipeHooks h(hook_options(script));
  CHECK(contains(error_of([&] { h.on_eval(nlohmann::json::object(), nlohmann::json::object()); }), "skip is only possible from on_step"));
}

TEST_CASE("hook state survives a save and restore as JSON", "[hooks]") {
  TempDir dir;
  std::string script = dir.write("s.lua", "function on_step(ctx) state.n = (state.n or 0) + 1; state.hist = state.hist or {}; "
                                           "table.insert(state.hist, ctx.x); return {metrics = {n = state.n}} end\n"
                                           "function keep_function() state.f = print end\n");
  dsrun::RecipeHooks a(hook_options(script));
  a.on_step({{"x", 1.5}});
  a.on_step({{"x", "two"}});
  const std::string saved = a.save_state();
  CHECK(nlohmann::json::parse(saved) == nlohmann::json::parse(R"({"n": 2, "hist": [1.5, "two"]})"));
  dsrun::RecipeHooks b(hook_options(script));
  b.restore_state(saved);
  CHECK(b.on_step({{"x", 3}}).metrics.at("n") == 3);
  CHECK(nlohmann::json::parse(b.save_state())["hist"] == nlohmann::json::parse(R"([1.5, "two", 3])"));
}

TEST_CASE("the shipped example hooks: plateau stop, inverse-sqrt schedule, spike skip, custom metrics", "[hooks][examples]") {
  dsrun::HookOptions early = hook_options(source("recipes/hooks/early_stop.lua"));
  early.options = {{"patience", "2"}, {"min_delta", "0.01"}};
  dsrun::RecipeHooks stop(early);
  std::vector<double> val = {3.0, 2.5, 2.495, 2.6, 2.0};
  std::vector<std::string> stops;
  for (size_t i = 0; i < val.size(); ++i) stops.push_back(stop.on_eval({{"step", 10 * (i + 1)}}, {{"val_loss", val[i]}}).stop);
  CHECK(stops[2].empty());  // 2.495 is within min_delta of 2.5: one evaluation without improvement
  CHECK(contains(stops[3], "has not improved for 2 evaluations (best 2.5000 at step 20)"));

  dsrun::HookOptions inv = hook_options(source("recipes/hooks/inverse_sqrt.lua"));
  inv.options = {{"peak_lr", "0.001"}, {"warmup_steps", "100"}};
  dsrun::RecipeHooks sched(inv);
  CHECK(*sched.lr(50, {}) == Approx(0.0005));
  CHECK(*sched.lr(100, {}) == Approx(0.001));
  CHECK(*sched.lr(400, {}) == Approx(0.0005));

  dsrun::HookOptions spike = hook_options(source("recipes/hooks/spike_skip.lua"));
  spike.options = {{"warmup_steps", "10"}, {"z_threshold", "4.0"}};
  dsrun::RecipeHooks skip(spike);
  int skipped_at = -1;
  for (int step = 1; step <= 30; ++step) {
    const double loss = step == 25 ? 9.0 : 3.0 + 0.01 * std::sin(step);
    if (skip.on_step({{"step", step}, {"metrics", {{"loss", loss}}}}).skip) skipped_at = step;
  }
  CHECK(skipped_at == 25);

  dsrun::RecipeHooks custom(hook_options(source("recipes/hooks/custom_metric.lua")));
  custom.metrics({{"step", 1}, {"global_batch", 4}, {"metrics", {{"loss", 2.0}}}});
  auto m = custom.metrics({{"step", 2}, {"global_batch", 4}, {"metrics", {{"loss", 1.0}}}});
  CHECK(m.at("loss_ema") == Approx(1.9));
  CHECK(m.at("tokens_seen") == 2 * 4 * 32);
}

TEST_CASE("every hook point runs in a real run, and on_plan can adjust or reject the plan", "[hooks][run]") {
  TempDir dir;
  std::string script = dir.write("all.lua", R"(
function on_plan(plan)
  if plan.topology.world_size > 2 then return {reject = "at most 2 ranks"} end
  return {set = {["batch.micro"] = 3}}
end
function on_start(ctx) state.started_at = ctx.step end
function lr(step, ctx) return 1e-3 end
function metrics(ctx) return {twice_loss = 2 * ctx.metrics.loss} end
function on_step(ctx)
  state.steps = (state.steps or 0) + 1
  return {metrics = {seen_lr = ctx.lr, started_at = state.started_at, steps_in_hook = state.steps}}
end
function on_eval(ctx, m) return {metrics = {val_seen = m.val_loss}} end
function on_checkpoint(ctx) state.saved = ctx.checkpoint.step end
function on_end(ctx, summary) print(string.format("on_end: %d steps, reason %s, last save %d", summary.steps, summary.reason, state.saved)) end
)");
  Run run = train(dir, layout(1, 2) + " --set run.steps=4 --set eval.every=2 --set checkpoint.every=2" + with_hook(script));
  INFO(run.text);
  REQUIRE(run.code == 0);
  dsrun::Store store(dir.file("runs.db"));
  CHECK(contains(store.get_run(run.id).config_toml, "micro = 3"));  // on_plan's setting
  CHECK(metric_at(dir, run.id, "twice_loss", 3) == Approx(2 * run.losses[2]));
  CHECK(metric_at(dir, run.id, "seen_lr", 2) == Approx(1e-3));
  CHECK(metric_at(dir, run.id, "lr", 2) == Approx(1e-3));  // the lr hook replaced the cosine schedule
  CHECK(metric_at(dir, run.id, "started_at", 4) == 0);
  CHECK(metric_at(dir, run.id, "steps_in_hook", 4) == 4);
  CHECK(metric_at(dir, run.id, "val_seen", 4) == Approx(metric_at(dir, run.id, "val_loss", 4)));
  CHECK(contains(dsrun::read_file(dir.file(run.id + "/logs/rank0.log")), "on_end: 4 steps, reason finished, last save 4"));

  Run rejected = train(dir, layout(1, 3) + " --set run.steps=4" + with_hook(script));
  CHECK(rejected.code == 2);
  CHECK(contains(rejected.text, "rejected by on_plan"));
  CHECK(contains(rejected.text, "at most 2 ranks"));
}

TEST_CASE("hook actions in a real run: stop on 3 ranks without a hang, set lr, save, log, skip", "[hooks][run]") {
  TempDir dir;
  std::string stop = on_step_script(dir, "if ctx.step == 3 then return {stop = 'enough', log = 'stopping now', save = true} end");
  Run stopped = train(dir, layout(2, 3) + " --set run.steps=50" + with_hook(stop));
  INFO(stopped.text);
  CHECK(stopped.code == 0);
  CHECK(stopped.seconds < 30);
  CHECK(stopped.losses.size() == 3);
  CHECK(count_events(dir, stopped.id, "hook_stop", "enough") == 1);
  CHECK(count_events(dir, stopped.id, "hook", "stopping now") == 1);
  CHECK(dsrun::Store(dir.file("runs.db")).get_run(stopped.id).status == dsrun::RunStatus::Finished);
  CHECK(dsrun::Store(dir.file("runs.db")).checkpoints(stopped.id).back().step == 3);

  std::string set_lr = dir.write("lr.lua", "function on_step(ctx) if ctx.step == 2 then return {lr = 0.01} end end\n");
  Run with_lr = train(dir, layout(0, 2) + " --set run.steps=5 --set checkpoint.at_end=false" + with_hook(set_lr));
  REQUIRE(with_lr.code == 0);
  CHECK(metric_at(dir, with_lr.id, "lr", 2) != Approx(0.01));  // from the next update on
  CHECK(metric_at(dir, with_lr.id, "lr", 3) == Approx(0.01));
  CHECK(metric_at(dir, with_lr.id, "lr", 5) == Approx(0.01));

  // Skipping step 2's update leaves the weights as they were, exactly as a zero learning rate does:
  // step 3's loss is bitwise the same either way (and differs from the run without a skip).
  std::string skip = dir.write("skip.lua", "function on_step(ctx) if ctx.step == 2 then return {skip = true} end end\n");
  std::string zero = dir.write("zero.lua", "function lr(step, ctx) if step == 2 then return 0 end end\n");
  Run skipped = train(dir, layout(1, 2) + " --set run.steps=3 --set checkpoint.at_end=false" + with_hook(skip));
  Run zero_lr = train(dir, layout(1, 2) + " --set run.steps=3 --set checkpoint.at_end=false" + with_hook(zero));
  Run plain = train(dir, layout(1, 2) + " --set run.steps=3 --set checkpoint.at_end=false");
  REQUIRE(skipped.losses.size() == 3);
  REQUIRE(zero_lr.losses.size() == 3);
  REQUIRE(plain.losses.size() == 3);
  CHECK(skipped.losses[2] == zero_lr.losses[2]);
  CHECK(skipped.losses[2] != plain.losses[2]);
  CHECK(metric_at(dir, skipped.id, "hook_skipped_steps", 3) == 1);
}

TEST_CASE("all ranks apply rank 0's hook decisions: an lr hook gives the same trajectory on 1 and 3 ranks", "[hooks][run]") {
  TempDir dir;
  std::string script = dir.write("sched.lua", "function lr(step, ctx) return 3e-3 / math.sqrt(step) end\n");
  Run one = train(dir, layout(0, 1) + " --set run.steps=6 --set checkpoint.at_end=false" + with_hook(script));
  Run three = train(dir, layout(3, 3) + " --set run.steps=6 --set checkpoint.at_end=false" + with_hook(script));
  dsrun::test::check_same_trajectory(one.losses, three, 1e-5);
}

TEST_CASE("a failing hook fails the run cleanly under \"fail\" and is disabled and recorded under \"disable\"", "[hooks][run]") {
  TempDir dir;
  std::string script = on_step_script(dir, "if ctx.step == 2 then while true do end end");
  Run failed = train(dir, layout(1, 2) + " --set run.steps=6 --set hooks.instruction_limit=100000" + with_hook(script, "fail"));
  INFO(failed.text);
  CHECK(failed.code == 1);
  CHECK(failed.seconds < 30);
  CHECK(contains(failed.text, "rank 0 exited with code 1"));
  CHECK(contains(failed.text, "hook on_step"));
  CHECK(contains(failed.text, "instruction limit of 100000 exceeded"));
  CHECK(failed.losses.size() == 2);  // every rank stopped after the same step
  CHECK(count_events(dir, failed.id, "hook_error", "instruction limit") == 1);

  Run disabled = train(dir, layout(1, 2) + " --set run.steps=6 --set hooks.instruction_limit=100000" + with_hook(script, "disable"));
  INFO(disabled.text);
  CHECK(disabled.code == 0);
  CHECK(disabled.losses.size() == 6);
  CHECK(count_events(dir, disabled.id, "hook_error", "hook on_step disabled") == 1);
}

TEST_CASE("a hook escaping through a message handler is a hook error in a real run, on every rank at the same step", "[hooks][run][budget]") {
  TempDir dir;
  // Before: the handler ran with hooks off and the run hung until run.step_timeout_s.
  std::string script = on_step_script(dir, "if ctx.step == 2 then xpcall(function() while true do end end, function(e) while true do end end) end");
  Run failed = train(dir, layout(1, 2) + " --set run.steps=4 --set run.step_timeout_s=600 --set hooks.instruction_limit=100000" + with_hook(script, "fail"));
  INFO(failed.text);
  CHECK(failed.code == 1);
  CHECK(failed.seconds < 60);
  CHECK(contains(failed.text, "instruction limit of 100000 exceeded"));
  CHECK(failed.losses.size() == 2);
  Run disabled = train(dir, layout(1, 2) + " --set run.steps=4 --set hooks.instruction_limit=100000" + with_hook(script, "disable"));
  INFO(disabled.text);
  CHECK(disabled.code == 0);
  CHECK(disabled.losses.size() == 4);
  CHECK(count_events(dir, disabled.id, "hook_error", "hook on_step disabled") == 1);
}

TEST_CASE("hook state is saved in checkpoints and restored on resume", "[hooks][run][resume]") {
  TempDir dir;
  std::string script = on_step_script(dir, "state.calls = (state.calls or 0) + 1; return {metrics = {calls = state.calls}}");
  Run crashed = train(dir, layout(1, 2) + " --set run.steps=6 --set checkpoint.every=2" + with_hook(script), "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(crashed.code == 1);
  auto out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && '" DSRUN_BINARY "' resume " + crashed.id + " --db '" + dir.file("runs.db") + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(metric_at(dir, crashed.id, "calls", 5) == 5);  // 4 restored from the step-4 checkpoint, not 1
  CHECK(metric_at(dir, crashed.id, "calls", 6) == 6);
}

TEST_CASE("the example hook recipes plan and run", "[hooks][examples][run]") {
  TempDir dir;
  for (const char* name : {"early_stop", "inverse_sqrt", "spike_skip", "custom_metric"}) {
    Run run = train(dir, "--set run.steps=4 --set eval.every=2 --set schedule.warmup_steps=1 --set checkpoint.at_end=false", "",
                    std::string("recipes/hooks/") + name + ".toml");
    INFO(name << ": " << run.text);
    CHECK(run.code == 0);
    CHECK(run.losses.size() == 4);
  }
  CHECK(metric_at(dir, dsrun::Store(dir.file("runs.db")).list_runs({}).front().id, "loss_ema", 4) > 0);
}
