// The layout value and its rules. Every rule a layout must keep is here, once: the recipe reports
// them as errors for the keys it fixes, the search skips candidates that break them, the planner
// only picks ZeRO stages and micro batches that keep them (docs/architecture.md, "The layout").
#include "engine/recipe/layout.hpp"

#include "engine/common/text.hpp"

#include <algorithm>

namespace dsrun {

MeshShape Layout::mesh_shape() const {
  MeshShape m;
  m.pipeline = pipeline;
  m.data = data_ranks();
  m.tensor = tensor;
  m.expert = expert;
  m.context = context;
  return m;
}

std::vector<std::pair<std::string, Value>> Layout::to_config_keys() const {
  return {{"parallel.pipeline", Value::of_int(pipeline)},
          {"parallel.data_parallel", Value::of_int(data)},
          {"parallel.tensor", Value::of_int(tensor)},
          {"parallel.expert", Value::of_int(expert)},
          {"parallel.context", Value::of_int(context)},
          {"parallel.pipeline_schedule", Value::of_string(to_string(schedule))},
          {"parallel.virtual_stages", Value::of_int(virtual_stages)},
          {"parallel.sequence_parallel", Value::of_bool(sequence_parallel)},
          {"parallel.zero_stage", Value::of_int(zero_stage)},
          {"batch.micro", Value::of_int(micro)},
          {"parallel.activation_checkpointing", Value::of_string(recomputation ? "full" : "none")},
          {"parallel.offload", Value::of_string(to_string(offload))},
          {"parallel.delayed_update", Value::of_bool(delayed_update)}};
}

std::string Layout::describe() const {
  std::string s = "tensor " + std::to_string(tensor) + " × pipeline " + std::to_string(pipeline);
  if (pipeline > 1) s += " (" + std::string(to_string(schedule)) + (virtual_stages > 1 ? " × " + std::to_string(virtual_stages) : "") + ")";
  s += " × data " + std::to_string(data);
  if (expert > 1) s += " (expert " + std::to_string(expert) + ")";
  if (context > 1) s += " × context " + std::to_string(context);
  if (sequence_parallel) s += ", sequence-parallel";
  return s;
}

bool Layout::operator==(const Layout& o) const {
  return pipeline == o.pipeline && data == o.data && tensor == o.tensor && expert == o.expert && context == o.context && schedule == o.schedule && virtual_stages == o.virtual_stages &&
         sequence_parallel == o.sequence_parallel && zero_stage == o.zero_stage && micro == o.micro && recomputation == o.recomputation && offload == o.offload &&
         delayed_update == o.delayed_update;
}

Layout layout_of_recipe(const Recipe& r, LayoutDecided* decided) {
  const ParallelOptions& p = r.parallel;
  Layout l;
  l.tensor = p.tensor;
  l.pipeline = p.pipeline;
  l.data = p.data_parallel_or_auto(r.hardware);
  l.expert = p.expert;
  l.context = p.context;
  l.schedule = p.pipeline_schedule;
  l.virtual_stages = p.virtual_stages;
  l.sequence_parallel = p.sequence_parallel;
  l.zero_stage = p.zero_stage.value_or(0);
  l.micro = r.batch.micro.value_or(1);
  l.recomputation = p.activation_checkpointing == Checkpointing::Full;
  l.offload = p.offload;
  l.delayed_update = p.delayed_update;
  if (decided) {
    LayoutDecided& d = *decided;
    d.tensor = !p.search.tensor;
    d.pipeline = !p.search.pipeline;
    // "auto" data ranks are the devices left by tensor × pipeline: known once both are.
    d.data = p.data_parallel.has_value() || (d.tensor && d.pipeline && d.context);
    d.expert = !p.search.expert;
    d.context = !p.search.context;
    d.schedule = !p.search.schedule;
    d.virtual_stages = !p.search.virtual_stages;
    d.sequence_parallel = !p.search.sequence_parallel;
    d.zero_stage = p.zero_stage.has_value();
    d.micro = r.batch.micro.has_value();
    d.offload = !p.offload_auto;
  }
  return l;
}

Recipe with_degrees(const Recipe& recipe, const Layout& l) {
  Recipe r = recipe;
  ParallelOptions& p = r.parallel;
  p.tensor = l.tensor;
  p.pipeline = l.pipeline;
  p.pipeline_schedule = l.schedule;
  p.virtual_stages = l.virtual_stages;
  p.sequence_parallel = l.sequence_parallel;
  p.data_parallel = l.data;
  p.expert = l.expert;
  p.context = l.context;
  p.search = {};
  return r;
}

Recipe with_layout(const Recipe& recipe, const Layout& l) {
  Recipe r = with_degrees(recipe, l);
  ParallelOptions& p = r.parallel;
  p.zero_stage = l.zero_stage;
  p.activation_checkpointing = l.recomputation ? Checkpointing::Full : Checkpointing::None;
  p.offload = l.offload;
  p.offload_auto = false;
  p.delayed_update = l.delayed_update;
  r.batch.micro = l.micro;
  return r;
}

int Placement::nodes_spanned(int64_t start, int64_t stride, int64_t count) const {
  if (count <= 1) return 1;
  if (stride >= ranks_per_node) return static_cast<int>(std::min<int64_t>(count, nodes));
  return static_cast<int>((start + (count - 1) * stride) / ranks_per_node - start / ranks_per_node + 1);
}

Placement placement_of(const HardwareSpec& hw, const Layout& l) {
  Placement p;
  p.nodes = std::max(1, hw.nodes);
  p.ranks_per_node = std::max(1, (l.world() + p.nodes - 1) / p.nodes);
  return p;
}

namespace {

struct Rules {
  const Recipe& r;
  const Layout& l;
  const LayoutDecided& d;
  std::vector<LayoutProblem> out;

