// Step 3 of loading: typed Recipe from the validated flat config, and the rules that span keys.
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/execution_modes.hpp"
#include "engine/recipe/layout.hpp"
#include "engine/recipe/load.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>

namespace dsrun {

namespace {

struct Builder {
  const Config& config;
  std::vector<Diagnostic>& diagnostics;

  const Setting& at(const std::string& key) const { return config.at(key); }
  int64_t i(const std::string& key) const { return at(key).value.i; }
  double f(const std::string& key) const { return at(key).value.number(); }
  bool b(const std::string& key) const { return at(key).value.b; }
  const std::string& s(const std::string& key) const { return at(key).value.s; }
  // A choice key's value (the schema has checked the name); `otherwise` for a name outside E's
  // table, such as "auto" where the search decides.
  template <typename E>
  E kind(const std::string& key, E otherwise = E{}) const {
    return enum_from_string<E>(s(key)).value_or(otherwise);
  }
  std::optional<int64_t> int_or_auto(const std::string& key) const {
    const Value& v = at(key).value;
    if (v.is_auto()) return std::nullopt;
    return v.i;
  }
  std::vector<double> floats(const std::string& key) const {
    std::vector<double> out;
    for (const auto& item : at(key).value.items) out.push_back(item.number());
    return out;
  }
  std::vector<std::string> strings(const std::string& key) const {
    std::vector<std::string> out;
    for (const auto& item : at(key).value.items) out.push_back(item.s);
    return out;
  }
  bool written(const std::string& key) const {
    Layer layer = at(key).source.layer;
    return layer == Layer::Recipe || layer == Layer::CommandLine;
  }

