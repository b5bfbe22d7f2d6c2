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
