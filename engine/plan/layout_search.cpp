// The layout search: every (tensor, pipeline, schedule, virtual stages, sequence parallelism,
// expert parallelism within the data ranks) of the hardware that the model divides by, each planned (the plan then picks ZeRO stage, micro batch and
// recomputation as it does for a fixed layout), ranked by predicted step time among those that fit.
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"

#include <algorithm>

namespace dsrun {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// Why the recipe cannot run with this layout: the rules the recipe checks for fixed degrees
// (engine/recipe/build.cpp), for a candidate ("" when it can).
std::string layout_problem(const Recipe& r, const LayoutRow& l) {
  const ModelSpec& m = r.model;
  const int t = l.tensor;
  if (m.arch != ModelArch::DeepSeek && (t > 1 || l.pipeline > 1)) return "a ResNet is neither split by tensor nor by pipeline";
  for (const TensorSplitSize& size : tensor_split_sizes(m))
    if (size.value % t != 0) return std::string(size.key) + " = " + std::to_string(size.value) + " not divisible by tensor " + std::to_string(t);
  if (l.pipeline * l.virtual_stages > m.layers) return std::to_string(l.pipeline * l.virtual_stages) + " pipeline pieces for " + std::to_string(m.layers) + " layers";
  if (r.batch.global % l.data != 0) return "global batch " + std::to_string(r.batch.global) + " not divisible by data " + std::to_string(l.data);
  const int64_t per_rank = r.batch.global / l.data;
  if (r.batch.micro && per_rank % *r.batch.micro != 0) return "micro batch " + std::to_string(*r.batch.micro) + " does not divide the per-rank batch " + std::to_string(per_rank);
  if (l.schedule == PipelineScheduleKind::Interleaved && l.pipeline > 1 && per_rank % l.pipeline != 0) return "interleaving needs micro-batches in multiples of the stages";
  if (l.pipeline > 1 && r.parallel.zero_stage && *r.parallel.zero_stage == 3) return "ZeRO-3 runs without pipeline parallelism";
  if (l.sequence_parallel && (r.batch.seq_len % t != 0 || m.moe.enabled())) return "sequence parallelism needs seq_len divisible by tensor and no MoE";
  if (l.expert > 1 && !m.moe.enabled()) return "expert parallelism needs routed experts";
  if (l.expert > 1 && m.moe.routed_experts % l.expert != 0) return "model.moe.routed_experts = " + std::to_string(m.moe.routed_experts) + " not divisible by expert " + std::to_string(l.expert);
  if (l.data % l.expert != 0) return "data " + std::to_string(l.data) + " not divisible by expert " + std::to_string(l.expert);
  return "";
}

std::string seconds_text(double s) { return format_double(s, 3) + " s"; }

}  // namespace

std::string LayoutRow::describe() const {
  std::string s = "tensor " + std::to_string(tensor) + " × pipeline " + std::to_string(pipeline);
  if (pipeline > 1) s += " (" + std::string(to_string(schedule)) + (virtual_stages > 1 ? " × " + std::to_string(virtual_stages) : "") + ")";
  s += " × data " + std::to_string(data);
  if (expert > 1) s += " (expert " + std::to_string(expert) + ")";
  if (sequence_parallel) s += ", sequence-parallel";
  return s;
}

Recipe with_layout(const Recipe& recipe, const LayoutRow& row) {
  Recipe r = recipe;
  ParallelOptions& p = r.parallel;
  p.tensor = row.tensor;
  p.pipeline = row.pipeline;
  p.pipeline_schedule = row.schedule;
  p.virtual_stages = row.virtual_stages;
  p.sequence_parallel = row.sequence_parallel;
  p.data_parallel = row.data;
  p.expert = row.expert;
  p.search = {};
  return r;
}

std::vector<LayoutRow> search_layouts(const Recipe& recipe, const HostFacts& host, bool every_key) {
  const ParallelOptions& fixed = recipe.parallel;
  ParallelOptions::Searched searched = fixed.search;
  if (every_key) searched = {true, true, true, true, true, recipe.model.moe.enabled()};
  const int devices = recipe.hardware.total_devices();
  const double data_bytes = planned_data_bytes(recipe);
  // Tensor groups stay inside a node (their traffic is every layer's).
  const std::vector<int> tensors = searched.tensor ? divisors(std::min(devices, recipe.hardware.devices_per_node)) : std::vector<int>{fixed.tensor};
  std::vector<LayoutRow> rows;
  for (int t : tensors) {
    if (devices % t != 0) continue;
    for (int pp : searched.pipeline ? divisors(devices / t) : std::vector<int>{fixed.pipeline}) {
      const int data = fixed.data_parallel.value_or(devices / (t * pp));
      if (data < 1 || data * t * pp > devices) continue;
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
        for (int ep : divisors(data))
          if (recipe.model.moe.enabled() && recipe.model.moe.routed_experts % ep == 0) experts.push_back(ep);
        if (experts.empty()) experts.push_back(1);
      }
      for (auto [kind, v] : schedules)
        for (int ep : experts) {
          LayoutRow row;
          row.tensor = t;
          row.pipeline = pp;
          row.data = data;
          row.schedule = kind;
          row.virtual_stages = v;
          row.expert = ep;
          // Sequence parallelism costs no traffic and saves memory: on wherever it applies.
          row.sequence_parallel = searched.sequence_parallel ? t > 1 && recipe.batch.seq_len % t == 0 && !recipe.model.moe.enabled() : fixed.sequence_parallel && t > 1;
          row.problem = layout_problem(recipe, row);
          if (row.problem.empty()) {
            const Plan p = plan_candidate(with_layout(recipe, row), host, data_bytes);
            row.zero_stage = p.zero_stage;
            row.micro = p.micro_batch;
            row.checkpointing = p.activation_checkpointing;
            row.fits = p.fits;
            row.memory_bytes = p.memory.total() + (p.device == Device::Cpu ? p.memory.states.host : 0);
            row.capacity = p.memory_capacity;
            row.step_seconds = p.step_seconds;
            row.mfu = p.mfu;
            row.bubble_fraction = p.bubble_fraction;
            row.exposed_comm_seconds = p.exposed_comm_seconds;
          }
          rows.push_back(row);
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
    else if (!r.fits) r.verdict = "does not fit: " + format_bytes(r.memory_bytes) + " of " + format_bytes(r.capacity) + " per rank";
    else if (&r == best) r.verdict = "the fastest that fits: " + seconds_text(r.step_seconds) + " per step, " + format_double(100 * r.mfu, 3) + "% MFU";
    else {
      r.verdict = format_double(100 * (r.step_seconds / best->step_seconds - 1), 3) + "% slower";
      if (r.bubble_fraction > best->bubble_fraction + 1e-9) r.verdict += "; bubble " + format_double(100 * r.bubble_fraction, 3) + "% vs " + format_double(100 * best->bubble_fraction, 3) + "%";
      if (r.exposed_comm_seconds > best->exposed_comm_seconds * 1.05) r.verdict += "; exposed communication " + seconds_text(r.exposed_comm_seconds) + " vs " + seconds_text(best->exposed_comm_seconds);
      if (r.checkpointing && !best->checkpointing) r.verdict += "; needs recomputation";
      if (r.expert < best->expert && recipe.model.moe.enabled())
        r.verdict += "; runs " + std::to_string(recipe.model.moe.routed_experts / r.expert) + " routed experts per layer vs " + std::to_string(recipe.model.moe.routed_experts / best->expert);
    }
  }
  return rows;
}

}  // namespace dsrun