  // Where to point for a rule about `key` that `related` keys take part in: the setting the user
  // wrote (the command line, else the later line of the recipe), else one a base set, else key's.
  const Source& located(const std::string& key, std::initializer_list<const char*> related) const {
    const Source* best = &at(key).source;
    for (const char* k : related) {
      const Source& s = at(k).source;
      if (s.layer > best->layer || (s.layer == best->layer && s.file == best->file && s.line > best->line)) best = &s;
    }
    return *best;
  }
  void error(const std::string& key, std::string message, std::string fix, std::initializer_list<const char*> related = {}) {
    diagnostics.push_back({Diagnostic::Severity::Error, located(key, related), key, std::move(message), std::move(fix)});
  }
  void error(const std::string& key, std::string message, std::string fix, const std::vector<std::string>& related) {
    const Source* best = &located(key, {});
    for (const std::string& k : related) {
      const Source& s = at(k).source;
      if (s.layer > best->layer || (s.layer == best->layer && s.file == best->file && s.line > best->line)) best = &s;
    }
    diagnostics.push_back({Diagnostic::Severity::Error, *best, key, std::move(message), std::move(fix)});
  }
  void warning(const std::string& key, std::string message, std::string fix = "") {
    diagnostics.push_back({Diagnostic::Severity::Warning, at(key).source, key, std::move(message), std::move(fix)});
  }
};

std::string resolve_path(const std::string& path, const std::string& recipe_dir) {
  if (path.empty() || path[0] == '/') return path;
  return path_join(recipe_dir, path);
}

}  // namespace

int64_t closest_divisor(int64_t n, int64_t near) {
  int64_t best = 1;
  for (int64_t d = 1; d <= n && d <= (1 << 20); ++d)
    if (n % d == 0 && std::llabs(d - near) < std::llabs(best - near)) best = d;
  return best;
}

namespace {

void build_run(Builder& c, Recipe& r) {
  r.run.name = c.s("run.name");
  r.run.description = c.s("run.description");
  r.run.tags = c.strings("run.tags");
  r.run.seed = static_cast<uint64_t>(c.i("run.seed"));
  r.run.steps = c.i("run.steps");
  r.run.max_restarts = static_cast<int>(c.i("run.max_restarts"));
  r.run.step_timeout_s = c.f("run.step_timeout_s");
  // "auto" (0 here): the plan sizes it to what start-up must do (Plan::startup_timeout_seconds).
  r.run.startup_timeout_s = c.at("run.startup_timeout_s").value.is_auto() ? 0 : c.f("run.startup_timeout_s");
  r.run.time_limit = c.s("run.time_limit");
  if (!r.run.time_limit.empty()) {
    if (auto minutes = parse_time_limit_minutes(r.run.time_limit)) r.run.time_limit_minutes = *minutes;
    else c.error("run.time_limit", "cannot read \"" + r.run.time_limit + "\" as a time limit", "write minutes (\"90\"), \"H:MM:SS\" (\"2:00:00\") or \"D-HH:MM:SS\" (\"1-12:00:00\"), above zero");
  }
  r.slurm.partition = c.s("slurm.partition");
  r.slurm.account = c.s("slurm.account");
  r.slurm.qos = c.s("slurm.qos");
  r.slurm.constraint = c.s("slurm.constraint");
  r.slurm.sbatch = c.strings("slurm.sbatch");
  for (const std::string& line : r.slurm.sbatch)
    if (line.rfind("--", 0) != 0)
      c.error("slurm.sbatch", "\"" + line + "\" is not one sbatch option", "write each option as sbatch takes it, starting with --, e.g. \"--exclusive\"");
  // These go into a job script's #SBATCH lines (the run's name as the job's): a newline there
  // would start a line of shell on the compute node.
  auto no_control_characters = [&](const char* key, const std::string& value) {
    for (unsigned char ch : value)
      if (ch < 0x20 || ch == 0x7f) {
        char code[8];
        std::snprintf(code, sizeof code, "0x%02x", ch);
        c.error(key, std::string("contains the control character ") + code + (ch == '\n' ? " (a newline)" : ""),
                "use printable characters only: the value goes into a Slurm job script");
        return;
      }
  };
  no_control_characters("run.name", r.run.name);
  no_control_characters("slurm.partition", r.slurm.partition);
  no_control_characters("slurm.account", r.slurm.account);
  no_control_characters("slurm.qos", r.slurm.qos);
  no_control_characters("slurm.constraint", r.slurm.constraint);
  for (const std::string& line : r.slurm.sbatch) no_control_characters("slurm.sbatch", line);
  if (r.run.startup_timeout_s > 0 && r.run.startup_timeout_s < r.run.step_timeout_s && c.written("run.startup_timeout_s"))
    c.warning("run.startup_timeout_s", "start-up timeout is shorter than the step timeout",
              "start-up includes rendezvous and model build; give it at least run.step_timeout_s");
}

// The probed collective table: whole, ascending group sizes and one figure per size in each list.
void build_collectives(Builder& c, CollectiveBandwidths& t) {
  const double GB = 1e9;
  for (double n : c.floats("hardware.collective_ranks")) {
    if (n != std::floor(n) || (!t.ranks.empty() && n <= t.ranks.back())) {
      c.error("hardware.collective_ranks", "group sizes must be whole numbers in ascending order", "write them as `dsrun probe` does, e.g. [2, 4, 8]");
      return;
    }
    t.ranks.push_back(static_cast<int>(n));
  }
  for (const auto& [op, name] : kCollectives) {
    const std::string key = collective_key(op);
    std::vector<double>& v = t.bus_bandwidth[static_cast<size_t>(op)];
    for (double gbs : c.floats(key)) v.push_back(gbs * GB);
    if (!v.empty() && v.size() != t.ranks.size()) {
      c.error(key, std::to_string(v.size()) + " figure(s) for " + std::to_string(t.ranks.size()) + " group size(s) in hardware.collective_ranks",
              "give one bus bandwidth per group size, or probe again (`dsrun probe`)", {"hardware.collective_ranks"});
      v.clear();
    }
  }
  t.point_to_point = c.f("hardware.p2p_gbs") * GB;
}

void build_hardware(Builder& c, Recipe& r, const HostFacts& host) {
  HardwareSpec& h = r.hardware;
  h.name = c.s("hardware.name");
  h.device = c.kind<Device>("hardware.device");
  h.nodes = static_cast<int>(c.i("hardware.nodes"));
  if (auto n = c.int_or_auto("hardware.devices_per_node")) {
    h.devices_per_node = static_cast<int>(*n);
  } else if (h.device == Device::Cpu) {
    h.devices_per_node = std::max(1, host.cpu_cores);
  } else if (host.cuda_devices > 0) {
    h.devices_per_node = host.cuda_devices;
  } else {
    c.error("hardware.devices_per_node", "\"auto\" counts the GPUs of this machine, and it has none",
            "set hardware.devices_per_node to the GPU count of the machine you plan for");
  }
  const double GB = 1e9, GiB = 1024.0 * 1024.0 * 1024.0;
  h.host_memory_bytes = c.at("hardware.host_memory_gib").value.is_auto() ? host.memory_bytes : c.f("hardware.host_memory_gib") * GiB;
  if (!c.at("hardware.memory_gib").value.is_auto()) {
    h.memory_bytes = c.f("hardware.memory_gib") * GiB;
  } else if (h.device == Device::Cpu) {
    h.memory_bytes = h.host_memory_bytes;
  } else {
    c.error("hardware.memory_gib", "\"auto\" is only for cpu hardware", "set the memory of one GPU in GiB, e.g. memory_gib = 80");
  }
  h.peak_flops_fp32 = c.f("hardware.peak_tflops_fp32") * 1e12;
  h.peak_flops_bf16 = c.f("hardware.peak_tflops_bf16") * 1e12;
  h.peak_flops_fp16 = c.f("hardware.peak_tflops_fp16") * 1e12;
  h.peak_flops_fp8 = c.f("hardware.peak_tflops_fp8") * 1e12;
  h.memory_bandwidth = c.f("hardware.memory_bandwidth_gbs") * GB;
  h.link = c.s("hardware.link");
  h.link_bandwidth = c.f("hardware.link_bandwidth_gbs") * GB;
  h.p2p = c.b("hardware.p2p");
  h.inter_node_bandwidth = c.f("hardware.inter_node_bandwidth_gbs") * GB;
  h.host_link_bandwidth = c.f("hardware.host_link_bandwidth_gbs") * GB;
  h.host_memory_bandwidth = c.f("hardware.host_memory_bandwidth_gbs") * GB;
  h.host_optimizer_bandwidth = c.f("hardware.host_optimizer_gbs") * GB;
  h.host_step_beside_compute = c.f("hardware.host_step_beside_compute");
  h.disk_write_bandwidth = c.f("hardware.disk_write_gbs") * GB;
  h.disk_read_bandwidth = c.f("hardware.disk_read_gbs") * GB;
  h.matmul_efficiency = c.f("hardware.matmul_efficiency");
  h.grouped_matmul_efficiency = c.f("hardware.grouped_matmul_efficiency");
  h.attention_efficiency = c.f("hardware.attention_efficiency");
  h.fp8_matmul_efficiency = c.f("hardware.fp8_matmul_efficiency");
  h.fp8_grouped_matmul_efficiency = c.f("hardware.fp8_grouped_matmul_efficiency");
  h.comm_efficiency = c.f("hardware.comm_efficiency");
  h.network_efficiency = c.f("hardware.network_efficiency");
  build_collectives(c, h.collectives);
  h.runtime_memory_bytes = c.f("hardware.runtime_memory_gib") * GiB;
  h.host_runtime_memory_bytes = c.f("hardware.host_runtime_memory_gib") * GiB;
  h.host_build_memory_bytes = c.f("hardware.host_build_memory_gib") * GiB;
  h.host_nccl_memory_bytes = c.f("hardware.host_nccl_memory_gib") * GiB;
  h.overlap_cost = c.f("hardware.overlap_cost");
  h.fragmentation = c.f("hardware.fragmentation");

  if (h.nodes > 1 && h.inter_node_bandwidth <= 0)
    c.error("hardware.inter_node_bandwidth_gbs", "a job of " + std::to_string(h.nodes) + " nodes needs the network bandwidth between them",
            "set hardware.inter_node_bandwidth_gbs (e.g. 25 for 200 Gb/s InfiniBand)", {"hardware.nodes"});
  if (h.memory_bytes > 0 && h.runtime_memory_bytes >= h.memory_bytes)
    c.error("hardware.runtime_memory_gib", "runtime memory is not smaller than the device memory", "lower hardware.runtime_memory_gib", {"hardware.memory_gib"});
  if (h.device == Device::Cpu && h.link == "nvlink")
    c.error("hardware.link", "cpu ranks do not talk over NVLink", "use link = \"shm\" for ranks on one machine", {"hardware.device"});
}

// MLA's widths: the attention kernels take head dimensions that are multiples of 8 (16-byte rows
// in 16-bit) and at most 256 (flash attention's largest); the rotary part turns pairs.
void build_latent_attention(Builder& c, Recipe& r) {
  ModelSpec& m = r.model;
  m.kv_heads = m.heads;  // every head has its own key and value, made from the one latent
  const MlaSpec& a = m.mla;
  if (a.qk_rope_head_dim % 2 != 0)
    c.error("model.mla.qk_rope_head_dim", "qk_rope_head_dim = " + std::to_string(a.qk_rope_head_dim) + " is odd; rotary embeddings rotate pairs",
            "use an even width (DeepSeek-V2/V3: 64)");
  const std::pair<const char*, int64_t> widths[] = {{"model.mla.qk_nope_head_dim", a.qk_head_dim()}, {"model.mla.v_head_dim", a.v_head_dim}};
  for (const auto& [key, width] : widths) {
    const std::string what = std::string(key) == "model.mla.v_head_dim" ? "v_head_dim = " + std::to_string(width)
                                                                         : "qk_nope_head_dim + qk_rope_head_dim = " + std::to_string(width);
    if (width % 8 != 0)
      c.error(key, what + " is not a multiple of 8: the attention kernels read heads in 16-byte rows", "use widths that are multiples of 8 (DeepSeek-V3: 128 + 64, 128)",
              {"model.mla.qk_rope_head_dim"});
    else if (width > 256 && r.hardware.device == Device::Cuda)
      c.error(key, what + ": the flash attention kernel takes heads of at most 256", "use at most 256 (DeepSeek-V3: 128 + 64 = 192)", {"model.mla.qk_rope_head_dim"});
  }
  if (a.v_head_dim > a.qk_head_dim() && r.hardware.device == Device::Cuda)
    c.error("model.mla.v_head_dim", "v_head_dim = " + std::to_string(a.v_head_dim) + " is wider than the query and key heads (" + std::to_string(a.qk_head_dim()) +
                "): the values are padded to the keys' width for the flash kernel, not the keys to the values'",
            "use v_head_dim <= qk_nope_head_dim + qk_rope_head_dim", {"model.mla.qk_nope_head_dim"});
}

// Group-limited routing: groups of equal size, fewer kept than there are, room for top_k experts.
void build_router_groups(Builder& c, const MoeSpec& moe) {
  if (moe.n_group == 1 || moe.top_k < 1 || moe.top_k > moe.routed_experts) return;  // (no groups; a top_k out of range is reported once, above)
  const std::string E = std::to_string(moe.routed_experts), G = std::to_string(moe.n_group);
  if (moe.routed_experts % moe.n_group != 0) {
    c.error("model.moe.n_group", E + " routed experts do not divide into " + G + " equal groups", "use an n_group dividing routed_experts (DeepSeek-V3: 256 experts, 8 groups)",
            {"model.moe.routed_experts"});
    return;
  }
  if (moe.topk_group > moe.n_group) {
    c.error("model.moe.topk_group", "topk_group = " + std::to_string(moe.topk_group) + " is larger than n_group = " + G, "use topk_group <= n_group (DeepSeek-V3: 4 of 8)",
            {"model.moe.n_group"});
    return;
  }
  const int per_group = moe.routed_experts / moe.n_group;
  if (moe.top_k > moe.topk_group * per_group)
    c.error("model.moe.top_k", "top_k = " + std::to_string(moe.top_k) + " experts cannot come from " + std::to_string(moe.topk_group) + " groups of " + std::to_string(per_group),
            "raise model.moe.topk_group or lower top_k", {"model.moe.topk_group", "model.moe.n_group"});
  if (moe.n_group > 1 && moe.scoring == RouterScore::Sigmoid && per_group < 2)
    c.error("model.moe.n_group", "a sigmoid router scores each group by its best two experts, and groups of " + std::to_string(per_group) + " have fewer",
            "use groups of at least 2 experts", {"model.moe.scoring_func"});
}

void build_model(Builder& c, Recipe& r) {
  ModelSpec& m = r.model;
  m.name = c.s("model.name");
  m.arch = c.kind<ModelArch>("model.arch");
  m.hidden = c.i("model.hidden");
  m.layers = static_cast<int>(c.i("model.layers"));
  m.heads = static_cast<int>(c.i("model.heads"));
  m.kv_heads = static_cast<int>(c.int_or_auto("model.kv_heads").value_or(m.heads));
  m.intermediate = c.i("model.intermediate");
  m.vocab = c.i("model.vocab");
  m.max_seq_len = c.i("model.max_seq_len");
  m.tie_embeddings = c.b("model.tie_embeddings");
  m.rope_theta = c.f("model.rope_theta");
  m.norm_eps = c.f("model.norm_eps");
  m.init_std = c.f("model.init_std");
  m.moe.routed_experts = static_cast<int>(c.i("model.moe.routed_experts"));
  m.moe.shared_experts = static_cast<int>(c.i("model.moe.shared_experts"));
  m.moe.top_k = static_cast<int>(c.i("model.moe.top_k"));
  m.moe.intermediate = c.i("model.moe.intermediate");
  m.moe.first_dense_layers = static_cast<int>(c.i("model.moe.first_dense_layers"));
  m.moe.aux_loss_weight = c.f("model.moe.aux_loss_weight");
  m.moe.capacity_factor = c.f("model.moe.capacity_factor");
  m.moe.route_bias = c.floats("model.moe.route_bias");
  m.moe.balance = c.kind<MoeBalance>("model.moe.balance");
  m.moe.bias_update_rate = c.f("model.moe.bias_update_rate");
  m.moe.scoring = c.kind<RouterScore>("model.moe.scoring_func");
  m.moe.n_group = static_cast<int>(c.i("model.moe.n_group"));
  m.moe.topk_group = static_cast<int>(c.i("model.moe.topk_group"));
  m.moe.norm_topk_prob = c.b("model.moe.norm_topk_prob");
  m.moe.routed_scaling_factor = c.f("model.moe.routed_scaling_factor");
  m.moe.seq_aux_loss_weight = c.f("model.moe.seq_aux_loss_weight");
  m.attention = c.kind<AttentionKind>("model.attention");
  m.mla.q_lora_rank = c.i("model.mla.q_lora_rank");
  m.mla.kv_lora_rank = c.i("model.mla.kv_lora_rank");
  m.mla.qk_nope_head_dim = c.i("model.mla.qk_nope_head_dim");
  m.mla.qk_rope_head_dim = c.i("model.mla.qk_rope_head_dim");
  m.mla.v_head_dim = c.i("model.mla.v_head_dim");
  m.mtp.depth = static_cast<int>(c.i("model.mtp.depth"));
  m.mtp.loss_weight = c.f("model.mtp.loss_weight");
  m.rope_scaling.kind = c.kind<RopeScalingKind>("model.rope_scaling.type");
  m.rope_scaling.factor = c.f("model.rope_scaling.factor");
  m.rope_scaling.original_max_position_embeddings = c.i("model.rope_scaling.original_max_position_embeddings");
  m.rope_scaling.beta_fast = c.f("model.rope_scaling.beta_fast");
  m.rope_scaling.beta_slow = c.f("model.rope_scaling.beta_slow");
  m.rope_scaling.mscale = c.f("model.rope_scaling.mscale");
  m.rope_scaling.mscale_all_dim = c.f("model.rope_scaling.mscale_all_dim");
  m.resnet.depth = static_cast<int>(c.i("model.resnet.depth"));
  m.resnet.classes = static_cast<int>(c.i("model.resnet.classes"));
  m.resnet.image_size = static_cast<int>(c.i("model.resnet.image_size"));
  m.resnet.channels = static_cast<int>(c.i("model.resnet.channels"));
  m.resnet.width = static_cast<int>(c.i("model.resnet.width"));

  if (m.arch == ModelArch::ResNet) {
    int d = m.resnet.depth;
    if (d != 18 && d != 34 && d != 50 && d != 101 && d != 152)
      c.error("model.resnet.depth", "ResNet depth " + std::to_string(d) + " does not exist", "use 18, 34, 50, 101 or 152");
    return;
  }
  if (m.latent_attention()) {
    build_latent_attention(c, r);
  } else {
    if (m.hidden % m.heads != 0)
      c.error("model.heads", "hidden (" + std::to_string(m.hidden) + ") is not divisible by heads (" + std::to_string(m.heads) + ")",
              "use a divisor of " + std::to_string(m.hidden) + ", such as " + std::to_string(closest_divisor(m.hidden, m.heads)), {"model.hidden"});
    else if (m.head_dim() % 2 != 0)
      c.error("model.heads", "head dimension hidden/heads = " + std::to_string(m.head_dim()) + " is odd; rotary embeddings rotate pairs",
              "choose heads so that hidden/heads is even", {"model.hidden"});
    if (m.heads % m.kv_heads != 0)
      c.error("model.kv_heads", "heads (" + std::to_string(m.heads) + ") is not divisible by kv_heads (" + std::to_string(m.kv_heads) + ")",
              "use a divisor of " + std::to_string(m.heads) + ", such as " + std::to_string(closest_divisor(m.heads, m.kv_heads)), {"model.heads"});
  }
  if (m.moe.enabled()) {
    if (m.moe.top_k < 1 || m.moe.top_k > m.moe.routed_experts)
      c.error("model.moe.top_k", "top_k must be between 1 and routed_experts (" + std::to_string(m.moe.routed_experts) + ")",
              "DeepSeek-MoE 16B uses top_k = 6 of 64 routed experts", {"model.moe.routed_experts"});
    if (m.moe.intermediate < 1)
      c.error("model.moe.intermediate", "an MoE model needs the experts' inner size", "set model.moe.intermediate (DeepSeek-MoE 16B: 1408)");
    if (!m.moe.route_bias.empty() && static_cast<int>(m.moe.route_bias.size()) != m.moe.routed_experts)
      c.error("model.moe.route_bias", std::to_string(m.moe.route_bias.size()) + " biases for " + std::to_string(m.moe.routed_experts) + " routed experts",
              "give one number per routed expert, or none", {"model.moe.routed_experts"});
    if (m.moe.first_dense_layers > m.layers)
      c.error("model.moe.first_dense_layers", "more dense layers than layers", "use at most model.layers (" + std::to_string(m.layers) + ")", {"model.layers"});
    build_router_groups(c, m.moe);
  }
  if (m.rope_scaling.kind == RopeScalingKind::Yarn && m.rope_scaling.factor <= 1)
    c.error("model.rope_scaling.factor", "YaRN with factor " + format_double(m.rope_scaling.factor) + " extends nothing",
            "set model.rope_scaling.factor > 1 (DeepSeek-V3: 40), or model.rope_scaling.type = \"none\"", {"model.rope_scaling.type"});
  if (m.mtp.enabled() && m.layers < 1)
    c.error("model.mtp.depth", "multi-token prediction follows the last block", "use model.layers >= 1", {"model.layers"});
}

void build_parallel(Builder& c, Recipe& r) {
  ParallelOptions& p = r.parallel;
  if (auto v = c.int_or_auto("parallel.data_parallel")) p.data_parallel = static_cast<int>(*v);
  if (auto v = c.int_or_auto("parallel.zero_stage")) p.zero_stage = static_cast<int>(*v);
  p.offload = c.kind<Offload>("parallel.offload", Offload::None);  // "auto": none until the search picks
  p.offload_auto = c.s("parallel.offload") == "auto";
  p.delayed_update = c.b("parallel.delayed_update");
  p.activation_checkpointing = c.kind<Checkpointing>("parallel.activation_checkpointing");
  p.bucket_bytes = c.f("parallel.bucket_mb") * 1e6;
  auto int_or_searched = [&](const char* key, int& value, bool& searched) {
    const std::optional<int64_t> v = c.int_or_auto(key);
    searched = !v;
    value = v ? static_cast<int>(*v) : 1;
  };
  int_or_searched("parallel.tensor", p.tensor, p.search.tensor);
  int_or_searched("parallel.pipeline", p.pipeline, p.search.pipeline);
  int_or_searched("parallel.virtual_stages", p.virtual_stages, p.search.virtual_stages);
  int_or_searched("parallel.expert", p.expert, p.search.expert);
  p.expert_imbalance = c.f("parallel.expert_imbalance");
  int_or_searched("parallel.context", p.context, p.search.context);
  p.search.sequence_parallel = c.at("parallel.sequence_parallel").value.is_auto();
  p.sequence_parallel = !p.search.sequence_parallel && c.b("parallel.sequence_parallel");
  const std::string& schedule = c.s("parallel.pipeline_schedule");
  p.search.schedule = schedule == "auto";
  p.pipeline_schedule = c.kind<PipelineScheduleKind>("parallel.pipeline_schedule", PipelineScheduleKind::OneFOneB);  // "auto": searched

  p.tensor_across_nodes = c.b("parallel.tensor_across_nodes");
}

// FP8 products: what the hardware, the working dtype and the layers' shapes must allow
// (torch's scaled products take sizes that are multiples of 16; blocks of 128 need multiples of 128).
void build_fp8(Builder& c, Recipe& r) {
  const Fp8Scaling fp8 = r.precision.fp8 = c.kind<Fp8Scaling>("precision.fp8");
  if (fp8 == Fp8Scaling::None) return;
  const HardwareSpec& h = r.hardware;
  if (h.device != Device::Cuda || h.peak_flops_fp8 <= 0) {
    c.error("precision.fp8", "hardware \"" + h.name + "\" has no FP8 tensor cores" + (h.device != Device::Cuda ? " (CPU ranks)" : " (hardware.peak_tflops_fp8 = 0)"),
            "use precision.fp8 = \"none\", or GPUs with FP8 (H100, H200, RTX 4090: set hardware.peak_tflops_fp8)", {"hardware.peak_tflops_fp8"});
    return;
  }
  if (r.precision.dtype != DType::Bf16)
    c.error("precision.fp8", std::string("FP8 products write bf16 and keep the rest of the model in bf16; precision.dtype is ") + to_string(r.precision.dtype),
            "set precision.dtype = \"bf16\"", {"precision.dtype"});
  if (r.model.arch != ModelArch::DeepSeek) {
    c.error("precision.fp8", std::string("FP8 covers the decoders' linear layers; model.arch is ") + to_string(r.model.arch), "use precision.fp8 = \"none\"", {"model.arch"});
    return;
  }
  const ModelSpec& m = r.model;
  // Blockwise scales whole blocks of 128 (1 x 128 along each product's summed dimension, 128 x 128
  // of the weights), unpadded; the tokens of a micro-batch and the tensor split are checked when
  // the layer runs (fp8_linear).
  const int64_t multiple = fp8_size_multiple(fp8);
  const int64_t head_dim = m.hidden / m.heads;
  for (auto [what, size] : std::vector<std::pair<std::string, int64_t>>{{"model.hidden", m.hidden},
                                                                      {"model.intermediate", m.intermediate},
                                                                      {"model.kv_heads", m.latent_attention() ? multiple : m.kv_heads * head_dim},  // (MLA's linears that are not whole blocks stay bf16)
                                                                      {"model.moe.intermediate", m.moe.enabled() ? m.moe.intermediate : multiple}})
    if (size % multiple != 0)
      c.error("precision.fp8", what + " gives a linear layer a size of " + std::to_string(size) + ", not a multiple of " + std::to_string(multiple) +
                                   (multiple == 128 ? " as blockwise FP8's blocks need" : " as FP8 products need"),
              multiple == 128 ? "use precision.fp8 = \"rowwise\" or sizes that are multiples of 128" : "use precision.fp8 = \"none\" or sizes that are multiples of 16", {what});
}

void build_precision(Builder& c, Recipe& r) {
  r.precision.dtype = c.kind<DType>("precision.dtype");
  const std::string grad_dtype = c.s("precision.grad_dtype");
  if (grad_dtype != "auto") {
    const DType g = c.kind<DType>("precision.grad_dtype");
    r.precision.grad_dtype = g;
    if (g != DType::Fp32 && g != r.precision.dtype)
      c.error("precision.grad_dtype", "gradients are accumulated in fp32 or in precision.dtype (" + std::string(to_string(r.precision.dtype)) + "), not in " + grad_dtype,
              std::string("use grad_dtype = \"fp32\"") + (r.precision.dtype != DType::Fp32 ? std::string(" or \"") + to_string(r.precision.dtype) + "\"" : "") + ", or \"auto\"",
              {"precision.dtype"});
  }
  LossScaleOptions& ls = r.precision.loss_scale;
  ls.initial_power = static_cast<int>(c.i("precision.loss_scale.initial_power"));
  ls.window = c.i("precision.loss_scale.window");
  ls.hysteresis = static_cast<int>(c.i("precision.loss_scale.hysteresis"));
  ls.min_scale = c.f("precision.loss_scale.min_scale");
  ls.overflow_retries = static_cast<int>(c.i("precision.loss_scale.overflow_retries"));
  const HardwareSpec& h = r.hardware;
  if (r.precision.dtype == DType::Bf16 && h.peak_flops_bf16 <= 0)
    c.error("precision.dtype", "hardware \"" + h.name + "\" does not support bf16 (hardware.peak_tflops_bf16 = 0)",
            h.peak_flops_fp16 > 0 ? "use dtype = \"fp16\" or \"fp32\"" : "use dtype = \"fp32\"", {"hardware.peak_tflops_bf16"});
  if (r.precision.dtype == DType::Fp16 && h.device == Device::Cpu)  // (whatever peak_tflops_fp16 says)
    c.error("precision.dtype", "CPU ranks cannot train in fp16: libtorch's CPU kernels are not implemented for 'Half' in every layer",
            "use dtype = \"bf16\" or \"fp32\" on CPU ranks, or GPUs (hardware.device = \"cuda\")", {"hardware.device"});
  else if (r.precision.dtype == DType::Fp16 && h.peak_flops_fp16 <= 0)
    c.error("precision.dtype", "hardware \"" + h.name + "\" does not support fp16 (hardware.peak_tflops_fp16 = 0)",
            h.peak_flops_bf16 > 0 ? "use dtype = \"bf16\" or \"fp32\"" : "use dtype = \"fp32\"", {"hardware.peak_tflops_fp16"});
  build_fp8(c, r);
  if (ls.min_scale > std::ldexp(1.0, ls.initial_power))
    c.error("precision.loss_scale.min_scale", "the minimum scale is above the initial scale 2^" + std::to_string(ls.initial_power),
            "lower min_scale or raise initial_power", {"precision.loss_scale.initial_power"});
}

void build_batch(Builder& c, Recipe& r) {
  BatchOptions& b = r.batch;
  b.global = c.i("batch.global");
  b.micro = c.int_or_auto("batch.micro");
  b.seq_len = c.i("batch.seq_len");
  b.loss_chunk_tokens = c.int_or_auto("batch.loss_chunk_tokens");
  if (r.model.arch == ModelArch::DeepSeek && b.seq_len > r.model.max_seq_len)
    c.error("batch.seq_len", "sequence length " + std::to_string(b.seq_len) + " exceeds model.max_seq_len = " + std::to_string(r.model.max_seq_len),
            "use seq_len <= " + std::to_string(r.model.max_seq_len) + " or raise model.max_seq_len", {"model.max_seq_len"});
}

// The layout's rules (engine/recipe/layout.cpp) on what the recipe fixes; "auto" keys are the
// search's to decide, and it asks the same rules of every candidate.
void check_layout(Builder& c, const Recipe& r) {
  LayoutDecided decided;
  const Layout layout = layout_of_recipe(r, &decided);
  for (const LayoutProblem& problem : layout_problems(r, layout, decided)) c.error(problem.key, problem.message, problem.fix, problem.related);
}

void build_optimizer(Builder& c, Recipe& r) {
  OptimizerOptions& o = r.optimizer;
  o.kind = c.kind<OptimizerKind>("optimizer.name");
  o.lr = c.f("optimizer.lr");
  std::vector<double> betas = c.floats("optimizer.betas");
  if (betas.size() != 2) {
    c.error("optimizer.betas", "expected 2 values (beta1, beta2), got " + std::to_string(betas.size()), "write betas = [0.9, 0.95]");
  } else {
    o.beta1 = betas[0];
    o.beta2 = betas[1];
  }
  o.eps = c.f("optimizer.eps");
  o.weight_decay = c.f("optimizer.weight_decay");
  o.momentum = c.f("optimizer.momentum");
  o.nesterov = c.b("optimizer.nesterov");
  o.grad_clip = c.f("optimizer.grad_clip");
  o.state_dtype = c.kind<DType>("optimizer.state_dtype");
  if (o.kind == OptimizerKind::Sgd && o.nesterov && o.momentum == 0)
    c.error("optimizer.nesterov", "Nesterov momentum needs momentum > 0", "set optimizer.momentum, or nesterov = false", {"optimizer.momentum"});
}

void build_schedule(Builder& c, Recipe& r) {
  ScheduleOptions& s = r.schedule;
  s.kind = c.kind<ScheduleKind>("schedule.name");
  s.warmup_steps = c.i("schedule.warmup_steps");
  s.min_lr_ratio = c.f("schedule.min_lr_ratio");
  s.milestones = c.floats("schedule.milestones");
  s.factors = c.floats("schedule.factors");
  s.decay_fraction = c.f("schedule.decay_fraction");
  s.pct_start = c.f("schedule.pct_start");
  s.div_factor = c.f("schedule.div_factor");
  s.final_div_factor = c.f("schedule.final_div_factor");

  int64_t steps = r.run.steps;
  if (s.kind != ScheduleKind::OneCycle && s.warmup_steps >= steps && s.warmup_steps > 0)
    c.error("schedule.warmup_steps", "warmup (" + std::to_string(s.warmup_steps) + " steps) is not shorter than the run (" + std::to_string(steps) + ")",
            "use fewer warmup steps than run.steps", {"run.steps"});
  if (s.kind == ScheduleKind::MultiStep) {
    for (size_t i = 0; i < s.milestones.size(); ++i)
      if (s.milestones[i] <= 0 || s.milestones[i] >= 1 || (i > 0 && s.milestones[i] <= s.milestones[i - 1])) {
        c.error("schedule.milestones", "milestones must rise strictly inside (0, 1) (fractions of run.steps)", "write e.g. milestones = [0.8, 0.9]");
        break;
      }
    if (s.factors.size() != s.milestones.size())
      c.error("schedule.factors", "one factor per milestone: " + std::to_string(s.milestones.size()) + " milestones, " +
                                      std::to_string(s.factors.size()) + " factors",
              "give as many factors as milestones", {"schedule.milestones"});
    if (s.milestones.empty()) c.error("schedule.milestones", "multistep needs at least one milestone", "write milestones = [0.8, 0.9]");
    for (double f : s.factors)
      if (f <= 0) c.error("schedule.factors", "a factor of 0 stops learning", "use factors > 0");
    if (!s.milestones.empty() && s.milestones.front() * steps <= s.warmup_steps)
      c.error("schedule.milestones", "the first milestone falls inside the warmup", "move the milestone later or shorten the warmup", {"schedule.warmup_steps", "run.steps"});
  }
  if (s.kind == ScheduleKind::Wsd && s.warmup_steps + s.decay_fraction * steps > steps)
    c.error("schedule.decay_fraction", "warmup plus decay is longer than the run", "shorten the warmup or lower decay_fraction", {"schedule.warmup_steps", "run.steps"});
}

void build_data(Builder& c, Recipe& r, const std::string& recipe_dir) {
  DataOptions& d = r.data;
  d.kind = c.kind<DataKind>("data.kind");
  // A path is relative to the file that set it: a base template's own directory, else the recipe's.
  const auto recipe_relative = [&](const std::string& key, const std::string& value) {
    return resolve_path(value, c.at(key).source.layer == Layer::Base ? parent_directory(c.at(key).source.file) : recipe_dir);
  };
  d.path = recipe_relative("data.path", c.s("data.path"));
  d.tokenizer = c.s("data.tokenizer");
  for (const std::string& p : c.strings("data.blend")) d.blend.push_back(recipe_relative("data.blend", p));
  d.blend_weights = c.floats("data.blend_weights");
  d.val_path = recipe_relative("data.val_path", c.s("data.val_path"));
  d.format = c.kind<TokenFormat>("data.format");
  d.token_width = static_cast<int>(c.i("data.token_width"));
  d.document_token = c.i("data.document_token");
  d.separate_documents = c.b("data.separate_documents");
  d.augment = c.b("data.augment");
  if (!d.blend.empty() && !c.s("data.path").empty())
    c.error("data.blend", "both data.path and data.blend name the data", "keep one: data.blend for a mixture, data.path for one source", {"data.path"});
  for (const MixtureProblem& m : mixture_problems(d.blend.size(), d.blend_weights)) c.error(m.key, m.message, m.hint, m.related);
  if (d.format == TokenFormat::Nanogpt && d.token_width != 2 && d.token_width != 4)
    c.error("data.token_width", "nanoGPT's .bin has no header saying how wide a token is", "set data.token_width = 2 (uint16, as nanoGPT writes) or 4", {"data.format"});
  if (d.kind != DataKind::Tokens && (!d.blend.empty() || d.separate_documents))
    c.error(d.blend.empty() ? "data.separate_documents" : "data.blend", "only data.kind = \"tokens\" reads mixtures and document boundaries",
            "set data.kind = \"tokens\" (prepare text with dsrun prepare)", {"data.kind"});
  // (The layout's rules run before the data is read: this one of context parallelism's is here.)
  if (d.separate_documents && r.parallel.context > 1)
    c.error("parallel.context", "context parallelism with packed documents (data.separate_documents: a boundary would have to be found across the chunks) is not supported yet",
            "set parallel.context = 1, or data.separate_documents = false", {"data.separate_documents"});
  if (d.separate_documents && r.model.mtp.enabled())
    c.error("data.separate_documents", "multi-token prediction would predict across document boundaries, which separate documents forbid (not built yet)",
            "set data.separate_documents = false, or model.mtp.depth = 0", {"model.mtp.depth"});
  r.model.init_from = recipe_relative("model.init_from", c.s("model.init_from"));
  if (!r.model.init_from.empty() && !file_exists(r.model.init_from))
    c.error("model.init_from", "\"" + r.model.init_from + "\" does not exist", "give a .safetensors file or a directory of them (dsrun export writes one)");
  d.val_fraction = c.f("data.val_fraction");
  d.shuffle = c.b("data.shuffle");
  // A Megatron-LM prefix names PREFIX.bin and PREFIX.idx, not a file of its own.
  const auto present = [&](const std::string& p) { return file_exists(p) || (d.kind == DataKind::Tokens && file_exists(p + ".bin") && file_exists(p + ".idx")); };
  if (d.kind != DataKind::Synthetic && d.blend.empty()) {
    if (d.path.empty())
      c.error("data.path", "data.kind = \"" + c.s("data.kind") + "\" needs a path", "set data.path to a file or directory");
    else if (!present(d.path))
      c.warning("data.path", "\"" + d.path + "\" does not exist on this machine; " + std::string(kLackedHere), "check the path");
  }
  int missing = 0;
  for (const std::string& p : d.blend) missing += present(p) ? 0 : 1;
  if (missing > 0 && d.blend.size() <= kMaxBlendSources)
    c.warning("data.blend", std::to_string(missing) + " of " + std::to_string(d.blend.size()) + " sources do not exist on this machine; " + std::string(kLackedHere),
              "check the paths");
  if (!d.val_path.empty() && !present(d.val_path))
    c.warning("data.val_path", "\"" + d.val_path + "\" does not exist on this machine; " + std::string(kLackedHere), "check the path");
  bool images = r.model.arch == ModelArch::ResNet;
  if (images && (d.kind == DataKind::Text || d.kind == DataKind::Tokens))
    c.error("data.kind", "a ResNet trains on images, not " + c.s("data.kind"), "use data.kind = \"cifar10\" or \"synthetic\"", {"model.arch"});
  if (!images && d.kind == DataKind::Cifar10)
    c.error("data.kind", "CIFAR-10 images need model.arch = \"resnet\"", "use text, tokens or synthetic data for a decoder", {"model.arch"});
  if (images && d.kind == DataKind::Cifar10) {
    const ResNetSpec& rn = r.model.resnet;
    if (rn.image_size != 32 || rn.channels != 3 || rn.classes != 10)
      c.error("model.resnet.classes", "CIFAR-10 is 32x32 RGB in 10 classes", "set image_size = 32, channels = 3, classes = 10", {"model.resnet.image_size", "model.resnet.channels", "data.kind"});
  }
  if (!images && d.kind == DataKind::Text && r.model.vocab < 256)
    c.error("model.vocab", "byte-level text needs a vocabulary of at least 256", "set model.vocab = 256", {"data.kind"});
}

void build_execution(Builder& c, Recipe& r) {
  for (const ExecutionModeRow& row : execution_mode_rows()) {
    const std::string key = std::string("execution.") + row.name;
    if (!c.at(key).value.is_auto()) r.execution.forced[row.name] = c.b(key);
  }
}

void build_rest(Builder& c, Recipe& r, const std::string& recipe_dir) {
  r.eval.every = c.i("eval.every");
  r.eval.batches = c.i("eval.batches");
  if (r.eval.every > 0 && r.data.val_fraction <= 0 && r.data.val_path.empty())
    c.error("eval.every", "evaluation needs a validation split", "set data.val_fraction > 0 (or data.val_path), or eval.every = 0", {"data.val_fraction"});

  r.checkpoint.every = c.i("checkpoint.every");
  r.checkpoint.keep_last = c.i("checkpoint.keep_last");
  r.checkpoint.keep_every = c.i("checkpoint.keep_every");
  r.checkpoint.dir = resolve_path(c.s("checkpoint.dir"), recipe_dir);
  if (!r.checkpoint.dir.empty()) {
    const std::string problem = directory_problem(r.checkpoint.dir);
    if (!problem.empty())
      c.error("checkpoint.dir", r.checkpoint.dir + " " + problem, "name a directory this user can write (it is created if missing), or leave checkpoint.dir empty for the run's own");
  }
  r.checkpoint.at_end = c.b("checkpoint.at_end");
  r.checkpoint.async_set = c.written("checkpoint.async");
  r.checkpoint.async = r.checkpoint.async_set ? c.b("checkpoint.async") : r.hardware.device == Device::Cuda;

  r.logging.every = c.i("logging.every");
  r.logging.level = c.s("logging.level");
  r.logging.tensorboard = c.b("logging.tensorboard");
  r.logging.progress = c.b("logging.progress");

  HookOptions& h = r.hooks;
  const Setting& script = c.at("hooks.script");
  h.script = resolve_path(script.value.s, script.source.layer == Layer::Base ? parent_directory(script.source.file) : recipe_dir);
  h.on_error = c.kind<HookErrorPolicy>("hooks.on_error");
  h.instruction_limit = c.i("hooks.instruction_limit");
  h.time_limit_seconds = c.f("hooks.time_limit_s");
  h.memory_limit_bytes = c.f("hooks.memory_limit_mb") * 1e6;
  for (const auto& [key, setting] : c.config)
    if (starts_with(key, "hooks.options.")) h.options[key.substr(14)] = setting.value.toml();
  if (!h.script.empty() && !file_exists(h.script))
    c.error("hooks.script", "hook script \"" + h.script + "\" not found", "check the path (relative to the recipe)");
  else if (!h.script.empty() && is_directory(h.script))
    c.error("hooks.script", "hook script \"" + h.script + "\" is a directory", "name the .lua file in it (relative to the recipe)");
}

// Keys that only mean something under another key's value: written anyway, they are a warning,
// so that nothing the user wrote is ignored silently.
struct Applicability {
  const char* prefix;
  std::function<bool(const Recipe&)> applies;
  const char* when;
};

void warn_inapplicable(Builder& c, const Recipe& r) {
  static const std::vector<Applicability> rules = {
      {"parallel.sequence_parallel", [](const Recipe& x) { return x.parallel.tensor > 1 || x.parallel.search.any(); }, "parallel.tensor > 1"},
      {"parallel.pipeline_schedule", [](const Recipe& x) { return x.parallel.pipeline > 1 || x.parallel.search.any(); }, "parallel.pipeline > 1"},
      {"optimizer.momentum", [](const Recipe& x) { return x.optimizer.kind == OptimizerKind::Sgd; }, "optimizer.name = \"sgd\""},
      {"optimizer.nesterov", [](const Recipe& x) { return x.optimizer.kind == OptimizerKind::Sgd; }, "optimizer.name = \"sgd\""},
      {"optimizer.betas", [](const Recipe& x) { return x.optimizer.kind != OptimizerKind::Sgd; }, "optimizer.name is adam or adamw"},
      {"optimizer.eps", [](const Recipe& x) { return x.optimizer.kind != OptimizerKind::Sgd; }, "optimizer.name is adam or adamw"},
      {"precision.loss_scale.", [](const Recipe& x) { return x.precision.dtype == DType::Fp16; }, "precision.dtype = \"fp16\""},
      {"schedule.min_lr_ratio", [](const Recipe& x) { auto k = x.schedule.kind; return k == ScheduleKind::Linear || k == ScheduleKind::Cosine || k == ScheduleKind::Wsd; }, "schedule.name is linear, cosine or wsd"},
      {"schedule.milestones", [](const Recipe& x) { return x.schedule.kind == ScheduleKind::MultiStep; }, "schedule.name = \"multistep\""},
      {"schedule.factors", [](const Recipe& x) { return x.schedule.kind == ScheduleKind::MultiStep; }, "schedule.name = \"multistep\""},
      {"schedule.decay_fraction", [](const Recipe& x) { return x.schedule.kind == ScheduleKind::Wsd; }, "schedule.name = \"wsd\""},
      {"schedule.pct_start", [](const Recipe& x) { return x.schedule.kind == ScheduleKind::OneCycle; }, "schedule.name = \"onecycle\""},
      {"schedule.div_factor", [](const Recipe& x) { return x.schedule.kind == ScheduleKind::OneCycle; }, "schedule.name = \"onecycle\""},
      {"schedule.final_div_factor", [](const Recipe& x) { return x.schedule.kind == ScheduleKind::OneCycle; }, "schedule.name = \"onecycle\""},
      {"schedule.warmup_steps", [](const Recipe& x) { return x.schedule.kind != ScheduleKind::OneCycle; }, "the schedule is not onecycle (which warms up by pct_start)"},
      {"model.moe.shared_experts", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.top_k", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.intermediate", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.first_dense_layers", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.aux_loss_weight", [](const Recipe& x) { return x.model.moe.enabled() && !x.model.moe.learns_bias(); }, "model.moe.balance = \"aux_loss\""},
      {"model.moe.capacity_factor", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.route_bias", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.balance", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.bias_update_rate", [](const Recipe& x) { return x.model.moe.learns_bias(); }, "model.moe.balance = \"bias\""},
      {"model.moe.scoring_func", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.n_group", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.topk_group", [](const Recipe& x) { return x.model.moe.enabled() && x.model.moe.n_group > 1; }, "model.moe.n_group > 1"},
      {"model.moe.norm_topk_prob", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.routed_scaling_factor", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.moe.seq_aux_loss_weight", [](const Recipe& x) { return x.model.moe.enabled(); }, "model.moe.routed_experts > 0"},
      {"model.mla.", [](const Recipe& x) { return x.model.latent_attention(); }, "model.attention = \"mla\""},
      {"model.kv_heads", [](const Recipe& x) { return !x.model.latent_attention(); }, "model.attention = \"mha\" (MLA gives every head its own key and value)"},
      {"model.mtp.loss_weight", [](const Recipe& x) { return x.model.mtp.enabled(); }, "model.mtp.depth > 0"},
      {"model.rope_scaling.factor", [](const Recipe& x) { return x.model.rope_scaling.kind != RopeScalingKind::None; }, "model.rope_scaling.type = \"yarn\""},
      {"model.rope_scaling.original", [](const Recipe& x) { return x.model.rope_scaling.kind != RopeScalingKind::None; }, "model.rope_scaling.type = \"yarn\""},
      {"model.rope_scaling.beta", [](const Recipe& x) { return x.model.rope_scaling.kind != RopeScalingKind::None; }, "model.rope_scaling.type = \"yarn\""},
      {"model.rope_scaling.mscale", [](const Recipe& x) { return x.model.rope_scaling.kind != RopeScalingKind::None; }, "model.rope_scaling.type = \"yarn\""},
      {"parallel.expert_imbalance", [](const Recipe& x) { return x.parallel.expert > 1 || x.parallel.search.expert; }, "parallel.expert > 1"},
      {"model.resnet.", [](const Recipe& x) { return x.model.arch == ModelArch::ResNet; }, "model.arch = \"resnet\""},
      {"batch.seq_len", [](const Recipe& x) { return x.model.arch == ModelArch::DeepSeek; }, "model.arch = \"deepseek\""},
      {"batch.loss_chunk_tokens", [](const Recipe& x) { return x.model.arch == ModelArch::DeepSeek; }, "model.arch = \"deepseek\""},
      {"data.tokenizer", [](const Recipe& x) { return x.data.kind == DataKind::Text; }, "data.kind = \"text\""},
      {"data.path", [](const Recipe& x) { return x.data.kind != DataKind::Synthetic; }, "data.kind is not synthetic"},
      {"data.format", [](const Recipe& x) { return x.data.kind == DataKind::Tokens; }, "data.kind = \"tokens\""},
      {"data.token_width", [](const Recipe& x) { return x.data.format == TokenFormat::Nanogpt; }, "data.format = \"nanogpt\""},
      {"data.document_token", [](const Recipe& x) { return x.data.kind == DataKind::Tokens; }, "data.kind = \"tokens\""},
      {"data.val_path", [](const Recipe& x) { return x.data.kind == DataKind::Tokens; }, "data.kind = \"tokens\""},
      {"data.augment", [](const Recipe& x) { return x.model.arch == ModelArch::ResNet; }, "model.arch = \"resnet\""},
  };
  static const char* decoder_keys[] = {"model.hidden", "model.layers", "model.heads", "model.kv_heads", "model.intermediate",
                                       "model.vocab", "model.max_seq_len", "model.tie_embeddings", "model.rope_theta", "model.moe.routed_experts"};
  for (const auto& [key, setting] : c.config) {
    // A default value does nothing either way; a resolved config read back stays quiet.
    if (!c.written(key) || starts_with(key, "hooks.options.") || setting.value.toml() == default_value(key).toml()) continue;
    for (const auto& rule : rules)
      if (starts_with(key, rule.prefix) && !rule.applies(r))
        c.warning(key, "has no effect unless " + std::string(rule.when), "remove the key, or change the setting it depends on");
    if (r.model.arch == ModelArch::ResNet)
      for (const char* k : decoder_keys)
        if (key == k) c.warning(key, "has no effect for model.arch = \"resnet\"", "remove the key");
  }
}

}  // namespace

Recipe build_recipe(const Config& config, const HostFacts& host, const std::string& recipe_dir,
                    std::vector<Diagnostic>& diagnostics) {
  Builder c{config, diagnostics};
  Recipe r;
  build_run(c, r);
  build_hardware(c, r, host);
  build_model(c, r);
  build_parallel(c, r);
  build_precision(c, r);
  build_batch(c, r);
  check_layout(c, r);
  build_optimizer(c, r);
  build_schedule(c, r);
  build_data(c, r, recipe_dir);
  build_rest(c, r, recipe_dir);
  build_execution(c, r);
  warn_inapplicable(c, r);
  return r;
}

std::vector<TensorSplitSize> tensor_split_sizes(const ModelSpec& m) {
  std::vector<TensorSplitSize> sizes{{"model.heads", m.heads, "each rank computes whole attention heads"},
                                     {"model.kv_heads", m.kv_heads, "each rank keeps whole KV heads; they are not replicated"},
                                     {"model.intermediate", m.intermediate, "the MLP's inner size is split"},
                                     {"model.vocab", m.vocab, "the embedding and output head are split by vocabulary"}};
  if (m.moe.enabled()) sizes.push_back({"model.moe.intermediate", m.moe.intermediate, "each expert's inner size is split"});
  return sizes;
}

int ParallelOptions::data_parallel_or_auto(const HardwareSpec& h) const { return data_parallel.value_or(std::max(1, h.total_devices() / ranks_per_replica())); }


std::optional<int64_t> parse_time_limit_minutes(const std::string& text) {
  // [D-]fields: without a day part, 1 field is M, 2 are M:S, 3 are H:M:S; after D-, H, H:M, H:M:S.
  std::string rest = text;
  int64_t days = -1;
  const size_t dash = rest.find('-');
  if (dash != std::string::npos) {
    const std::string d = rest.substr(0, dash);
    if (d.empty() || d.find_first_not_of("0123456789") != std::string::npos || d.size() > 5) return std::nullopt;
    days = std::stoll(d);
    rest = rest.substr(dash + 1);
  }
  std::vector<int64_t> fields;
  size_t at = 0;
  while (true) {
    const size_t colon = rest.find(':', at);
    const std::string f = rest.substr(at, colon == std::string::npos ? std::string::npos : colon - at);
    if (f.empty() || f.find_first_not_of("0123456789") != std::string::npos || f.size() > 7) return std::nullopt;
    fields.push_back(std::stoll(f));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  if (fields.size() > 3) return std::nullopt;
  int64_t seconds = 0;
  if (days >= 0) {
    const int64_t h = fields[0], m = fields.size() > 1 ? fields[1] : 0, s = fields.size() > 2 ? fields[2] : 0;
    seconds = ((days * 24 + h) * 60 + m) * 60 + s;
  } else if (fields.size() == 1) {
    seconds = fields[0] * 60;
  } else if (fields.size() == 2) {
    seconds = fields[0] * 60 + fields[1];
  } else {
    seconds = (fields[0] * 60 + fields[1]) * 60 + fields[2];
  }
  if (seconds <= 0) return std::nullopt;
  return (seconds + 59) / 60;
}
std::vector<MixtureProblem> mixture_problems(size_t sources, const std::vector<double>& weights) {
  std::vector<MixtureProblem> out;
  if (sources > kMaxBlendSources)
    out.push_back({"data.blend", std::to_string(sources) + " sources: a mixture takes at most " + std::to_string(kMaxBlendSources),
                   "merge sources into directories (a directory is one source)", {}});
  if (weights.empty()) return out;
  double sum = 0;
  bool bad = false;
  for (double w : weights) {
    bad = bad || !(w >= 0) || !std::isfinite(w);
    sum += w;
  }
  if (bad) out.push_back({"data.blend_weights", "a mixture weight is negative or not finite", "give each source a weight >= 0", {}});
  else if (!(sum > 0)) out.push_back({"data.blend_weights", "the mixture weights sum to zero: no source would be read", "give at least one source a positive weight", {}});
  if (weights.size() != sources)
    out.push_back({"data.blend_weights", std::to_string(weights.size()) + " weights for " + std::to_string(sources) + " sources in data.blend",
                   "give one weight per source, or none for equal weights", {"data.blend"}});
  return out;
}

int bytes_per_element(DType d) { return d == DType::Fp32 ? 4 : 2; }

int64_t loss_chunk_tokens(const BatchOptions& batch, int64_t local_vocab) {
  if (batch.loss_chunk_tokens) return *batch.loss_chunk_tokens;
  return std::max<int64_t>(kAutoLossChunkMinTokens, static_cast<int64_t>(kAutoLossChunkBytes / (4.0 * static_cast<double>(std::max<int64_t>(local_vocab, 1)))));
}

}  // namespace dsrun