  void add(std::string key, std::string message, std::string fix, std::vector<std::string> related = {}) {
    out.push_back({std::move(key), std::move(message), std::move(fix), std::move(related)});
  }

  // The degrees against the hardware: the replicas × model-parallel ranks fit the devices.
  void devices() {
    const int devices = r.hardware.total_devices();
    if (devices <= 0 || !d.tensor || !d.pipeline || !d.context) return;
    std::string mp = l.pipeline > 1 ? "tensor " + std::to_string(l.tensor) + " × pipeline " + std::to_string(l.pipeline) : "tensor " + std::to_string(l.tensor);
    if (l.context > 1) mp += " × context " + std::to_string(l.context);
    const std::string degrees = l.context > 1 ? "tensor × pipeline × context" : "tensor × pipeline";
    std::vector<std::string> hw{"parallel.tensor", "parallel.pipeline", "hardware.devices_per_node", "hardware.nodes"};
    if (l.context > 1) hw.push_back("parallel.context");
    if (l.ranks_per_replica() > devices) {
      add(l.context > 1 && l.tensor * l.pipeline <= devices ? "parallel.context" : l.tensor > devices || l.pipeline == 1 ? "parallel.tensor" : "parallel.pipeline",
          mp + " = " + std::to_string(l.ranks_per_replica()) + " ranks per replica but the hardware has " + std::to_string(devices) + " devices",
          "use " + degrees + " <= " + std::to_string(devices), hw);
    } else if (r.parallel.data_parallel && d.data && l.world() > devices) {
      add("parallel.data_parallel", std::to_string(l.data) + " × " + mp + " = " + std::to_string(l.world()) + " ranks but the hardware has " + std::to_string(devices) + " devices",
          "use data_parallel <= " + std::to_string(devices / l.ranks_per_replica()) + ", or \"auto\"", hw);
    } else if (!r.parallel.data_parallel && devices % l.ranks_per_replica() != 0) {
      add(l.context > 1 ? "parallel.context" : l.pipeline > 1 ? "parallel.pipeline" : "parallel.tensor",
          mp + " = " + std::to_string(l.ranks_per_replica()) + " ranks per replica does not divide the " + std::to_string(devices) + " devices",
          "use " + degrees + " dividing " + std::to_string(devices), hw);
    }
  }

