// The layout search: every (tensor, pipeline, schedule, virtual stages, sequence parallelism,
// expert parallelism within the data ranks) of the hardware that the model divides by, each planned (the plan then picks ZeRO stage, micro batch and
// recomputation as it does for a fixed layout), ranked by predicted step time among those that fit.
#include "engine/common/error.hpp"
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"

#include <algorithm>
#include <optional>

namespace dsrun {

namespace {

// In pairs up to the square root: a cluster of 100,000 nodes has 409,600,000 devices.
std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; static_cast<int64_t>(d) * d <= n; ++d)
    if (n % d == 0) {
      out.push_back(d);
      if (d != n / d) out.push_back(n / d);
    }
  std::sort(out.begin(), out.end());
  return out;
}

// The first rule a candidate breaks (engine/recipe/layout.cpp), with its key ("" when none).
std::string layout_problem(const Recipe& r, const Layout& l) {
  LayoutDecided decided;
  decided.zero_stage = r.parallel.zero_stage.has_value();  // the planner chooses these for each candidate
  decided.micro = r.batch.micro.has_value();
  std::vector<LayoutProblem> problems = layout_problems(r, l, decided);
  if (problems.empty() && !decided.zero_stage) problems = problems_at_every_stage(r, l, decided);  // (no stage the planner could pick)
  return problems.empty() ? "" : problems.front().message + " (" + problems.front().key + ")";
}

std::string seconds_text(double s) { return format_double(s, 3) + " s"; }

LayoutSearch search_layouts_as_given(const Recipe& recipe, const HostFacts& host, bool every_key);

}  // namespace

// precision.grad_dtype = "auto" as make_plan decides it: where no layout fits with fp32 gradients,
// the layouts in the working dtype, and the search says so.
LayoutSearch search_layouts(const Recipe& recipe, const HostFacts& host, bool every_key) {
  LayoutSearch wide = search_layouts_as_given(recipe, host, every_key);
  const std::optional<Recipe> narrow = recipe_with_working_gradients(recipe);
  if (!narrow || (!wide.rows.empty() && wide.rows.front().fits)) return wide;
  LayoutSearch search = search_layouts_as_given(*narrow, host, every_key);
  if (search.rows.empty() || !search.rows.front().fits) return wide;
  search.note = std::string("no layout fits with gradients accumulated in fp32 (precision.grad_dtype = \"auto\"): these keep them in ") +
                to_string(recipe.precision.dtype);
  return search;
}

