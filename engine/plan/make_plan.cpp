// make_plan: the plan of a recipe, in the order its "auto" keys are decided: the offload (each
// candidate planned whole), the checkpoint mode, the layout search, then the planner for the
// chosen degrees (ZeRO stage, micro batch, recomputation, loss chunk, execution modes).
#include "engine/common/error.hpp"
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"

#include <optional>

namespace dsrun {

namespace {

// The searched layouts a plan keeps (the stored plan and `dsrun plan` stay small).
constexpr size_t kLayoutsKept = 20;

Plan plan_with_layout_search(const Recipe& recipe, const HostFacts& host) {
  if (!recipe.parallel.search.any()) return plan_fixed_layout(recipe, host);
  // "auto" layout keys: the fastest predicted layout that fits (or the first, if none fits),
  // planned again whole (the schedule simulated, suggestions made) with every degree fixed.
  LayoutSearch search = search_layouts(recipe, host);
  std::vector<LayoutRow>& rows = search.rows;
  if (rows.empty() || !rows.front().problem.empty()) {
    ErrorContext c;
    c.key = "parallel.tensor";
    c.hint = "set parallel.tensor and parallel.pipeline to degrees the model divides by";
    throw Error(rows.empty() ? "no layout of this hardware can run the model" : "no layout of this hardware can run the model: " + rows.front().problem, c);
  }
  const LayoutRow& best = rows.front();
  Plan p = plan_fixed_layout(with_degrees(recipe, best.layout), host);
  const ParallelOptions::Searched& searched = recipe.parallel.search;
  // The first searched key carries why; the others belong to the same layout.
  std::string why = rows.size() > 1 ? best.verdict + "; next: " + rows[1].describe() + ", " + rows[1].verdict : best.verdict;
  auto choose = [&](const char* key, const std::string& value) {
    p.choices.push_back({key, value, why});
    why = "the same layout";
  };
  const Layout& l = best.layout;
  if (searched.tensor) choose("parallel.tensor", std::to_string(l.tensor));
  if (searched.pipeline) choose("parallel.pipeline", std::to_string(l.pipeline));
  if (searched.schedule && l.pipeline > 1) choose("parallel.pipeline_schedule", to_string(l.schedule));
  if (searched.virtual_stages && l.pipeline > 1) choose("parallel.virtual_stages", std::to_string(l.virtual_stages));
  if (searched.expert) choose("parallel.expert", std::to_string(l.expert));
  if (searched.context) choose("parallel.context", std::to_string(l.context));
  if (searched.sequence_parallel)
    p.choices.push_back({"parallel.sequence_parallel", l.sequence_parallel ? "true" : "false", l.tensor > 1 ? "same traffic as without, 1/tensor of the activations between regions" : "no tensor parallelism"});
  // The plan keeps the best rows (the stored plan and `dsrun plan` stay small); `dsrun plan --layouts` prints more.
  p.layouts_searched = static_cast<int64_t>(rows.size()) + search.left_out;
  if (rows.size() > kLayoutsKept) rows.resize(kLayoutsKept);
  p.layouts = std::move(rows);
  return p;
}

}  // namespace

namespace {

Plan plan_choosing_checkpoint_mode(const Recipe& recipe, const HostFacts& host) {
  Plan p = plan_with_layout_search(recipe, host);
  // checkpoint.async left unset on GPUs: asynchronous, unless its staging copy is what host memory lacks.
  const CheckpointOptions& ck = recipe.checkpoint;
  if (p.fits || p.binds != "host memory" || !ck.async || ck.async_set) return p;
  Recipe sync = recipe;
  sync.checkpoint.async = false;
  Plan q = plan_with_layout_search(sync, host);
  if (!q.fits) return p;
  q.choices.push_back({"checkpoint.async", "false",
                       "asynchronous saves would keep a staging copy of " + format_bytes(p.checkpoint_disk.staging_per_rank * p.ranks_per_node) +
                           " per node, which host memory lacks; each save pauses " + format_seconds(q.checkpoint_disk.pause_seconds) + " for the write instead"});
  return q;
}

std::string usage_of(const Plan& p) {
  return p.binds == "host memory" ? format_bytes(p.host_memory_needed) + " of host memory, " + format_bytes(p.host_memory_capacity) + " per node"
                                  : format_bytes(p.memory.total()) + " of " + format_bytes(p.memory_capacity) + " per rank";
}

// precision.grad_dtype = "auto" takes fp32 where bf16/fp16 gradients would be summed; where the
// fp32 buffer (4 bytes a gradient and wider reductions) is what keeps a layout from fitting, the
// working dtype instead, saying so: a plan that fits comes before a wider sum.
Plan plan_choosing_gradient_dtype(const Recipe& recipe, const HostFacts& host) {
  Plan p = plan_choosing_checkpoint_mode(recipe, host);
  const std::optional<Recipe> narrow = recipe_with_working_gradients(recipe);
  if (p.fits || !narrow || p.modes.gradient_dtype == recipe.precision.dtype) return p;
  Plan q = plan_choosing_checkpoint_mode(*narrow, host);
  if (!q.fits) return p;
  q.choices.push_back({"precision.grad_dtype", to_string(recipe.precision.dtype),
                       std::string("gradients accumulated in fp32 would need ") + usage_of(p) + "; in " + to_string(recipe.precision.dtype) + " it fits (" + usage_of(q) + ")"});
  return q;
}

}  // namespace

// parallel.offload = "auto": the least offload that fits, in the order it costs time: none, the
// optimizer, then (ZeRO-3) the parameters too. Each is planned whole (layout search, ZeRO stage,
// micro batch, recomputation); the delayed update, where asked for, only with something offloaded.
Plan make_plan(const Recipe& recipe, const HostFacts& host) {
  if (!recipe.parallel.offload_auto) return plan_choosing_gradient_dtype(recipe, host);
  std::optional<Plan> shown;
  std::string refused;
  for (Offload offload : {Offload::None, Offload::Optimizer, Offload::OptimizerAndParams}) {
    Recipe alt = recipe;
    alt.parallel.offload = offload;
    alt.parallel.offload_auto = false;
    if (offload == Offload::None) alt.parallel.delayed_update = false;
    LayoutDecided decided;
    if (!layout_problems(alt, layout_of_recipe(alt, &decided), decided).empty()) continue;  // e.g. parameters with a pipeline or a stage below 3
    Plan p = plan_choosing_gradient_dtype(alt, host);
    if (p.fits) {
      p.choices.insert(p.choices.begin(), {"parallel.offload", to_string(offload),
                                           shown ? refused + "; " + to_string(offload) + " is the least that fits (" + format_bytes(p.memory.total()) + " of " + format_bytes(p.memory_capacity) + " per rank)"
                                                 : "nothing needs offloading: it fits on the devices (" + format_bytes(p.memory.total()) + " of " + format_bytes(p.memory_capacity) + " per rank)" +
                                                       (recipe.parallel.delayed_update ? "; parallel.delayed_update has nothing to delay" : "")});
      return p;
    }
    refused += std::string(refused.empty() ? "" : "; ") + to_string(offload) + " would need " + usage_of(p);
    shown = std::move(p);
  }
  DSRUN_ASSERT(shown.has_value(), "offload none is always a candidate");
  shown->choices.insert(shown->choices.begin(), {"parallel.offload", to_string(shown->layout.offload), "nothing fits: " + refused + "; the most offloaded is shown"});
  return *shown;
}

}  // namespace dsrun