  // Tensor parallelism: every split size divides by the degree (whole heads and KV heads per
  // rank), and the group stays inside a node: its traffic is every layer's, twice each way
  // (Megatron-LM and torchtitan keep it on NVLink). A recipe that means it says so.
  void tensor() {
    if (!d.tensor || l.tensor == 1) return;
    const ModelSpec& m = r.model;
    const std::string tt = std::to_string(l.tensor);
    if (m.arch != ModelArch::DeepSeek) {
      add("parallel.tensor", "tensor parallelism splits a decoder's heads and MLP; a ResNet has neither", "set parallel.tensor = 1", {"model.arch"});
      return;
    }
    for (const TensorSplitSize& size : tensor_split_sizes(m)) {
      if (size.value % l.tensor == 0) continue;
      int64_t best = 1;
      for (int64_t t = 1; t <= l.tensor; ++t)
        if (size.value % t == 0 && r.hardware.total_devices() % t == 0) best = t;
      add("parallel.tensor", "tensor = " + tt + " does not divide " + size.key + " = " + std::to_string(size.value) + " (" + size.why + ")",
          "use parallel.tensor = " + std::to_string(best) + ", or a " + size.key + " divisible by " + tt, {size.key});
    }
    // Without peer access every tensor all-reduce bounces through host memory, twice per layer each
    // way; no published setup trains so (consumer GPUs use data and pipeline parallelism).
    if (r.hardware.device == Device::Cuda && !r.hardware.p2p)
      add("parallel.tensor", "tensor = " + tt + " needs GPUs that reach each other directly, and hardware.p2p = false: every layer's activations would go through host memory",
          "use parallel.tensor = 1 (data or pipeline parallelism across these GPUs), or set hardware.p2p = true if they have peer access (`nvidia-smi topo -p2p r`)",
          {"hardware.p2p"});
    if (r.hardware.nodes > 1 && !r.parallel.tensor_across_nodes && d.pipeline && d.data) {
      const Placement at = placement_of(r.hardware, l);
      if (at.ranks_per_node % l.tensor != 0) {
        int best = 1;
        for (int t = 1; t <= at.ranks_per_node; ++t)
          if (at.ranks_per_node % t == 0 && l.tensor % t == 0) best = t;
        add("parallel.tensor",
            "a tensor group of " + tt + " ranks would span nodes of " + std::to_string(at.ranks_per_node) + " ranks: every layer's activations would cross the network" +
                (r.hardware.inter_node_bandwidth > 0 ? " (" + format_bandwidth(r.hardware.inter_node_bandwidth) + " per node instead of " + format_bandwidth(r.hardware.link_bandwidth) + " per device)" : ""),
            "use parallel.tensor = " + std::to_string(best) + " (and pipeline or data parallelism across nodes), or set parallel.tensor_across_nodes = true if you mean it",
            {"hardware.devices_per_node", "hardware.nodes"});
      }
    }
  }

  void sequence() {
    if (!d.sequence_parallel || !l.sequence_parallel) return;
    if (r.model.moe.enabled())
      add("parallel.sequence_parallel", "sequence parallelism with MoE layers is not supported yet (the router would see part of the sequence)", "set parallel.sequence_parallel = false",
          {"model.moe.routed_experts"});
    else if (d.tensor && l.tensor > 1 && r.batch.seq_len % l.tensor != 0)
      add("batch.seq_len",
          "sequence length " + std::to_string(r.batch.seq_len) + " does not divide by parallel.tensor = " + std::to_string(l.tensor) +
              " (sequence parallelism gives each tensor rank an equal part of it)",
          "use a multiple of " + std::to_string(l.tensor) + ", or parallel.sequence_parallel = false", {"parallel.sequence_parallel", "parallel.tensor"});
  }