namespace {

LayoutSearch search_layouts_as_given(const Recipe& recipe, const HostFacts& host, bool every_key) {
  const ParallelOptions& fixed = recipe.parallel;
  ParallelOptions::Searched searched = fixed.search;
  if (every_key) searched = {true, true, true, true, true, recipe.model.moe.enabled(), fixed.search.context};  // (context: as the recipe says)
  const int devices = recipe.hardware.total_devices();
  const PlannedData measured = planned_data(recipe);
  // Tensor groups stay inside a node (their traffic is every layer's) unless the recipe means otherwise.
  const int tensor_limit = fixed.tensor_across_nodes ? devices : std::min(devices, recipe.hardware.devices_per_node);
  const std::vector<int> tensors = searched.tensor ? divisors(tensor_limit) : std::vector<int>{fixed.tensor};
  std::vector<LayoutRow> rows;
  int64_t left_out = 0;
  for (int t : tensors) {
    if (devices % t != 0) continue;
    for (int pp : searched.pipeline ? divisors(devices / t) : std::vector<int>{fixed.pipeline}) {
      // More stages than layers can never run: counted, not listed (there can be thousands).
      if (searched.pipeline && pp > recipe.model.layers && recipe.model.arch == ModelArch::DeepSeek) {
        ++left_out;
        continue;
      }
      // Context ranks: any degree the devices left and the sequence's 2 × context chunks allow
      // (a decoder's; the rules name what else refuses one).
      std::vector<int> contexts{fixed.context};
      if (searched.context && devices % (t * pp) == 0) {
        contexts.clear();
        for (int c : divisors(devices / (t * pp)))
          if (c == 1 || (recipe.model.arch == ModelArch::DeepSeek && recipe.batch.seq_len % (2 * c) == 0)) contexts.push_back(c);
      }
      for (int context : contexts) {
        const int data = fixed.data_parallel.value_or(devices / (t * pp * context));
        if (data < 1 || data * t * pp * context > devices) continue;
        // Schedules: 1F1B (GPipe holds more for the same bubble, so it is only run when asked for);
        // interleaving with 2 or 4 chunks per rank.
        std::vector<std::pair<PipelineScheduleKind, int>> schedules;
        if (pp == 1) schedules.push_back({PipelineScheduleKind::OneFOneB, 1});
        else if (!searched.schedule && !searched.virtual_stages) schedules.push_back({fixed.pipeline_schedule, fixed.virtual_stages});
        else {
          const bool any_kind = searched.schedule;
          if (any_kind || fixed.pipeline_schedule != PipelineScheduleKind::Interleaved) schedules.push_back({any_kind ? PipelineScheduleKind::OneFOneB : fixed.pipeline_schedule, 1});
          if (any_kind || fixed.pipeline_schedule == PipelineScheduleKind::Interleaved)
            for (int v : searched.virtual_stages ? std::vector<int>{2, 4} : std::vector<int>{fixed.virtual_stages})
              if (v > 1) schedules.push_back({PipelineScheduleKind::Interleaved, v});
        }
        // Expert ranks: any degree the data ranks and the routed experts divide by (the smallest
        // that fits costs the least all-to-all; a larger one holds fewer experts per rank).
        std::vector<int> experts{fixed.expert};
        if (searched.expert) {
          experts.clear();
          for (int ep : divisors(data * context))
            if (recipe.model.moe.enabled() && recipe.model.moe.routed_experts % ep == 0) experts.push_back(ep);
          if (experts.empty()) experts.push_back(1);
        }
        for (auto [kind, v] : schedules)
          for (int ep : experts) {
            LayoutRow row;
            Layout& l = row.layout;
            l = layout_of_recipe(recipe);  // ZeRO stage, micro batch, recomputation, offload as written
            l.tensor = t;
            l.pipeline = pp;
            l.data = data;
            l.schedule = kind;
            l.virtual_stages = v;
            l.expert = ep;
            l.context = context;
            // Sequence parallelism costs no traffic and saves memory: on wherever it applies.
            l.sequence_parallel = searched.sequence_parallel ? t > 1 && recipe.batch.seq_len % t == 0 && !recipe.model.moe.enabled() : fixed.sequence_parallel && t > 1;
            row.problem = layout_problem(recipe, l);
            if (row.problem.empty()) {
              const Plan p = plan_candidate(with_degrees(recipe, l), host, measured);
              row.layout = p.layout;
              row.fits = p.fits;
              row.binds = p.binds;
              if (!p.pipeline_problem.empty()) row.problem = "the pipeline schedule cannot run: " + p.pipeline_problem;
              row.memory_bytes = p.memory.total() + (p.device == Device::Cpu ? p.memory.states.host : 0);
              row.capacity = p.memory_capacity;
              row.host_bytes = p.host_memory_needed;
              row.host_capacity = p.host_memory_capacity;
              row.step_seconds = p.step_seconds;
              row.mfu = p.mfu;
              row.bubble_fraction = p.bubble_fraction;
              row.exposed_comm_seconds = p.exposed_comm_seconds;
            }
            rows.push_back(row);
          }
      }
    }
  }
  auto rank = [](const LayoutRow& r) { return !r.problem.empty() ? 2 : r.fits ? 0 : 1; };
  std::stable_sort(rows.begin(), rows.end(), [&](const LayoutRow& a, const LayoutRow& b) {
    if (rank(a) != rank(b)) return rank(a) < rank(b);
    return rank(a) == 0 ? a.step_seconds < b.step_seconds : a.memory_bytes / std::max(1.0, a.capacity) < b.memory_bytes / std::max(1.0, b.capacity);
  });
  // Why each loses to the first: memory, or where its extra time goes.
  const LayoutRow* best = rows.empty() || !rows.front().fits ? nullptr : &rows.front();
  for (LayoutRow& r : rows) {
    if (!r.problem.empty()) r.verdict = "cannot run: " + r.problem;
    else if (!r.fits && r.binds == "host memory")
      r.verdict = "does not fit: host memory " + format_bytes(r.host_bytes) + " of " + format_bytes(r.host_capacity) + " per node (hardware.host_memory_gib)";
    else if (!r.fits) r.verdict = "does not fit: device memory " + format_bytes(r.memory_bytes) + " of " + format_bytes(r.capacity) + " per rank";
    else if (&r == best) r.verdict = "the fastest that fits: " + seconds_text(r.step_seconds) + " per step, " + format_double(100 * r.mfu, 3) + "% MFU";
    else {
      r.verdict = format_double(100 * (r.step_seconds / best->step_seconds - 1), 3) + "% slower";
      if (r.bubble_fraction > best->bubble_fraction + 1e-9) r.verdict += "; bubble " + format_double(100 * r.bubble_fraction, 3) + "% vs " + format_double(100 * best->bubble_fraction, 3) + "%";
      if (r.exposed_comm_seconds > best->exposed_comm_seconds * 1.05) r.verdict += "; exposed communication " + seconds_text(r.exposed_comm_seconds) + " vs " + seconds_text(best->exposed_comm_seconds);
      if (r.layout.recomputation && !best->layout.recomputation) r.verdict += "; needs recomputation";
      if (r.layout.expert < best->layout.expert && recipe.model.moe.enabled())
        r.verdict += "; runs " + std::to_string(recipe.model.moe.routed_experts / r.layout.expert) + " routed experts per layer vs " +
                     std::to_string(recipe.model.moe.routed_experts / best->layout.expert);
    }
  }
  return {std::move(rows), left_out, ""};
}

}  // namespace

}  // namespace dsrun
