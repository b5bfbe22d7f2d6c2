// Plan -> text table and JSON. Both show the same fields; JSON keeps raw numbers (bytes, seconds).
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"

#include <nlohmann/json.hpp>

namespace dsrun {

namespace {

std::string sharded(int stage, int needed_stage, int dp) {
  return stage >= needed_stage && dp > 1 ? "sharded 1/" + std::to_string(dp) : "replicated";
}

const char* kernel_name(AttentionKernel k) { return k == AttentionKernel::Flash ? "flash" : "math"; }

}  // namespace

namespace {
std::string layout_table(const std::vector<LayoutRow>& rows) {
  TextTable t({"layout", "ZeRO", "micro", "recompute", "memory per rank", "step", "MFU", "verdict"});
  for (const auto& r : rows) {
    if (!r.problem.empty()) {
      t.add({r.describe(), "", "", "", "", "", "", r.verdict});
      continue;
    }
    const Layout& l = r.layout;
    t.add({r.describe(), std::to_string(l.zero_stage), std::to_string(l.micro), l.recomputation ? "full" : "none", format_bytes(r.memory_bytes) + " of " + format_bytes(r.capacity),
           format_seconds(r.step_seconds), format_double(100 * r.mfu, 3) + "%", r.verdict});
  }
  return t.render("  ");
}

nlohmann::ordered_json row_json(const LayoutRow& r) {
  const Layout& l = r.layout;
  return {{"tensor", l.tensor}, {"pipeline", l.pipeline}, {"data", l.data}, {"expert", l.expert}, {"context", l.context}, {"schedule", to_string(l.schedule)}, {"virtual_stages", l.virtual_stages},
          {"sequence_parallel", l.sequence_parallel}, {"problem", r.problem}, {"fits", r.fits}, {"binds", r.binds}, {"zero_stage", l.zero_stage},
          {"micro", l.micro}, {"checkpointing", l.recomputation}, {"memory_bytes", r.memory_bytes}, {"capacity", r.capacity}, {"host_bytes", r.host_bytes},
          {"host_capacity", r.host_capacity}, {"step_seconds", r.step_seconds}, {"mfu", r.mfu}, {"bubble_fraction", r.bubble_fraction}, {"verdict", r.verdict}};
}

// `--layouts` prints at most this many rows (a 100,000-node cluster has thousands of layouts).
constexpr size_t kLayoutsPrinted = 50;
}  // namespace

std::string render_layouts(const LayoutSearch& search, const Recipe& recipe) {
  const std::vector<LayoutRow>& rows = search.rows;
  std::string out = "layouts of " + recipe.hardware.name + " (" + std::to_string(recipe.hardware.total_devices()) + " devices) for " +
                    (recipe.model.name.empty() ? std::string("the model") : recipe.model.name) + ", fastest that fits first\n";
  out += "(each planned as dsrun plan does: the lowest ZeRO stage that fits, then the largest micro batch (a pipeline's smallest), recomputation only if needed)\n";
  if (!search.note.empty()) out += "(" + search.note + ")\n";
  out += "\n";
  out += layout_table(std::vector<LayoutRow>(rows.begin(), rows.begin() + std::min(kLayoutsPrinted, rows.size())));
  const int64_t left = static_cast<int64_t>(rows.size() - std::min(kLayoutsPrinted, rows.size())) + search.left_out;
  if (left > 0)
    out += "\n  " + std::to_string(left) + " more left out (" + std::to_string(search.left_out) +
           " with more pipeline stages than the model has layers; the rest rank below these: --json lists them)\n";
  return out;
}

std::string layouts_to_json(const LayoutSearch& search) {
  nlohmann::ordered_json j = nlohmann::ordered_json::array();
  for (const auto& r : search.rows) j.push_back(row_json(r));
  return j.dump(1);
}

std::string render_plan(const Plan& p) {
  std::string out;
  auto section = [&](const std::string& title) { out += "\n" + title + "\n"; };
  auto line = [&](const std::string& text) { out += "  " + text + "\n"; };
  const ModelCost& c = p.cost;
  const bool images = p.arch == ModelArch::ResNet;

  out += "plan for " + (p.recipe.empty() ? std::string("(recipe text)") : p.recipe) + "\n";
  line("model      " + p.model + ": " + format_count(c.params) + " parameters" +
       (c.active_params < c.params ? " (" + format_count(c.active_params) + " active per token)" : ""));
  line("hardware   " + p.hardware + " (" + to_string(p.device) + ")");

  section("topology");
  line(std::to_string(p.nodes) + " node(s) x " + std::to_string(p.devices_per_node) + " devices; " + std::to_string(p.world_size) +
       " ranks (" + std::to_string(p.ranks_per_node) + " per node); data parallel " + std::to_string(p.layout.data) +
       (p.layout.context > 1 ? " × context parallel " + std::to_string(p.layout.context) : "") +
       (p.layout.tensor > 1 ? " × tensor parallel " + std::to_string(p.layout.tensor) + " (tensor innermost: consecutive ranks)" : "") +
       (p.layout.pipeline > 1 ? "; pipeline " + std::to_string(p.layout.pipeline) + " stages (outermost)" : ""));
  if (p.layout.expert > 1)
    line("expert parallel " + std::to_string(p.layout.expert) + " within the data ranks: each keeps " + std::to_string(p.cost.routed_experts / p.layout.expert) + " of " +
         std::to_string(p.cost.routed_experts) + " routed experts per MoE layer, their states sharded over " + std::to_string(p.layout.data_ranks() / p.layout.expert) +
         " rank(s); planned for the busiest rank routing " + format_double(p.expert_imbalance, 3) + "x the mean (parallel.expert_imbalance)");
  if (p.layout.pipeline > 1) {
    std::string pieces;
    for (size_t g = 0; g < p.pipeline_pieces.size(); ++g) {
      const auto [begin, end] = p.pipeline_pieces[g];
      pieces += (g ? ", " : "") + std::string("stage ") + std::to_string(g % p.layout.pipeline) + ": units " + std::to_string(begin) + "-" + std::to_string(end - 1);
    }
    line("pipeline schedule " + std::string(to_string(p.layout.schedule)) + (p.layout.virtual_stages > 1 ? " × " + std::to_string(p.layout.virtual_stages) + " virtual stages" : "") +
         ", " + std::to_string(p.accumulation) + " micro-batches per step, bubble " + format_double(100 * p.bubble_fraction, 3) + "% of the step");
    line("split by FLOPs (unit 0 the embedding, then each block, the last the head): " + pieces);
  }

  section("batch");
  line("global " + std::to_string(p.global_batch) + " = micro " + std::to_string(p.layout.micro) + " x accumulation " +
       std::to_string(p.accumulation) + " x data parallel " + std::to_string(p.layout.data));
  if (images) line(std::to_string(p.global_batch) + " images per step");
  else line("sequence " + std::to_string(p.seq_len) + "; " + format_count(p.tokens_per_step) + " tokens per step");
  if (p.layout.context > 1)
    line("each sequence split over " + std::to_string(p.layout.context) + " context ranks: " + std::to_string(p.seq_len / p.layout.context) +
         " tokens each (chunks i and " + std::to_string(2 * p.layout.context - 1) + " - i of " + std::to_string(2 * p.layout.context) +
         "), keys and values gathered for every layer's attention; gradients reduced and ZeRO sharded over all " + std::to_string(p.layout.data_ranks()) + " data × context ranks");

  section("parallelism and precision");
  line("ZeRO stage " + std::to_string(p.layout.zero_stage) + ", offload " + to_string(p.layout.offload) + ", activation checkpointing " +
       (p.layout.recomputation ? "full" : "none") + ", " + to_string(p.dtype) + (images ? "" : std::string(", attention ") + kernel_name(p.attention)));
  if (p.fp8 != Fp8Scaling::None)
    line("FP8 products (" + std::string(to_string(p.fp8)) + " scaling) for the blocks' linear layers: " + format_seconds(p.fp8_quantization_seconds) +
         " a step quantising their operands");
  if (!p.document_attention.empty())
    line("attention within documents (" + p.document_attention + "): " + format_double(100 * p.attention_fraction, 3) + "% of whole rows' attention FLOPs");
  if (p.modes.loss_chunk_tokens > 0) line("output projection and loss fused, " + std::to_string(p.modes.loss_chunk_tokens) + " tokens' logits at a time");
  line("execution: " + p.modes.describe());

  section(p.layout.pipeline > 1 ? "memory per rank (pipeline stage " + std::to_string(p.memory_stage) + ", the fullest)" : std::string("memory per rank"));
  const MemoryBreakdown& m = p.memory;
  const bool mixed = p.dtype != DType::Fp32;
  TextTable t({"component", "bytes", "how"});
  t.add({"parameters", format_bytes(m.states.params), std::string(to_string(p.dtype)) + ", " + sharded(p.layout.zero_stage, 3, p.layout.data_ranks()) +
                                                       (p.layout.offload == Offload::OptimizerAndParams ? ", offloaded" : "")});
  t.add({"gradients", format_bytes(m.states.grads), std::string(to_string(p.modes.gradient_dtype)) + (p.modes.gradient_dtype != p.dtype ? " (accumulated and reduced in fp32)" : "") + ", " +
                                                      sharded(p.layout.zero_stage, 2, p.layout.data_ranks())});
  if (mixed) t.add({"fp32 master weights", format_bytes(m.states.master), p.layout.offload != Offload::None ? "offloaded" : sharded(p.layout.zero_stage, 1, p.layout.data_ranks())});
  t.add({"optimizer states", format_bytes(m.states.optimizer), p.layout.offload != Offload::None ? "offloaded" : sharded(p.layout.zero_stage, 1, p.layout.data_ranks())});
  if (m.routed_expert_states > 0) t.add({"  of which routed experts", format_bytes(m.routed_expert_states), "parameters, gradients, master and optimizer states of the experts this rank keeps"});
  t.add({"activations", format_bytes(m.activations), "micro batch " + std::to_string(p.layout.micro) +
                                                         (p.layout.pipeline > 1 ? " × " + format_double(p.live_micro_batches, 3) + " live (" + to_string(p.layout.schedule) + ")" : "") +
                                                         (p.layout.recomputation ? ", checkpointed" : ", no recomputation")});
  if (m.backward_peak > 0)
    t.add({"backward peak", format_bytes(m.backward_peak),
           p.modes.loss_chunk_tokens > 0 ? "the largest transient: a loss chunk's logits and the head's weight gradient, or a recomputed block"
                                   : "backward's largest transient: logits or softmax gradients"});
  if (m.gradients_after_peak > 0)
    t.add({"gradients after the peak", format_bytes(m.gradients_after_peak),
           "subtracted from the total: one rank's autograd makes them as backward frees activations (no gradient buffer)"});
  if (m.evaluation_beside_graph > 0)
    t.add({"evaluation beside the graph", format_bytes(m.evaluation_beside_graph),
           "execution.cuda_graphs keeps the step's memory between steps: an evaluation's forward comes on top"});
  t.add({"communication buffers", format_bytes(m.comm_buffers), p.layout.zero_stage == 3 ? "gathered layers" : "gradient buckets"});
  if (m.comm_after_peak > 0)
    t.add({"reductions after the peak", format_bytes(m.comm_after_peak),
           "subtracted from the total: CPU ranks reduce gradients in the pages backward has freed from the activations"});
  t.add({"runtime", format_bytes(m.runtime), "context, libraries"});
  t.add({"allocator slack", format_bytes(m.fragmentation), "fragmentation"});
  double total = m.total() + (p.device == Device::Cpu ? m.states.host : 0);
  if (m.states.host > 0) t.add({"offloaded to host", format_bytes(m.states.host), p.device == Device::Cpu ? "same memory on CPU ranks" : "per rank, in host memory"});
  t.add({"total", format_bytes(total), "of " + format_bytes(p.memory_capacity)});
  out += t.render("  ");
  if (p.stage_memory.size() > 1) {
    std::string stages;
    for (size_t st = 0; st < p.stage_memory.size(); ++st)
      stages += (st > 0 ? ", " : "") + std::to_string(st) + ": " + format_bytes(p.stage_memory[st].device_bytes) + " (host " + format_bytes(p.stage_memory[st].host_bytes) + ")";
    line("per pipeline stage, what one of its ranks holds: " + stages);
  }

  section("host memory per rank");
  const HostMemory& h = p.host;
  TextTable ht({"component", "bytes", "how"});
  if (h.process > 0)
    ht.add({"process", format_bytes(h.process), "libraries, the CUDA context's host side (hardware.host_runtime_memory_gib)" +
                                                     std::string(p.world_size > 1 && p.device == Device::Cuda ? ", NCCL's (hardware.host_nccl_memory_gib)" : "")});
  if (h.device > 0) ht.add({"device terms", format_bytes(h.device), "the memory table above: the same memory on CPU ranks"});
  if (h.offloaded > 0) ht.add({"offloaded states", format_bytes(h.offloaded), "master weights, optimizer states, gradient shard" +
                                                                                  std::string(p.layout.offload == Offload::OptimizerAndParams ? ", parameter shard" : "")});
  if (h.model_build > 0)
    ht.add({"model build", format_bytes(h.model_build), p.device == Device::Cpu ? "one unit's fp32 initial values while it is built"
                                                                                 : "beyond the process as it trains: the largest parameter's fp32 initial values, on the process as it was then (hardware.host_build_memory_gib)"});
  if (h.checkpoint_staging > 0) ht.add({"checkpoint staging", format_bytes(h.checkpoint_staging), "checkpoint.async: this rank's share of a checkpoint, kept between saves" +
                                                                                                  std::string(p.checkpoint_disk.staging_pinned ? " (pinned)" : "")});
  const char* data_how = h.data == 0                 ? "none: token files are mapped (the page cache's, shared); a batch widens to int64"
                         : p.device == Device::Cpu ? "tokens or images as kept (int64 or fp32; the load's second copy where it is the peak)"
                                                   : "tokens or images as loaded (int64 or fp32, twice at the peak)";
  ht.add({"data", format_bytes(h.data), data_how});
  ht.add({"total", format_bytes(h.total()), "x " + std::to_string(p.ranks_per_node) + " rank(s) = " + format_bytes(p.host_memory_needed) + " of " +
                                                format_bytes(p.host_memory_capacity) + " per node"});
  out += ht.render("  ");

  section(p.fits ? "verdict: FITS" : "verdict: DOES NOT FIT");
  for (const auto& v : p.verdict) line(v);
  for (const auto& s : p.suggestions) line("suggestion: " + s);

  section("communication per step, per rank");
  if (p.comm.empty()) line("none (one data-parallel rank)");
  for (const auto& cterm : p.comm) line(cterm.collective + ": " + format_bytes(cterm.bytes) + ", " + format_seconds(cterm.seconds));
  if (!p.comm.empty())
    line("total " + format_seconds(p.comm_seconds) + ", not hidden behind compute " + format_seconds(p.exposed_comm_seconds) +
         (p.comm_slowdown_seconds > 0 ? " (of which " + format_seconds(p.comm_slowdown_seconds) + " is what the collectives beside compute take from it: hardware.overlap_cost)" : ""));

  section("compute and speed");
  line("model FLOPs per step " + format_count(p.model_flops_per_step) + (images ? " (3 x forward" : " (6N + attention") +
       std::string(p.layout.recomputation ? "; hardware " + format_count(p.hardware_flops_per_step) + " with recomputation" : "") + ")");
  line("per step: compute " + format_seconds(p.compute_seconds) + (p.elementwise_seconds > 0 ? " + memory-bound " + format_seconds(p.elementwise_seconds) : "") + " + communication " + format_seconds(p.exposed_comm_seconds) +
       " + optimizer " + format_seconds(p.optimizer_seconds) + (p.offload_seconds > 0 ? " + offload " + format_seconds(p.offload_seconds) : "") +
       (p.offload_hidden_seconds > 0 ? " - beside compute " + format_seconds(p.offload_hidden_seconds)
        : p.offload_hidden_seconds < 0 ? " + host step slowed beside compute " + format_seconds(-p.offload_hidden_seconds) : "") +
       " = " + format_seconds(p.step_seconds));
  line((images ? format_count(p.tokens_per_second) + " images/s" : format_count(p.tokens_per_second) + " tokens/s") + ", MFU " +
       format_double(100 * p.mfu, 3) + "% of " + format_count(p.peak_flops) + "FLOP/s peak per device");
  line(std::to_string(p.steps) + " steps: " + format_seconds(p.total_seconds) + "; start-up allowed " + format_seconds(p.startup_timeout_seconds) + " (run.startup_timeout_s)");

  const CheckpointDisk& disk = p.checkpoint_disk;
  if (disk.saves > 0) {
    section("checkpoints on disk");
    line(format_bytes(disk.bytes) + " each (fp32 master weights and optimizer states, all ranks); " + std::to_string(disk.saves) + " save(s), at most " +
         std::to_string(disk.kept) + " on disk at once: " + format_bytes(disk.needed) +
         (disk.free >= 0 ? "; " + format_bytes(disk.free) + " free under checkpoint.dir" : "; free space not known here"));
    const std::string copy = "each rank copies " + format_bytes(disk.staging_per_rank) + " to host memory (" + format_seconds(disk.copy_seconds) + ")";
    const std::string write = format_bytes(disk.staging_per_rank * p.ranks_per_node) + " per node is written (" + format_seconds(disk.write_seconds) + " at hardware.disk_write_gbs)";
    line(disk.async ? "asynchronous (checkpoint.async): training pauses " + format_seconds(disk.pause_seconds) + " per save while " + copy + "; then " + write + " beside training"
                    : "synchronous: training pauses " + format_seconds(disk.pause_seconds) + " per save: " + (disk.staging_pinned ? copy + ", then " : std::string()) + write +
                          "; checkpoint.async = true pauses for a copy to host memory alone (" + format_seconds(disk.copy_seconds) + ")");
    line("a resume reads it back in " + format_seconds(disk.read_seconds) + " per node (hardware.disk_read_gbs)");
  }

  if (!p.choices.empty()) {
    section("chosen automatically");
    for (const auto& ch : p.choices) line(ch.key + " = " + ch.value + ": " + ch.reason);
  }
  if (!p.layouts.empty()) {
    section("layouts searched (" + std::to_string(p.layouts_searched) + "; the best five; more with dsrun plan --layouts)");
    out += layout_table(std::vector<LayoutRow>(p.layouts.begin(), p.layouts.begin() + std::min<size_t>(5, p.layouts.size())));
  }
  if (!p.notes.empty()) {
    section("notes");
    for (const auto& n : p.notes) line(n);
  }
  if (!p.hardware_present) {
    section("hardware");
    line(p.hardware_message);
  }
  return out;
}

std::string plan_to_json(const Plan& p) {
  using nlohmann::json;
  const MemoryBreakdown& m = p.memory;
  json j;
  j["recipe"] = p.recipe;
  j["hardware"] = p.hardware;
  j["model"] = {{"name", p.model},
                {"arch", to_string(p.arch)},
                {"params", p.cost.params},
                {"active_params", p.cost.active_params},
                {"activation_bytes_per_sample", p.cost.activation_bytes_per_sample},
                {"checkpointed_activation_bytes_per_sample", p.cost.checkpointed_activation_bytes_per_sample}};
  j["topology"] = {{"device", to_string(p.device)}, {"nodes", p.nodes}, {"devices_per_node", p.devices_per_node},
                   {"world_size", p.world_size}, {"ranks_per_node", p.ranks_per_node}, {"data_parallel", p.layout.data}, {"tensor_parallel", p.layout.tensor},
                   {"pipeline_parallel", p.layout.pipeline}, {"expert_parallel", p.layout.expert}, {"expert_imbalance", p.expert_imbalance}};
  // The chosen layout as the keys that pin it (what the ranks read: runs/<id>/config.toml).
  j["layout"] = json::object();
  for (const auto& [key, value] : p.layout.to_config_keys()) j["layout"][key] = json::parse(value.toml());
  j["binds"] = p.binds;
  if (!p.layouts.empty()) {
    j["layouts"] = json::array();
    for (const LayoutRow& r : p.layouts) j["layouts"].push_back(json::parse(row_json(r).dump()));
    j["layouts_searched"] = p.layouts_searched;
  }
  if (p.layout.pipeline > 1)
    j["pipeline"] = {{"schedule", to_string(p.layout.schedule)}, {"virtual_stages", p.layout.virtual_stages}, {"pieces", p.pipeline_pieces},
                     {"bubble_fraction", p.bubble_fraction}, {"memory_stage", p.memory_stage}, {"problem", p.pipeline_problem}};
  json stages = json::array();
  for (const StageMemory& st : p.stage_memory)
    stages.push_back({{"model_state_bytes", st.model_state_bytes}, {"device_bytes", st.device_bytes}, {"host_bytes", st.host_bytes}});
  j["memory_per_stage"] = stages;
  nlohmann::json execution = {{"loss_chunk_tokens", p.modes.loss_chunk_tokens}, {"grad_dtype", to_string(p.modes.gradient_dtype)}};
  for (const ExecutionModeRow& row : execution_mode_rows()) execution[row.name] = p.modes.*row.field;
  j["execution"] = execution;
  j["batch"] = {{"global", p.global_batch}, {"micro", p.layout.micro}, {"accumulation", p.accumulation},
                {"seq_len", p.seq_len}, {"tokens_per_step", p.tokens_per_step}};
  j["parallel"] = {{"zero_stage", p.layout.zero_stage}, {"offload", to_string(p.layout.offload)},
                   {"activation_checkpointing", p.layout.recomputation}, {"dtype", to_string(p.dtype)}, {"fp8", to_string(p.fp8)},
                   {"attention", kernel_name(p.attention)}, {"document_attention", p.document_attention},
                   {"attention_fraction", p.attention_fraction}, {"loss_chunk_tokens", p.modes.loss_chunk_tokens}};
  j["memory_per_rank"] = {{"params", m.states.params}, {"grads", m.states.grads}, {"master", m.states.master},
                          {"optimizer", m.states.optimizer}, {"activations", m.activations}, {"backward_peak", m.backward_peak}, {"gradients_after_peak", m.gradients_after_peak},
                          {"evaluation_beside_graph", m.evaluation_beside_graph}, {"comm_buffers", m.comm_buffers}, {"comm_after_peak", m.comm_after_peak},
                          {"routed_expert_states", m.routed_expert_states}, {"runtime", m.runtime}, {"fragmentation", m.fragmentation}, {"offloaded_to_host", m.states.host},
                          {"total", m.total() + (p.device == Device::Cpu ? m.states.host : 0)}, {"capacity", p.memory_capacity}};
  j["host_memory_per_rank"] = {{"process", p.host.process}, {"device", p.host.device}, {"offloaded", p.host.offloaded},
                               {"model_build", p.host.model_build}, {"data", p.host.data}, {"checkpoint_staging", p.host.checkpoint_staging}, {"total", p.host.total()}};
  j["host_memory_per_node"] = {{"needed", p.host_memory_needed}, {"capacity", p.host_memory_capacity}};
  j["fits"] = p.fits;
  j["verdict"] = p.verdict;
  j["suggestions"] = p.suggestions;
  json comm = json::array();
  for (const auto& c : p.comm) comm.push_back({{"collective", c.collective}, {"bytes", c.bytes}, {"seconds", c.seconds}, {"beside_compute", c.beside_compute}});
  j["communication"] = {{"terms", comm}, {"seconds", p.comm_seconds}, {"exposed_seconds", p.exposed_comm_seconds}, {"slowdown_seconds", p.comm_slowdown_seconds}};
  j["speed"] = {{"peak_flops", p.peak_flops}, {"model_flops_per_step", p.model_flops_per_step},
                {"hardware_flops_per_step", p.hardware_flops_per_step}, {"compute_seconds", p.compute_seconds},
                {"optimizer_seconds", p.optimizer_seconds}, {"elementwise_seconds", p.elementwise_seconds}, {"offload_seconds", p.offload_seconds}, {"offload_hidden_seconds", p.offload_hidden_seconds},
                {"step_seconds", p.step_seconds}, {"tokens_per_second", p.tokens_per_second}, {"mfu", p.mfu},
                {"steps", p.steps}, {"total_seconds", p.total_seconds}, {"startup_timeout_seconds", p.startup_timeout_seconds}};
  json choices = json::array();
  for (const auto& c : p.choices) choices.push_back({{"key", c.key}, {"value", c.value}, {"reason", c.reason}});
  j["checkpoint_disk"] = {{"bytes", p.checkpoint_disk.bytes}, {"saves", p.checkpoint_disk.saves}, {"kept", p.checkpoint_disk.kept},
                          {"needed", p.checkpoint_disk.needed}, {"free", p.checkpoint_disk.free}, {"async", p.checkpoint_disk.async},
                          {"staging_per_rank", p.checkpoint_disk.staging_per_rank}, {"staging_pinned", p.checkpoint_disk.staging_pinned}, {"copy_seconds", p.checkpoint_disk.copy_seconds},
                          {"write_seconds", p.checkpoint_disk.write_seconds}, {"read_seconds", p.checkpoint_disk.read_seconds}, {"pause_seconds", p.checkpoint_disk.pause_seconds}};
  j["auto_choices"] = choices;
  j["notes"] = p.notes;
  j["hardware_present"] = p.hardware_present;
  if (!p.hardware_present) j["hardware_message"] = p.hardware_message;
  return j.dump(2);
}

}  // namespace dsrun