  // Pipeline parallelism: a decoder with a layer for every piece, a schedule that can be built,
  // ZeRO stages that keep each stage's parameters whole (0-2).
  void pipeline() {
    if (d.schedule && d.virtual_stages) {
      if (l.schedule == PipelineScheduleKind::Interleaved && l.virtual_stages < 2)
        add("parallel.virtual_stages", "the interleaved schedule runs at least 2 chunks per pipeline rank", "set parallel.virtual_stages = 2 (or more), or pipeline_schedule = \"1f1b\"",
            {"parallel.pipeline_schedule"});
      if (l.schedule != PipelineScheduleKind::Interleaved && l.virtual_stages > 1)
        add("parallel.virtual_stages", std::string("the ") + to_string(l.schedule) + " schedule runs one chunk per pipeline rank",
            "set parallel.pipeline_schedule = \"interleaved\", or virtual_stages = 1", {"parallel.pipeline_schedule"});
    }
    if (!d.pipeline || l.pipeline == 1) return;
    if (r.model.arch != ModelArch::DeepSeek) {
      add("parallel.pipeline", "pipeline parallelism splits a decoder's layers into stages; a ResNet is not split", "set parallel.pipeline = 1", {"model.arch"});
      return;
    }
    const int v = d.virtual_stages ? l.virtual_stages : 1;
    if (l.pipeline * v > r.model.layers) {
      int best = 1;
      for (int p = 1; p * v <= r.model.layers; ++p)
        if (r.hardware.total_devices() % (p * (d.tensor ? l.tensor : 1)) == 0) best = p;
      add("parallel.pipeline",
          std::to_string(l.pipeline) + " stages" + (v > 1 ? " × " + std::to_string(v) + " virtual stages" : "") + " need at least as many layers, and the model has " +
              std::to_string(r.model.layers),
          "use parallel.pipeline = " + std::to_string(best) + (v > 1 ? ", fewer virtual stages," : "") + " or more model.layers", {"model.layers", "parallel.virtual_stages"});
    }
    if (d.zero_stage && l.zero_stage == 3)
      add("parallel.zero_stage",
          "ZeRO-3 with pipeline parallelism is not supported (each stage would gather its layers again for every micro-batch's forward and backward, which the schedule interleaves)",
          "set parallel.zero_stage = 2 (gradients and optimizer states stay sharded over the data ranks of each stage), or parallel.pipeline = 1", {"parallel.pipeline"});
  }

  // Expert parallelism: routed experts to shard, as many on every rank, and data ranks to carve
  // the expert ranks out of.
  void expert() {
    if (!d.expert || l.expert == 1) return;
    const MoeSpec& moe = r.model.moe;
    const std::string ep = std::to_string(l.expert);
    if (r.model.arch != ModelArch::DeepSeek || !moe.enabled()) {
      add("parallel.expert", "expert parallelism shards a MoE layer's routed experts, and this model has none", "set parallel.expert = 1, or model.moe.routed_experts > 0",
          {"model.moe.routed_experts"});
      return;
    }
    auto best = [&](int limit) {  // the largest degree <= limit dividing the experts and the data ranks
      int b = 1;
      for (int e = 1; e <= limit; ++e)
        if (moe.routed_experts % e == 0 && (!d.data || l.data_ranks() % e == 0)) b = e;
      return std::to_string(b);
    };
    if (moe.routed_experts % l.expert != 0)
      add("parallel.expert", "expert = " + ep + " does not divide model.moe.routed_experts = " + std::to_string(moe.routed_experts) + " (each rank keeps as many experts)",
          "use parallel.expert = " + best(l.expert) + ", or a number of routed experts divisible by " + ep, {"model.moe.routed_experts"});
    else if (d.data && l.data_ranks() % l.expert != 0)
      add("parallel.expert",
          "expert = " + ep + " does not divide the " + std::to_string(l.data_ranks()) + (l.context > 1 ? " data × context" : " data-parallel") +
              " ranks (expert ranks are carved out of them)",
          "use parallel.expert = " + best(l.expert) + ", or data_parallel a multiple of " + ep, {"parallel.data_parallel"});
  }

