#include "engine/recipe/schema.hpp"

#include "engine/recipe/hf_model_config.hpp"

#include "engine/common/text.hpp"
#include "engine/recipe/execution_modes.hpp"
#include "engine/recipe/recipe.hpp"

#include <algorithm>
#include <cmath>

namespace dsrun {

namespace {

constexpr double kBig = 1e15;  // "absurd number" ceiling for counts that have no natural bound

KeySpec key(std::string k, ValueType t, std::string def, std::string doc) {
  KeySpec s;
  s.key = std::move(k);
  s.type = t;
  s.default_toml = std::move(def);
  s.doc = std::move(doc);
  return s;
}
KeySpec ranged(std::string k, ValueType t, std::string def, double lo, double hi, std::string doc) {
  KeySpec s = key(std::move(k), t, std::move(def), std::move(doc));
  s.min = lo;
  s.max = hi;
  return s;
}

KeySpec choice(std::string k, std::string def, std::vector<std::string> choices, std::string doc) {
  KeySpec s = key(std::move(k), ValueType::Choice, "\"" + def + "\"", std::move(doc));
  s.choices = std::move(choices);
  return s;
}

using T = ValueType;

// E's names (kinds.hpp) between `before` and `after` (such as "auto").
template <typename E>
std::vector<std::string> names_of(std::vector<std::string> before = {}, const std::vector<std::string>& after = {}) {
  for (const std::string& n : enum_names<E>()) before.push_back(n);
  before.insert(before.end(), after.begin(), after.end());
  return before;
}

// hardware.collective_ranks and one bus-bandwidth list per collective (kCollectives), written by
// `dsrun probe`: they go right after hardware.comm_efficiency, which they replace where set.
std::vector<KeySpec> collective_keys() {
  std::vector<KeySpec> keys = {ranged("hardware.collective_ranks", T::FloatList, "[]", 2, 1e6,
                                      "Group sizes (ranks of one node) that the hardware.*_gbs lists below were measured for, ascending; written by `dsrun probe`.")};
  for (const auto& [op, name] : kCollectives) {
    keys.push_back(ranged(collective_key(op), T::FloatList, "[]", 1e-3, 1e7,
                          "Probed " + collective_words(op) + " bus bandwidth in GB/s (nccl-tests' busbw), one per hardware.collective_ranks entry, every group of that size in the "
                          "node at once. The plan prices a group by the figure of the largest measured size not above it; empty: link_bandwidth_gbs × comm_efficiency."));
  }
  keys.push_back(ranged("hardware.overlap_cost", T::Float, "1", 0, 2,
                        "GPUs: of a collective that runs beside compute (gradient reductions during backward, ZeRO-3's gathers), the share of its time the step "
                        "still pays: NCCL's kernels take SMs and memory bandwidth from the matrix products beside them. 0: fully hidden. Written by `dsrun probe` "
                        "(matrix products alone, all-reduces alone, both at once); 1 measured in training on 4 H200 over NVLink (docs/benchmarks.md)."));
  keys.push_back(ranged("hardware.p2p_gbs", T::Float, "0", 0, 1e7,
                        "Probed point-to-point bandwidth in GB/s each way between two devices of a node, every pair sending at once (pipeline sends); "
                        "0: link_bandwidth_gbs × comm_efficiency."));
  return keys;
}

std::vector<KeySpec> build_schema() {
  std::vector<KeySpec> keys = {
      // ---- run
      key("run.name", T::String, "\"\"", "Name shown in `dsrun history`. Empty: the recipe's file name."),
      key("run.description", T::String, "\"\"", "Free text kept with the run."),
      key("run.tags", T::StringList, "[]", "Labels to filter runs by."),
      ranged("run.seed", T::Int, "1234", 0, 9.2e18, "Seed for initialisation, data order and dropout. Same seed, same run."),
      ranged("run.steps", T::Int, "100", 1, 1e12, "Optimizer steps to train."),
      ranged("run.max_restarts", T::Int, "0", 0, 1000, "Restarts from the latest checkpoint when a rank dies."),
      ranged("run.step_timeout_s", T::Float, "600", 1, 1e7, "A step slower than this is reported as a hang, naming the rank."),
      ranged("run.startup_timeout_s", T::FloatOrAuto, "\"auto\"", 1, 1e7,
             "Time allowed from launch to the first step (rendezvous, model build, data). `auto`: 120 s plus what the plan expects start-up to take "
             "(building or reading the model's fp32 weights at 0.5 GB/s, mapping the data), shown in the plan."),
      key("run.time_limit", T::String, "\"\"",
          "Wall-clock limit of a batch job (`dsrun run --slurm`), as Slurm's --time: minutes (\"90\"), \"H:MM:SS\" or \"D-HH:MM:SS\". "
          "Empty: the partition's default. Checkpoint often enough to lose little when it is reached."),

      // ---- hardware
      key("hardware.name", T::String, "\"cpu\"", "Label of the hardware profile."),
      choice("hardware.device", "cpu", names_of<Device>(), "Where ranks compute: CPU cores (Gloo) or NVIDIA GPUs (NCCL)."),
      ranged("hardware.nodes", T::Int, "1", 1, 100000, "Machines in the job."),
      ranged("hardware.devices_per_node", T::IntOrAuto, "\"auto\"", 1, 4096,
             "GPUs per node (cuda) or CPU ranks per node (cpu). `auto`: usable cores (cpu) or visible GPUs (cuda)."),
      ranged("hardware.memory_gib", T::FloatOrAuto, "\"auto\"", 0.001, 1e7,
             "Memory per device in GiB (2^30 bytes, as nvidia-smi counts). `auto` (cpu only): host memory, shared by the node's ranks."),
      ranged("hardware.host_memory_gib", T::FloatOrAuto, "\"auto\"", 0.001, 1e8,
             "Host (CPU) memory per node in GiB, for offload. `auto`: this machine's memory."),
      ranged("hardware.peak_tflops_fp32", T::Float, "0.03", 1e-6, 1e7, "Dense fp32 peak per device in TFLOP/s (TF32 where the GPU uses it for fp32 matmuls)."),
      ranged("hardware.peak_tflops_bf16", T::Float, "0", 0, 1e7, "Dense bf16 peak per device in TFLOP/s; 0: bf16 unsupported."),
      ranged("hardware.peak_tflops_fp16", T::Float, "0", 0, 1e7, "Dense fp16 peak per device in TFLOP/s; 0: fp16 unsupported."),
      ranged("hardware.peak_tflops_fp8", T::Float, "0", 0, 1e7,
             "Dense FP8 peak per device in TFLOP/s with fp32 accumulation (H100 and H200: 1979); 0: no FP8 tensor cores (precision.fp8 refused)."),
      ranged("hardware.memory_bandwidth_gbs", T::Float, "20", 1e-3, 1e7, "Device memory bandwidth in GB/s."),
      choice("hardware.link", "shm", {"shm", "pcie", "nvlink", "ethernet", "infiniband"},
             "How devices in a node talk: shared memory (cpu), PCIe, NVLink."),
      ranged("hardware.link_bandwidth_gbs", T::Float, "5", 1e-3, 1e7, "Per-device, per-direction bandwidth of `link` in GB/s."),
      key("hardware.p2p", T::Bool, "true", "Whether GPUs reach each other directly. false: traffic bounces through host memory (consumer GPUs on PCIe)."),
      ranged("hardware.inter_node_bandwidth_gbs", T::Float, "0", 0, 1e7, "Per-node network bandwidth in GB/s; required when nodes > 1."),
      ranged("hardware.host_link_bandwidth_gbs", T::Float, "25", 1e-3, 1e7, "Host-to-device bandwidth in GB/s (PCIe, pinned memory), each way, per GPU while every GPU of the node copies at once, "
             "as offload's traffic and checkpoint staging do; `dsrun probe` measures it so."),
      ranged("hardware.host_memory_bandwidth_gbs", T::Float, "50", 1e-3, 1e7, "Host memory bandwidth in GB/s; an offloaded optimizer step is bound by it."),
      ranged("hardware.host_optimizer_gbs", T::Float, "0", 0, 1e7,
             "The offloaded optimizer step's own throughput on a node, in GB/s of the bytes it reads and writes (24 + 2 bytes per parameter with bf16), "
             "all cores together; measured by `dsrun probe`. 0: bound by host_memory_bandwidth_gbs."),
      ranged("hardware.host_step_beside_compute", T::Float, "1.7", 1, 100,
             "How many times longer the offloaded optimizer step takes while the GPU computes beside it (parallel.delayed_update) than alone. "
             "1.7 measured on one H100 with 16 host cores (the ~1B decoder: 0.42 s beside compute, 0.246 s alone; docs/benchmarks.md); `dsrun probe` measures it."),
      ranged("hardware.disk_write_gbs", T::Float, "1", 1e-4, 1e6,
             "Write bandwidth of the disk under checkpoint.dir in GB/s per node: a synchronous checkpoint's pause. Each save records the measured checkpoint_write_MBps."),
      ranged("hardware.disk_read_gbs", T::Float, "2", 1e-4, 1e6,
             "Read bandwidth of the disk under checkpoint.dir in GB/s per node, from disk rather than the page cache: what a resume waits for to read its checkpoint."),
      ranged("hardware.grouped_matmul_efficiency", T::Float, "0.6", 0.001, 1,
             "GPUs: fraction of peak FLOP/s that a MoE layer's routed experts reach, run as grouped matrix products (forward and backward); "
             "0.61 measured on one H100 with DeepSeek-MoE 16B's experts in bf16 (docs/benchmarks.md)."),
      ranged("hardware.matmul_efficiency", T::Float, "0.5", 0.001, 1,
             "Fraction of peak FLOP/s that training reaches; calibrated by bench/ (docs/benchmarks.md)."),
      ranged("hardware.fp8_matmul_efficiency", T::Float, "0.6", 0.001, 1,
             "GPUs: fraction of peak_tflops_fp8 that the scaled FP8 products of precision.fp8 reach (their operands' quantisation is priced apart, "
             "as memory traffic); `dsrun probe` measures it (0.62-0.72 on an H200 for the ~1B's and the 7B's shapes, tensorwise)."),
      ranged("hardware.fp8_grouped_matmul_efficiency", T::Float, "0.34", 0.001, 1,
             "GPUs: fraction of peak_tflops_fp8 that the routed experts' grouped FP8 products reach (execution.fp8_routed_experts: forward "
             "with fast accumulation and input gradients; their operands' quantisation priced apart); `dsrun probe` measures it at the recipe's "
             "expert shape (0.343 on one H100 with torch 2.11 and DeepSeek-MoE 16B's experts, 679 TFLOP/s, as its bf16 grouped products reach 0.471)."),
      ranged("hardware.attention_efficiency", T::Float, "0", 0, 1,
             "GPUs: fraction of peak FLOP/s that the attention kernels (flash, forward and backward) reach, which prices attention's "
             "12·layers·hidden·seq FLOPs per token apart from the matrix products (it dominates long sequences). 0: as matmul_efficiency."),
      ranged("hardware.comm_efficiency", T::Float, "0.8", 0.001, 1, "Fraction of link bandwidth that collectives reach."),
      ranged("hardware.network_efficiency", T::Float, "0.8", 0.001, 1,
             "Fraction of inter_node_bandwidth_gbs that collectives between nodes reach. Apart from comm_efficiency, which `dsrun probe` "
             "measures on the node's own link; 1 when inter_node_bandwidth_gbs is itself a measured bus bandwidth."),
      ranged("hardware.runtime_memory_gib", T::Float, "0.3", 0, 1e6, "Memory per rank in GiB taken before training starts (CUDA context, NCCL, libraries)."),
      ranged("hardware.host_runtime_memory_gib", T::Float, "1", 0, 1e6,
             "Host memory per GPU rank process in GiB once it trains (libraries, the CUDA context's host side), NCCL's apart; CPU ranks count runtime_memory_gib."),
      ranged("hardware.host_build_memory_gib", T::Float, "0.5", 0, 1e6,
             "Host memory per GPU rank process in GiB while it builds the model, before NCCL and the CUDA libraries grow it: the build's fp32 initial values "
             "(its largest parameter; whole and this rank's slice under tensor parallelism) come on top of this, not of host_runtime_memory_gib. "
             "0.5 measured on 4 H200 (docs/benchmarks.md)."),
      ranged("hardware.host_nccl_memory_gib", T::Float, "0.4", 0, 1e6,
             "Host memory NCCL adds to each GPU rank of a job of several ranks (its proxy threads and host buffers) for its first two communicators (the world's and the data group's), in GiB; each further group it uses (tensor, pipeline, expert shards, expert replicas) adds a quarter of this. 0.4 measured on 4 H200."),
      ranged("hardware.fragmentation", T::Float, "0.05", 0, 0.9, "Allocator slack: fraction of the allocated bytes lost to fragmentation and caching."),

      // ---- model
      key("model.name", T::String, "\"\"", "Label of the model, shown in history."),
      choice("model.arch", "deepseek", names_of<ModelArch>(), "Decoder-only DeepSeek/Llama-style transformer, or ResNet for images."),
      ranged("model.hidden", T::Int, "128", 8, 1048576, "Hidden size (d_model)."),
      ranged("model.layers", T::Int, "4", 1, 10000, "Transformer blocks."),
      ranged("model.heads", T::Int, "4", 1, 65536, "Attention heads; must divide hidden."),
      ranged("model.kv_heads", T::IntOrAuto, "\"auto\"", 1, 65536, "Key/value heads (grouped-query attention); must divide heads. `auto`: equal to heads (multi-head)."),
      ranged("model.intermediate", T::Int, "344", 1, 16777216, "SwiGLU inner size of the dense MLP."),
      ranged("model.vocab", T::Int, "256", 2, 16777216, "Vocabulary size (256 for byte-level text)."),
      ranged("model.max_seq_len", T::Int, "4096", 1, 16777216, "Longest sequence the model is built for."),
      key("model.tie_embeddings", T::Bool, "false", "Share the input embedding with the output projection."),
      ranged("model.rope_theta", T::Float, "10000", 1, 1e12, "Rotary embedding base."),
      ranged("model.norm_eps", T::Float, "1e-6", 1e-12, 0.1, "RMSNorm epsilon."),
      ranged("model.init_std", T::Float, "0.02", 1e-6, 10, "Standard deviation of the normal weight initialisation."),
      choice("model.attention", "mha", names_of<AttentionKind>(),
             "Attention kind. `mha`: multi-head (grouped-query with kv_heads < heads). `mla`: DeepSeek-V2/V3's multi-head latent attention "
             "(model.mla.*; heads keep their number, hidden/heads no longer sets their width)."),
      ranged("model.mla.q_lora_rank", T::Int, "0", 0, 1048576, "MLA: rank of the queries' compressed latent (Hugging Face q_lora_rank; V3: 1536). 0: a full query projection (V2-Lite)."),
      ranged("model.mla.kv_lora_rank", T::Int, "512", 1, 1048576, "MLA: rank of the keys' and values' one compressed latent (V2/V3: 512)."),
      ranged("model.mla.qk_nope_head_dim", T::Int, "128", 1, 4096, "MLA: each head's key and query width without rotary embedding (V2/V3: 128)."),
      ranged("model.mla.qk_rope_head_dim", T::Int, "64", 2, 4096, "MLA: width of the rotary key shared by all heads and of each query's rotary part (V2/V3: 64); even."),
      ranged("model.mla.v_head_dim", T::Int, "128", 1, 4096, "MLA: each head's value width (V2/V3: 128)."),
      ranged("model.mtp.depth", T::Int, "0", 0, 16,
             "Multi-token prediction modules (DeepSeek-V3; Hugging Face num_nextn_predict_layers): module k predicts the token k+1 places after the main "
             "head's, from the previous depth's hidden state and the next token's embedding, through one transformer block; shares the embedding and "
             "the output head. 0: none."),
      ranged("model.mtp.loss_weight", T::Float, "0.3", 0, 100, "Weight of the MTP modules' mean cross-entropy in the loss (DeepSeek-V3: 0.3, then 0.1)."),
      choice("model.rope_scaling.type", "none", names_of<RopeScalingKind>(),
             "Rotary scaling past the length trained on: `yarn` (DeepSeek-V2/V3's 128K; Hugging Face rope_scaling with type \"yarn\")."),
      ranged("model.rope_scaling.factor", T::Float, "1", 1, 1e6, "YaRN: context extension factor (V3: 40)."),
      ranged("model.rope_scaling.original_max_position_embeddings", T::Int, "4096", 1, 16777216, "YaRN: the length the model was trained at before extension (V3: 4096)."),
      ranged("model.rope_scaling.beta_fast", T::Float, "32", 0, 1e6, "YaRN: rotations below which a dimension is interpolated fully (V3: 32)."),
      ranged("model.rope_scaling.beta_slow", T::Float, "1", 0, 1e6, "YaRN: rotations above which a dimension is left as trained (V3: 1)."),
      ranged("model.rope_scaling.mscale", T::Float, "1", 0, 100, "YaRN: attention temperature coefficient of the rotary tables (V3: 1)."),
      ranged("model.rope_scaling.mscale_all_dim", T::Float, "0", 0, 100, "YaRN: coefficient whose temperature scales MLA's softmax (squared) and divides the tables' (V3: 1)."),
      key("model.init_from", T::String, "\"\"", "Initialise the weights from safetensors (a file, or a directory of them) with Hugging Face Llama/DeepSeek names, as `dsrun export` writes; relative to the recipe. Empty: random."),
      ranged("model.moe.routed_experts", T::Int, "0", 0, 65536, "Routed experts per MoE layer; 0: dense model."),
      ranged("model.moe.shared_experts", T::Int, "0", 0, 1024, "Always-active shared experts per MoE layer."),
      ranged("model.moe.top_k", T::Int, "0", 0, 1024, "Routed experts chosen per token."),
      ranged("model.moe.intermediate", T::Int, "0", 0, 16777216, "SwiGLU inner size of each expert."),
      ranged("model.moe.first_dense_layers", T::Int, "1", 0, 10000, "Leading layers that keep a dense MLP (DeepSeek-MoE: 1)."),
      ranged("model.moe.aux_loss_weight", T::Float, "0.001", 0, 10, "Weight of the expert load-balance loss."),
      ranged("model.moe.capacity_factor", T::Float, "0", 0, 1024,
             "Drop a (token, choice) pair once its expert already has capacity_factor × (tokens × top_k / routed_experts) pairs of this "
             "rank's micro-batch, the earliest tokens kept (GShard/Switch); dropped pairs are counted (metric dropped_tokens). 0: no token is dropped."),
      ranged("model.moe.route_bias", T::FloatList, "[]", -1e6, 1e6,
             "One number per routed expert added to the router's scores when choosing the experts, not when weighting them "
             "(DeepSeek-V3's selection bias, here fixed): steers routing, e.g. [100, 0, 0, 0] sends every token to expert 0. Empty: none."),
      choice("model.moe.balance", "aux_loss", names_of<MoeBalance>(),
             "How routing is kept even. `aux_loss`: the expert-level balance loss (aux_loss_weight). `bias`: DeepSeek-V3's auxiliary-loss-free "
             "balancing: a per-expert bias added to the scores when choosing experts (not when weighting them), moved after every step by "
             "bias_update_rate × sign(mean load − load), loads summed over every rank; the bias is model state (checkpointed, exported). "
             "No balance loss is added."),
      ranged("model.moe.bias_update_rate", T::Float, "0.001", 0, 1, "Step of the selection bias per training step with balance = \"bias\" (DeepSeek-V3: 0.001)."),
      choice("model.moe.scoring_func", "softmax", names_of<RouterScore>(),
             "Router affinities: `softmax` over the experts (DeepSeek-MoE, V2) or `sigmoid` per expert (V3). A group's score for n_group is its best "
             "expert's under softmax (V2's group-limited greedy) and its best two summed under sigmoid (V3's)."),
      ranged("model.moe.n_group", T::Int, "1", 1, 65536, "Expert groups for group-limited routing (V3: 8, one per node); must divide routed_experts. 1: no groups."),
      ranged("model.moe.topk_group", T::Int, "1", 1, 65536, "Groups a token's experts are chosen from (V3: 4); at most n_group."),
      key("model.moe.norm_topk_prob", T::Bool, "false", "Normalise the chosen experts' weights to sum 1 (V3: true; DeepSeek-MoE 16B, V2-Lite: false)."),
      ranged("model.moe.routed_scaling_factor", T::Float, "1", 0, 1e6, "Scale of the routed experts' weights (V3: 2.5; V2-Lite: 1)."),
      ranged("model.moe.seq_aux_loss_weight", T::Float, "0", 0, 10,
             "DeepSeek-V3's sequence-wise balance loss weight (alpha, V3: 0.0001): the expert-level loss of each sequence on its own, on the scores "
             "normalised to sum 1 per token; added with either balance. 0: none."),
      ranged("model.resnet.depth", T::Int, "50", 18, 152, "ResNet depth: 18, 34, 50, 101 or 152."),
      ranged("model.resnet.classes", T::Int, "10", 2, 1000000, "Output classes."),
      ranged("model.resnet.image_size", T::Int, "32", 8, 8192, "Square input side in pixels (32 for CIFAR-10)."),
      ranged("model.resnet.channels", T::Int, "3", 1, 64, "Input channels."),
      ranged("model.resnet.width", T::Int, "64", 8, 4096, "Channels of the first stage."),

      // ---- parallel
      ranged("parallel.data_parallel", T::IntOrAuto, "\"auto\"", 1, 1e7, "Data-parallel ranks. `auto`: every device of every node, divided by parallel.tensor."),
      ranged("parallel.tensor", T::IntOrAuto, "1", 1, 1024,
             "Tensor-parallel ranks (Megatron-LM): each layer's heads, MLP and vocabulary split over this many consecutive ranks, "
             "which should share a node. Heads, KV heads, the MLP sizes and the vocabulary must divide by it. "
             "`auto`: the plan searches the layouts (tensor, pipeline, schedule, data, ZeRO, micro batch, recomputation) that fit and picks the fastest predicted (`dsrun plan --layouts`)."),
      key("parallel.tensor_across_nodes", T::Bool, "false",
          "Allow a tensor-parallel group to span nodes. Refused by default: tensor parallelism's all-reduces are every layer's, and across the "
          "network they run at the node's share of hardware.inter_node_bandwidth_gbs (Megatron-LM and torchtitan keep tensor parallelism inside a node)."),
      key("parallel.sequence_parallel", T::BoolOrAuto, "false",
          "With parallel.tensor > 1: split the activations between tensor-parallel regions (norms, residuals) along the sequence "
          "(Korthikanti et al. 2022): 1/tensor of the activation memory at the same traffic. batch.seq_len must divide by parallel.tensor. `auto`: on wherever it applies."),
      ranged("parallel.pipeline", T::IntOrAuto, "1", 1, 1024,
             "Pipeline stages (GPipe/Megatron-LM): the layers split into this many consecutive stages, balanced by the plan's cost model; "
             "the outermost mesh dimension, so stages may sit on different nodes. ZeRO stage 0-2 only. `auto`: searched with the rest of the layout (see parallel.tensor)."),
      choice("parallel.pipeline_schedule", "1f1b", names_of<PipelineScheduleKind>({"auto"}),
             "How micro-batches flow through the stages: `gpipe` (every forward, then every backward: keeps all micro-batches' activations), "
             "`1f1b` (one forward, one backward: at most `pipeline` micro-batches live), `interleaved` (1F1B over parallel.virtual_stages "
             "chunks per rank: a smaller bubble for more sends; micro-batches per step must be a multiple of parallel.pipeline). `auto`: searched."),
      ranged("parallel.virtual_stages", T::IntOrAuto, "1", 1, 64, "Model chunks per pipeline rank, for pipeline_schedule = \"interleaved\" (at least 2 there, 1 otherwise). `auto`: searched."),
      ranged("parallel.expert", T::IntOrAuto, "1", 1, 65536,
             "Expert-parallel ranks (DeepSeek-MoE, as Megatron-LM and torchtitan): each MoE layer's routed experts are sharded over this many "
             "consecutive data-parallel ranks, which send tokens to their experts and back by all-to-all. Carved out of parallel.data_parallel "
             "(which it must divide), not an extra factor of the world; routed_experts must divide by it. Router and shared experts stay replicated; "
             "the routed experts' gradients are reduced over the data ranks keeping the same ones. `auto`: searched with the layout (see parallel.tensor)."),
      ranged("parallel.expert_imbalance", T::Float, "1.25", 1, 1024,
             "Planning headroom for routing imbalance under expert parallelism: the busiest rank's routed tokens over the mean. The plan "
             "scales that rank's routed-expert activations, all-to-all bytes and expert FLOPs by it (metric expert_load_max shows what a run sees)."),
      ranged("parallel.context", T::IntOrAuto, "1", 1, 1024,
             "Context parallelism (Megatron-Core, torchtitan, Llama 3): each sequence split over this many ranks, for sequences whose activations one "
             "device cannot hold. Cut into 2 × context chunks, rank i keeps chunks i and 2 × context - 1 - i (the \"zigzag\": the same share of causal "
             "attention on every rank); keys and values are gathered from the group for each layer's attention, rotary positions are the tokens' places "
             "in the whole sequence. An extra factor of the world (pipeline × data × context × tensor); its ranks join the data ranks' gradient "
             "reduction and ZeRO's sharding. batch.seq_len must divide by 2 × context. `auto`: searched with the layout (every degree the "
             "devices and the sequence allow); the plan takes the fastest that fits, so a sequence that fits one rank stays whole."),
      ranged("parallel.zero_stage", T::IntOrAuto, "\"auto\"", 0, 3,
             "ZeRO stage: 0 replicate all, 1 shard optimizer states, 2 also gradients, 3 also parameters. `auto`: the lowest that fits, or a higher one that plans at least 1% faster (a larger micro batch fits under it, or its optimizer step is sharded)."),
      choice("parallel.offload", "none", names_of<Offload>({}, {"auto"}),
             "Keep optimizer states (and with ZeRO-3 parameters) in host memory. `auto`: the least that fits, searched with the rest of the layout: "
             "none, then the optimizer, then the parameters too (offload costs time; the plan says why it chose)."),
      key("parallel.delayed_update", T::Bool, "false",
          "Offload: run step t's host optimizer step while step t+1 computes, on the parameters from before it "
          "(ZeRO-Offload's one-step delayed parameter update, DPU). Faster; each step's gradients are one update stale. Needs parallel.offload."),
      choice("parallel.activation_checkpointing", "none", names_of<Checkpointing>(),
             "Recompute each block's activations in backward. `auto`: only when activations would not fit."),
      ranged("parallel.bucket_mb", T::Float, "25", 0.001, 1e6, "Gradient bucket size in MB for ZeRO-0's all-reduce (stages 1-3 reduce per unit)."),

      // ---- precision
      choice("precision.dtype", "fp32", names_of<DType>(),
             "Compute dtype. bf16/fp16 keep fp32 master weights and optimizer states; fp16 adds dynamic loss scaling."),
      choice("precision.grad_dtype", "auto", {"auto", "fp32", "bf16", "fp16"},
             "The dtype gradients are accumulated in over micro-batches and reduced in over ranks (ZeRO 0-3, tensor, pipeline and expert "
             "gradients); the optimizer reads it as it is. fp32 (Megatron-Core's main_grad, torchtitan's reduce_dtype): each micro-batch's "
             "gradient in precision.dtype is added into an fp32 buffer, reductions move twice the bytes, and the buffer takes 4 bytes a "
             "parameter (the plan counts both). bf16/fp16: precision.dtype itself. `auto`: fp32 wherever a bf16/fp16 gradient would be "
             "summed (more than one micro-batch a step, or more than one data rank), else precision.dtype; the plan says which."),
      choice("precision.fp8", "none", names_of<Fp8Scaling>(),
             "FP8 products for the blocks' linear layers (attention's projections, the dense MLPs, the shared experts), forward and both gradients "
             "(E4M3 operands, gradients E5M2 under one scale per tensor and E4M3 under finer ones, fp32 accumulation, bf16 outputs): one scale per tensor, "
             "per row (rowwise), or per 1x128 block of activations and gradients and 128x128 block of weights (blockwise, DeepSeek-V3's; sizes in multiples of 128). "
             "The routed experts' grouped products follow where execution.fp8_routed_experts says (row scales). "
             "The embedding, output projection, norms and router stay in precision.dtype, which must be bf16; masters stay fp32. "
             "Needs GPUs with FP8 tensor cores (hardware.peak_tflops_fp8 > 0) and a PyTorch 2.x build."),
      ranged("precision.loss_scale.initial_power", T::Int, "16", 0, 64, "fp16: the loss scale starts at 2^this."),
      ranged("precision.loss_scale.window", T::Int, "1000", 1, 1e9, "fp16: steps without overflow before the scale doubles."),
      ranged("precision.loss_scale.hysteresis", T::Int, "2", 1, 1000, "fp16: overflows tolerated before the scale halves."),
      ranged("precision.loss_scale.min_scale", T::Float, "1", 1e-30, 1e30, "fp16: the scale never drops below this; reaching it is an error."),
      ranged("precision.loss_scale.overflow_retries", T::Int, "8", 0, 64,
             "fp16: a step whose gradients overflowed runs again on the same batch at half the scale, up to this many times, before it is skipped "
             "(so warm-up's overflows cost compute, not updates); 0: skip at once, DeepSpeed's rule."),

      // ---- batch
      ranged("batch.global", T::Int, "8", 1, 1e12, "Sequences (or images) per optimizer step, over all ranks."),
      ranged("batch.micro", T::IntOrAuto, "\"auto\"", 1, 1e12,
             "Sequences per rank per forward/backward. `auto`: the largest that fits. Accumulation = global / (micro × data_parallel)."),
      ranged("batch.seq_len", T::Int, "128", 1, 16777216, "Tokens per sequence (decoders)."),
      ranged("batch.loss_chunk_tokens", T::IntOrAuto, "\"auto\"", 0, 1e12,
             "Decoders: the output projection and the cross-entropy run as one, this many tokens at a time, so the whole fp32 logits "
             "and their gradient never exist at once. `auto`: a micro-batch's tokens in one chunk where their fp32 logits take at most "
             "1/32 of a device's memory and the layout still fits (the plan says so), else chunks of about 256 MiB of fp32 logits per "
             "rank and at least 2,048 tokens. 0: whole logits (the projection, then the loss)."),

      // ---- optimizer
      choice("optimizer.name", "adamw", names_of<OptimizerKind>(), "AdamW (decoupled weight decay), Adam (L2 in the gradient), or SGD with momentum."),
      ranged("optimizer.lr", T::Float, "3e-4", 1e-12, 100, "Peak learning rate."),
      ranged("optimizer.betas", T::FloatList, "[0.9, 0.95]", 0, 0.999999, "Adam/AdamW beta1, beta2."),
      ranged("optimizer.eps", T::Float, "1e-8", 1e-30, 1, "Adam/AdamW epsilon."),
      ranged("optimizer.weight_decay", T::Float, "0.1", 0, 10, "Weight decay (decoupled for adamw)."),
      ranged("optimizer.momentum", T::Float, "0.9", 0, 0.999999, "SGD momentum."),
      key("optimizer.nesterov", T::Bool, "false", "SGD: Nesterov momentum."),
      ranged("optimizer.grad_clip", T::Float, "1.0", 0, 1e9, "Clip the global gradient norm (over all shards) to this; 0: no clipping."),
      choice("optimizer.state_dtype", "fp32", {to_string(DType::Fp32), to_string(DType::Bf16)},
             "The optimizer's per-element states (Adam's first and second moments, SGD's momentum): fp32, or bf16 as DeepSeek-V3 "
             "keeps AdamW's moments (updated in fp32, rounded to nearest when stored): half their memory, and on a GPU 8 of "
             "the update's 28 bytes per parameter. Checkpoints store them in fp32 either way, so a run resumes with either."),

      // ---- schedule
      choice("schedule.name", "cosine", names_of<ScheduleKind>(),
             "Learning-rate schedule after warmup. multistep is DeepSeek LLM's; wsd is warmup-stable-decay."),
      ranged("schedule.warmup_steps", T::Int, "0", 0, 1e12, "Linear warmup from 0 to optimizer.lr (not used by onecycle, which has pct_start)."),
      ranged("schedule.min_lr_ratio", T::Float, "0.1", 0, 1, "linear, cosine, wsd: the final learning rate as a fraction of the peak."),
      ranged("schedule.milestones", T::FloatList, "[0.8, 0.9]", 0, 1, "multistep: fractions of run.steps where the rate drops."),
      ranged("schedule.factors", T::FloatList, "[0.316, 0.1]", 0, 1, "multistep: rate after each milestone as a fraction of the peak."),
      ranged("schedule.decay_fraction", T::Float, "0.1", 0.000001, 1, "wsd: fraction of run.steps spent in the final decay."),
      ranged("schedule.pct_start", T::Float, "0.25", 0.000001, 0.999999, "onecycle: fraction of steps spent rising to the peak."),
      ranged("schedule.div_factor", T::Float, "25", 1, 1e9, "onecycle: initial rate = peak / div_factor."),
      ranged("schedule.final_div_factor", T::Float, "1e4", 1, 1e12, "onecycle: final rate = initial / final_div_factor."),

      // ---- data
      choice("data.kind", "synthetic", names_of<DataKind>(),
             "synthetic: generated; text: files read as bytes; tokens: pre-tokenized shards; cifar10: CIFAR-10 binary batches."),
      key("data.path", T::String, "\"\"", "File or directory of the data (text, tokens, cifar10). Relative paths are relative to the recipe."),
      choice("data.tokenizer", "bytes", {"bytes"}, "text: how text becomes tokens (bytes: one token per byte, vocab 256)."),
      ranged("data.val_fraction", T::Float, "0.05", 0, 0.5, "Fraction of the data held out for validation (tokens: of each file, in whole documents where the format marks them)."),
      key("data.shuffle", T::Bool, "true", "Shuffle sample order each epoch (seeded)."),
      choice("data.format", "auto", names_of<TokenFormat>(),
             "tokens: how the files are laid out. auto: by header (dsrun, Megatron-LM .bin/.idx, llm.c); nanogpt: files without a header are nanoGPT's, width from data.token_width."),
      ranged("data.token_width", T::Int, "0", 0, 4, "tokens, nanogpt: bytes per token (2: numpy uint16 as nanoGPT writes, or 4)."),
      ranged("data.document_token", T::Int, "-1", -1, 1e12,
             "tokens, llm.c and nanoGPT: the token between documents. -1: the format's (llm.c GPT-2 50256, LLaMA-3 128000; nanoGPT 50256)."),
      key("data.blend", T::StringList, "[]", "tokens: several sources (paths, as data.path) mixed by data.blend_weights, instead of data.path."),
      ranged("data.blend_weights", T::FloatList, "[]", 0, 1e9, "tokens: one weight per data.blend source (normalised); empty: equal."),
      key("data.val_path", T::String, "\"\"", "tokens: the validation data (any format data.path takes). Empty: the last data.val_fraction of each file, in whole documents."),
      key("data.separate_documents", T::Bool, "false",
          "tokens: positions restart at each document and attention does not cross documents (default: samples run across document ends)."),
      key("data.augment", T::Bool, "false", "cifar10: random crop with 4-pixel zero padding and random horizontal flip, per seed and sample, on the rank's device."),

      // ---- eval
      ranged("eval.every", T::Int, "0", 0, 1e12, "Evaluate every this many steps; 0: never."),
      ranged("eval.batches", T::Int, "4", 1, 1e9, "Validation micro-batches per rank per evaluation."),

      // ---- checkpoint
      ranged("checkpoint.every", T::Int, "0", 0, 1e12, "Save every this many steps; 0: only at the end (if at_end)."),
      ranged("checkpoint.keep_last", T::Int, "3", 1, 1e6, "Keep the newest this many checkpoints."),
      ranged("checkpoint.keep_every", T::Int, "0", 0, 1e12, "Also keep every checkpoint whose step is a multiple of this, forever; 0: none."),
      key("checkpoint.dir", T::String, "\"\"", "Where checkpoints go. Empty: the run's directory."),
      key("checkpoint.at_end", T::Bool, "true", "Save when the run finishes or is stopped."),
      key("checkpoint.async", T::Bool, "false",
          "Write checkpoints from a thread while training goes on: the step pauses only to copy this rank's states to host memory (kept between saves). "
          "Unset: true on GPUs (hardware.device = \"cuda\"), false on CPU ranks."),

      // ---- logging
      ranged("logging.every", T::Int, "1", 1, 1e12, "Record metrics every this many steps."),
      choice("logging.level", "info", {"debug", "info", "warn"}, "Per-rank log level."),
      key("logging.tensorboard", T::Bool, "true", "Also write TensorBoard event files."),
      key("logging.progress", T::Bool, "true", "Show a live progress line on the console."),

      // ---- hooks
      key("hooks.script", T::String, "\"\"", "Lua script with hook functions, relative to the recipe."),
      choice("hooks.on_error", "fail", names_of<HookErrorPolicy>(), "A hook error fails the run, or disables the hook and is recorded."),
      ranged("hooks.instruction_limit", T::Int, "10000000", 1000, 1e12, "Lua instructions allowed per hook call."),
      ranged("hooks.time_limit_s", T::Float, "10", 0.01, 3600, "Wall-clock seconds allowed per hook call."),
      ranged("hooks.memory_limit_mb", T::Float, "64", 0.1, 1e6, "Memory the Lua state may use."),

      // ---- slurm
      key("slurm.partition", T::String, "\"\"", "Partition (`sbatch --partition`); empty: the cluster's default."),
      key("slurm.account", T::String, "\"\"", "Account charged (`sbatch --account`); empty: the user's default."),
      key("slurm.qos", T::String, "\"\"", "Quality of service (`sbatch --qos`)."),
      key("slurm.constraint", T::String, "\"\"", "Node features required (`sbatch --constraint`, e.g. \"h100\")."),
      key("slurm.sbatch", T::StringList, "[]", "Further `#SBATCH` options, one per entry, e.g. [\"--exclusive\", \"--mail-type=END\"]."),
  };
  for (const ExecutionModeRow& row : execution_mode_rows())
    keys.push_back(key(std::string("execution.") + row.name, T::BoolOrAuto, "\"auto\"", row.doc));
  const auto after = std::find_if(keys.begin(), keys.end(), [](const KeySpec& k) { return k.key == "hardware.comm_efficiency"; });
  const std::vector<KeySpec> collectives = collective_keys();
  keys.insert(after + 1, collectives.begin(), collectives.end());
  return keys;
}

}  // namespace

const std::vector<SectionSpec>& recipe_sections() {
  static const std::vector<SectionSpec> sections = {
      {"run", "Identity of the run, its seed and length, and supervision limits."},
      {"hardware", "The machines: devices, memory, peak speed, links. Usually from a template in templates/hardware."},
      {"model", "The network. Usually from a template in templates/models."},
      {"parallel", "How the model is spread over ranks: data parallel with ZeRO, offload, activation checkpointing."},
      {"precision", "Compute dtype and fp16 loss scaling."},
      {"batch", "Batch sizes. Gradient accumulation is derived, never set."},
      {"optimizer", "The optimizer, stepping fp32 master weights (sharded under ZeRO >= 1)."},
      {"schedule", "Learning-rate schedule."},
      {"data", "Training and validation data."},
      {"eval", "Validation during training."},
      {"checkpoint", "Sharded checkpoints."},
      {"logging", "Metrics and logs."},
      {"hooks", "Optional Lua hooks. Free-form options for the script go in [hooks.options]."},
      {"execution", "How a step executes where the plan and the engine must agree; the plan decides each `auto` and the launcher pins it for the ranks."},
      {"slurm", "Batch-job options for `dsrun run --slurm` and `dsrun sweep --slurm` (nodes, tasks and GPUs come from the plan)."},
  };
  return sections;
}

const std::vector<KeySpec>& recipe_schema() {
  static const std::vector<KeySpec> schema = build_schema();
  return schema;
}

const KeySpec* find_key_spec(const std::string& key) {
  for (const auto& s : recipe_schema())
    if (s.key == key) return &s;
  return nullptr;
}

bool is_open_table_key(const std::string& key) { return starts_with(key, "hooks.options."); }

const char* derived_key_explanation(const std::string& key) {
  if (key == "batch.accumulation" || key == "batch.gradient_accumulation" || key == "batch.accumulation_steps")
    return "gradient accumulation is derived: global / (micro × data_parallel); set batch.global and batch.micro";
  if (key == "batch.tokens" || key == "batch.tokens_per_step")
    return "tokens per step are derived: batch.global × batch.seq_len";
  if (key == "parallel.world_size" || key == "run.world_size")
    return "the world size is derived from hardware.nodes × hardware.devices_per_node and parallel.data_parallel";
  return nullptr;
}

const char* key_for_foreign_name(const std::string& name) {
  // Names from DeepSpeed and Megatron configs that users bring along (Hugging Face config.json
  // names: hf_model_config.cpp's table, which dsrun init --from-hf reads by).
  static const std::pair<const char*, const char*> aliases[] = {
      {"learning_rate", "optimizer.lr"},
      {"train_batch_size", "batch.global"},
      {"global_batch_size", "batch.global"},
      {"train_micro_batch_size_per_gpu", "batch.micro"},
      {"micro_batch_size", "batch.micro"},
      {"gradient_clipping", "optimizer.grad_clip"},
      {"max_grad_norm", "optimizer.grad_clip"},
      {"warmup", "schedule.warmup_steps"},
      {"warmup_num_steps", "schedule.warmup_steps"},
      {"lr_scheduler", "schedule.name"},
      {"num_layers", "model.layers"},
      {"rope_scaling", "model.rope_scaling.type"},

      {"stage", "parallel.zero_stage"},
      {"offload_optimizer", "parallel.offload"},
      {"offload_param", "parallel.offload"},
      {"bf16", "precision.dtype"},
      {"fp16", "precision.dtype"},
      {"seed", "run.seed"},
      {"max_steps", "run.steps"},
      {"train_iters", "run.steps"},
  };
  std::string leaf = name.substr(name.rfind('.') + 1);
  for (const auto& [foreign, ours] : aliases)
    if (leaf == foreign) return ours;
  return recipe_key_for_hf_name(leaf);
}

std::string value_type_name(ValueType t) {
  switch (t) {
    case ValueType::Int: return "integer";
    case ValueType::Float: return "number";
    case ValueType::Bool: return "boolean";
    case ValueType::String: return "string";
    case ValueType::Choice: return "string";
    case ValueType::IntOrAuto: return "integer or \"auto\"";
    case ValueType::FloatOrAuto: return "number or \"auto\"";
    case ValueType::BoolOrAuto: return "boolean or \"auto\"";
    case ValueType::FloatList: return "array of numbers";
    case ValueType::StringList: return "array of strings";
  }
  return "?";
}

std::string recipe_reference_markdown() {
  std::string out =
      "# Recipe reference\n\n"
      "Generated from `engine/recipe/schema.cpp` by `dsrun docs recipe`; a test keeps this page equal to it.\n\n"
      "A recipe is a TOML file. `base = \"NAME\"` or `base = [\"NAME\", ...]` at the top names templates "
      "(`templates/NAME.toml`, or a path relative to the recipe) merged first, in order. Precedence: "
      "`--set section.key=value` > recipe > bases (later over earlier) > the defaults below.\n\n"
      "Every error names file:line:column and key. Unknown keys are errors with the nearest valid key. "
      "A key that does not apply to the rest of the recipe (say `optimizer.momentum` with AdamW) is a warning.\n";
  for (const auto& section : recipe_sections()) {
    out += "\n## [" + section.name + "]\n\n" + section.doc + "\n\n";
    out += "| key | type | default | range / choices | meaning |\n|---|---|---|---|---|\n";
    for (const auto& s : recipe_schema()) {
      if (!starts_with(s.key, section.name + ".")) continue;
      std::string range;
      if (!s.choices.empty()) range = join(s.choices, ", ");
      else if (s.min != 0 || s.max != 0) range = format_double(s.min) + " .. " + format_double(s.max);
      out += "| `" + s.key + "` | " + value_type_name(s.type) + " | `" + s.default_toml + "` | " + range + " | " + s.doc + " |\n";
    }
  }
  return out;
}

}  // namespace dsrun