  // Context parallelism: a decoder whose sequences cut into 2 × context equal chunks; what needs
  // the whole sequence on one rank (multi-token prediction's shift, an expert capacity counted per
  // micro-batch, a pipeline's activations sized for whole sequences) waits. A router's balance
  // statistics are summed over the context group (UnitRunner::sum_over_sequences); packed
  // documents, read after the layout, are refused by build_data.
  void context() {
    if (!d.context || l.context == 1) return;
    const std::string cp = std::to_string(l.context);
    const std::vector<std::string> context_key{"parallel.context"};
    if (r.model.arch != ModelArch::DeepSeek) {
      add("parallel.context", "context parallelism splits a decoder's sequences; a ResNet has none", "set parallel.context = 1", {"model.arch"});
      return;
    }
    if (r.batch.seq_len % (2 * l.context) != 0) {
      const int64_t step = 2 * l.context, lower = r.batch.seq_len / step * step;
      add("batch.seq_len",
          "sequence length " + std::to_string(r.batch.seq_len) + " does not cut into 2 × context = " + std::to_string(step) +
              " equal chunks (each of the " + cp + " context ranks holds an early and a late chunk)",
          "use a multiple of " + std::to_string(step) + " (" + (lower > 0 ? std::to_string(lower) + " or " : "") + std::to_string(lower + step) + "), or another parallel.context",
          context_key);
    }
    auto not_yet = [&](const std::string& what, const std::string& fix, const std::string& related) {
      add("parallel.context", "context parallelism " + what + " is not supported yet", fix, {related});
    };
    if (r.model.mtp.enabled()) not_yet("with multi-token prediction (its depths shift whole sequences)", "set parallel.context = 1, or model.mtp.depth = 0", "model.mtp.depth");
    if (r.model.moe.enabled() && r.model.moe.capacity_factor > 0)
      not_yet("with an expert capacity (it would count each rank's part of a micro-batch, not the micro-batch)",
              "set model.moe.capacity_factor = 0, or parallel.context = 1", "model.moe.capacity_factor");
    if (d.pipeline && l.pipeline > 1) not_yet("with pipeline parallelism", "set parallel.context = 1, or parallel.pipeline = 1", "parallel.pipeline");
  }

  // Multi-token prediction runs beside the head over whole sequences (pipelines copy the embedding
  // to the last stage, as they do tied embeddings; expert parallelism shards its block's experts).
  void mtp() {
    if (!r.model.mtp.enabled()) return;
    const std::vector<std::string> depth = {"model.mtp.depth"};
    if (d.sequence_parallel && l.sequence_parallel)
      add("parallel.sequence_parallel", "multi-token prediction shifts whole sequences, which sequence parallelism splits", "set parallel.sequence_parallel = false, or model.mtp.depth = 0",
          depth);
  }

  // global = micro × accumulation × data, and the interleaved schedule's micro-batches come in
  // multiples of the stages.
  void batch() {
    if (!d.data || l.data < 1) return;
    const BatchOptions& b = r.batch;
    const int64_t dp = l.data;
    // Only for messages: the planner asks these rules of every micro-batch candidate.
    const auto dp_text = [&] {
      return std::to_string(dp) + (r.parallel.data_parallel ? "" : l.ranks_per_replica() > 1 ? " (auto: the devices / (tensor × pipeline × context))" : " (auto: every device)");
    };
    if (b.global % dp != 0) {
      const int64_t lower = b.global / dp * dp, upper = lower + dp;
      add("batch.global", "global batch " + std::to_string(b.global) + " does not split evenly over data_parallel = " + dp_text() + " ranks",
          "use a multiple of " + std::to_string(dp) + ": " + (lower > 0 ? std::to_string(lower) + " or " : "") + std::to_string(upper),
          // the keys that make the data ranks: written, data_parallel; "auto", the devices and the
          // model-parallel degrees (the error points at whichever the user, or a base, wrote last)
          r.parallel.data_parallel ? std::vector<std::string>{"parallel.data_parallel"}
                                   : std::vector<std::string>{"parallel.data_parallel", "hardware.devices_per_node", "hardware.nodes", "parallel.tensor", "parallel.pipeline"});
      return;
    }
    const int64_t per_rank = b.global / dp;
    const bool interleaved = d.pipeline && d.schedule && l.pipeline > 1 && l.schedule == PipelineScheduleKind::Interleaved;
    if (d.micro) {
      if (l.micro > per_rank) {
        add("batch.micro", "micro batch " + std::to_string(l.micro) + " exceeds the per-rank batch global/data_parallel = " + std::to_string(per_rank),
            "use micro <= " + std::to_string(per_rank) + ", or raise batch.global", {"batch.global", "parallel.data_parallel"});
        return;
      }
      if (per_rank % l.micro != 0) {
        add("batch.micro",
            "global (" + std::to_string(b.global) + ") != micro (" + std::to_string(l.micro) + ") x accumulation x data_parallel (" + dp_text() + ") for any whole accumulation",
            "use a micro batch that divides " + std::to_string(per_rank) + ", such as " + std::to_string(closest_divisor(per_rank, l.micro)),
            {"batch.global", "parallel.data_parallel"});
        return;
      }
      const int64_t accumulation = per_rank / l.micro;
      if (interleaved && accumulation % l.pipeline != 0)
        add("batch.micro",
            "the interleaved schedule needs the micro-batches per step (" + std::to_string(accumulation) +
                " = global / data_parallel / micro) to be a multiple of parallel.pipeline = " + std::to_string(l.pipeline),
            "use a batch.global or batch.micro giving a multiple of " + std::to_string(l.pipeline) + " micro-batches, or pipeline_schedule = \"1f1b\"",
            {"batch.global", "parallel.pipeline_schedule"});
    } else if (interleaved && per_rank % l.pipeline != 0) {
      add("batch.global",
          "the interleaved schedule needs the micro-batches per step to be a multiple of parallel.pipeline = " + std::to_string(l.pipeline) + ", and the per-rank batch " +
              std::to_string(per_rank) + " has no such split",
          "use a batch.global whose per-rank share divides by " + std::to_string(l.pipeline) + ", or pipeline_schedule = \"1f1b\"", {"parallel.pipeline_schedule"});
    }
  }

  void offload() {
    if (!d.offload) return;  // "auto": make_plan tries only what these rules allow
    if (d.zero_stage && l.offload == Offload::OptimizerAndParams && l.zero_stage != 3)
      add("parallel.offload", "offloading parameters needs ZeRO stage 3 (only stage 3 shards parameters)", "set parallel.zero_stage = 3, or offload = \"optimizer\"",
          {"parallel.zero_stage"});
    if (d.zero_stage && l.offload == Offload::Optimizer && l.zero_stage == 0)
      add("parallel.offload", "offloading the optimizer needs ZeRO stage 1, 2 or 3 (ZeRO-Offload moves the optimizer shards)",
          "set parallel.zero_stage to 1, 2 or 3 (or \"auto\"), or offload = \"none\"", {"parallel.zero_stage"});
    if (l.delayed_update && l.offload == Offload::None)
      add("parallel.delayed_update", "the delayed update is a way of running an offloaded optimizer, and nothing is offloaded",
          "set parallel.offload = \"optimizer\" (or \"optimizer+params\"), or delayed_update = false", {"parallel.offload"});
  }

  static std::string format_bandwidth(double bytes_per_second) { return format_double(bytes_per_second / 1e9, 3) + " GB/s"; }
};

}  // namespace

std::vector<LayoutProblem> layout_problems(const Recipe& recipe, const Layout& layout, const LayoutDecided& decided) {
  Rules rules{recipe, layout, decided, {}};
  rules.devices();
  const bool degrees_fit = rules.out.empty();  // the batch math of degrees the hardware lacks says nothing more
  rules.tensor();
  rules.sequence();
  rules.pipeline();
  rules.expert();
  rules.mtp();
  rules.context();
  if (degrees_fit) rules.batch();
  rules.offload();
  return std::move(rules.out);
}

std::vector<LayoutProblem> problems_at_every_stage(const Recipe& recipe, const Layout& layout, const LayoutDecided& decided) {
  LayoutDecided staged = decided;
  staged.zero_stage = true;
  std::vector<LayoutProblem> first_of_each;
  for (int stage = 3; stage >= 0; --stage) {
    Layout l = layout;
    l.zero_stage = stage;
    std::vector<LayoutProblem> problems = layout_problems(recipe, l, staged);
    if (problems.empty()) return {};
    const bool seen = std::any_of(first_of_each.begin(), first_of_each.end(), [&](const LayoutProblem& p) { return p.message == problems.front().message; });
    if (!seen) first_of_each.push_back(problems.front());
  }
  return first_of_each;
}

}  // namespace dsrun
