// The execution modes' rules, each once: the plan prices what they decide and the rank runs it.
#include "engine/recipe/execution_modes.hpp"

#include "engine/common/text.hpp"

namespace dsrun {

const std::array<ExecutionModeRow, 9>& execution_mode_rows() {
  static const std::array<ExecutionModeRow, 9> rows{{
      {"loss_gradients_in_forward", &ExecutionModes::loss_gradients_in_forward, "the fused loss's gradients made in forward",
       "Decoders with the fused output projection and loss: its gradients computed in forward, in the same pass as the loss (one tensor rank, "
       "not fp16). `auto`: where that holds; false: backward recomputes each chunk's logits."},
      {"step_applies_scales", &ExecutionModes::step_applies_scales, "clip and unscale inside the optimizer's step",
       "GPUs with Adam/AdamW and torch's fused AdamW or dsrun's Adam kernel: the clip and loss scale applied by the optimizer's step, "
       "not as a pass over the gradients. `auto`: where that holds."},
      {"update_on_device", &ExecutionModes::update_on_device, "update on the device",
       "GPUs without offload and with dsrun's Adam kernel: the step reads the bf16/fp16 working gradients and writes the working "
       "parameters, decided on the device without waiting for the host. `auto`: where that holds."},
      {"gradients_left_to_autograd", &ExecutionModes::gradients_left_to_autograd, "gradients left to autograd",
       "One GPU rank at ZeRO 0-2 updating on the device: no gradient buffer, the step reads autograd's gradients where they are. "
       "`auto`: where that holds."},
      {"variable_length_attention", &ExecutionModes::variable_length_attention, "variable-length attention",
       "data.separate_documents on GPUs in bf16/fp16 with PyTorch >= 2.2: attention within documents by FlashAttention-2's "
       "variable-length kernel (head_dim a multiple of 8, at most 256). `auto`: where that holds; false: an additive mask."},
      {"shared_experts_beside_dispatch", &ExecutionModes::shared_experts_beside_dispatch, "shared experts beside the dispatch",
       "Expert parallelism with shared experts: a MoE layer computes its shared experts while its routed rows travel to their ranks "
       "(DeepSeek-V3's overlap), not before the exchange. `auto`: where that holds."},
      {"tokens_once_per_rank", &ExecutionModes::tokens_once_per_rank, "each token once to each expert rank",
       "Expert parallelism with top_k > 1: a token whose choices are on one rank travels there once, not once per choice; the rank "
       "makes the choices' rows, and their gradient comes back summed (DeepSeek-V3's dispatch). The outputs come back per choice. "
       "`auto`: where that holds; false: every (token, choice) pair travels."},
      {"cuda_graphs", &ExecutionModes::cuda_graphs, "forward and backward replayed as one CUDA graph",
       "A decoder on one GPU rank in bf16, one micro-batch a step, gradients left to autograd, no recomputation, no MoE layer, no "
       "separate documents and no hooks: the step's forward and backward captured once as a CUDA graph after two steps, then replayed "
       "with each batch copied into its inputs (no launch gaps); the update stays outside it. A capture that fails falls back to the "
       "eager step and says why. The graph keeps its activations' memory between steps, so an evaluation's forward comes on top "
       "(the plan counts it). Same losses as the eager step; on the ~1B on one H200, 0.5% faster on average (-0.7% to +1.1% over 10 pairs: docs/benchmarks.md). "
       "`auto` and true: where that holds."},
      {"fp8_routed_experts", &ExecutionModes::fp8_routed_experts, "the routed experts' grouped products in FP8",
       "precision.fp8 on a MoE model: the routed experts' forward and input-gradient grouped products in FP8 too (E4M3, scaled per row "
       "whatever precision.fp8's scaling, the only scales torch's grouped kernel takes; PyTorch >= 2.9 on CUDA); their weight gradients stay "
       "bf16. Each micro-batch quantises every local expert's weights and their transposes, so it pays only where an expert gets many rows: "
       "`auto` turns it on where, at the rows an expert gets in a micro-batch (micro x seq_len x top_k x parallel.expert / routed_experts), "
       "the products' saving priced by the hardware's figures (fp8_grouped_matmul_efficiency against grouped_matmul_efficiency, "
       "memory_bandwidth) exceeds that quantisation; true wherever it can run. On one H100 with torch 2.11 the MoE benchmark's shape "
       "ran 5.8% slower at 768 rows an expert and 1.4% faster at 3072 than with the routed experts in bf16 (docs/benchmarks.md, 2026-11-28)."},
  }};
  return rows;
}

std::vector<std::pair<std::string, Value>> ExecutionModes::to_config_keys() const {
  std::vector<std::pair<std::string, Value>> keys{{"batch.loss_chunk_tokens", Value::of_int(loss_chunk_tokens)},
                                                  {"precision.grad_dtype", Value::of_string(to_string(gradient_dtype))}};
  for (const ExecutionModeRow& row : execution_mode_rows()) keys.push_back({std::string("execution.") + row.name, Value::of_bool(this->*row.field)});
  return keys;
}

std::string ExecutionModes::describe() const {
  std::vector<std::string> on;
  for (const ExecutionModeRow& row : execution_mode_rows())
    if (this->*row.field) on.push_back(row.words);
  return on.empty() ? "none of the special paths" : join(on, ", ");
}

bool ExecutionModes::operator==(const ExecutionModes& o) const {
  if (loss_chunk_tokens != o.loss_chunk_tokens || gradient_dtype != o.gradient_dtype) return false;
  for (const ExecutionModeRow& row : execution_mode_rows())
    if (this->*row.field != o.*row.field) return false;
  return true;
}

BuildKernels planned_kernels(Device device, const BuildKernels& here) {
  if (device != Device::Cuda || here.cuda) return here;
  BuildKernels gpu;
  gpu.cuda = gpu.device_adam = gpu.fused_adam = gpu.varlen_attention = gpu.fp8_grouped_products = true;
  return gpu;
}

namespace {

// Micro-batches a step on each data rank (0 where the layout has no micro batch yet).
int64_t micro_batches_per_step(const Recipe& r, const Layout& l) { return l.micro * l.data > 0 ? r.batch.global / (l.micro * l.data) : 0; }

}  // namespace

std::pair<DType, std::string> gradient_dtype_rule(const Recipe& r, const Layout& l) {
  const DType working = r.precision.dtype;
  if (r.precision.grad_dtype) return {*r.precision.grad_dtype, "precision.grad_dtype"};
  if (working == DType::Fp32) return {DType::Fp32, "fp32 training"};
  const int64_t accumulation = micro_batches_per_step(r, l);
  if (accumulation > 1) return {DType::Fp32, std::to_string(accumulation) + " micro-batches' gradients summed each step"};
  if (l.data_ranks() > 1) return {DType::Fp32, "gradients summed over " + std::to_string(l.data_ranks()) + (l.context > 1 ? " data × context ranks" : " data ranks")};
  return {working, "one micro-batch a step on one data rank: no gradient is summed"};
}

std::optional<Recipe> recipe_with_working_gradients(const Recipe& recipe) {
  if (recipe.precision.grad_dtype || recipe.precision.dtype == DType::Fp32) return std::nullopt;
  Recipe narrow = recipe;
  narrow.precision.grad_dtype = recipe.precision.dtype;
  return narrow;
}

ExecutionModes decide_execution_modes(const Recipe& r, const Layout& l, int64_t loss_chunk_tokens, const BuildKernels& k, std::vector<RefusedMode>* refused) {
  ExecutionModes m;
  m.loss_chunk_tokens = loss_chunk_tokens;
  // Each mode: on where `why_not` is empty, unless the recipe turned it off.
  const auto decide = [&](bool ExecutionModes::*field, const char* name, const std::string& why_not) {
    const auto forced = r.execution.forced.find(name);
    const bool wanted = forced == r.execution.forced.end() || forced->second;
    m.*field = wanted && why_not.empty();
    if (refused && wanted && !why_not.empty() && forced != r.execution.forced.end())
      refused->push_back({name, why_not});
  };
  m.gradient_dtype = gradient_dtype_rule(r, l).first;
  const bool gpu = r.hardware.device == Device::Cuda;
  const bool adam = r.optimizer.kind != OptimizerKind::Sgd;
  decide(&ExecutionModes::loss_gradients_in_forward, "loss_gradients_in_forward",
         loss_chunk_tokens <= 0      ? "the loss is not fused (batch.loss_chunk_tokens = 0)"
         : l.tensor > 1              ? "the vocabulary is split over tensor ranks"
         : r.precision.dtype == DType::Fp16 ? "in fp16 the loss scale must multiply the gradients before they are rounded"
                                     : "");
  decide(&ExecutionModes::step_applies_scales, "step_applies_scales",
         !gpu                          ? "CPU ranks"
         : !adam                       ? "SGD"
         : !k.fused_adam && !k.device_adam ? "this build has neither torch's fused AdamW nor dsrun's Adam kernel"
                                       : "");
  decide(&ExecutionModes::update_on_device, "update_on_device",
         !m.step_applies_scales        ? "the step does not apply the scales (execution.step_applies_scales)"
         : !k.device_adam              ? "this build has no dsrun Adam kernel (a CUDA build: scripts/gpu_build.sh)"
         : l.offload != Offload::None  ? "the optimizer is offloaded"
                                       : "");
  decide(&ExecutionModes::gradients_left_to_autograd, "gradients_left_to_autograd",
         !m.update_on_device           ? "the update is not on the device (execution.update_on_device)"
         : l.world() != 1              ? "gradients are reduced over ranks"
         : l.zero_stage > 2            ? "ZeRO-3 keeps gradients in its flat shards"
         : m.gradient_dtype != r.precision.dtype ? "gradients are accumulated in fp32 (precision.grad_dtype)"
                                       : "");
  const int64_t head_dim = r.model.head_dim();
  decide(&ExecutionModes::variable_length_attention, "variable_length_attention",
         !r.data.separate_documents || r.model.arch != ModelArch::DeepSeek ? "documents are not kept apart (data.separate_documents)"
         : !gpu                          ? "CPU ranks"
         : r.precision.dtype == DType::Fp32 ? "the kernel runs in bf16/fp16 only"
         : !k.varlen_attention           ? "this build's PyTorch has no variable-length kernel (2.2 or later)"
         : head_dim % 8 != 0 || head_dim > 256 ? "head_dim " + std::to_string(head_dim) + " is not a multiple of 8 up to 256"
                                         : "");
  decide(&ExecutionModes::shared_experts_beside_dispatch, "shared_experts_beside_dispatch",
         r.model.moe.routed_experts == 0 || r.model.moe.shared_experts == 0 ? "no MoE layer with shared experts"
         : l.expert <= 1               ? "no expert parallelism (parallel.expert = 1)"
                                       : "");
  decide(&ExecutionModes::tokens_once_per_rank, "tokens_once_per_rank",
         r.model.moe.routed_experts == 0 ? "no MoE layer"
         : l.expert <= 1               ? "no expert parallelism (parallel.expert = 1)"
         : r.model.moe.top_k <= 1      ? "one choice per token (model.moe.top_k = 1)"
                                       : "");
  // The capture replays fixed shapes and addresses with no host work inside: every rule below is
  // something that would change between steps, read the device from the host, or talk to other ranks.
  const int64_t accumulation = micro_batches_per_step(r, l);
  decide(&ExecutionModes::cuda_graphs, "cuda_graphs",
         !gpu || !k.cuda                  ? "CPU ranks"
         : r.model.arch != ModelArch::DeepSeek ? "not a decoder"
         : l.world() != 1                 ? "several ranks (collectives inside backward)"
         : accumulation != 1              ? "more than one micro-batch a step"
         : !m.gradients_left_to_autograd  ? "gradients are not left to autograd (execution.gradients_left_to_autograd)"
         : r.precision.dtype != DType::Bf16 ? "only bf16 (fp16's loss scale is decided on the host)"
         : l.recomputation                ? "recomputation"
         : r.model.moe.routed_experts > 0 ? "MoE layers (routing decides shapes each step)"
         : r.data.separate_documents      ? "separate documents (each batch's document lengths)"
         : !r.hooks.script.empty()        ? "hooks read tensors between steps"
                                          : "");
  // FP8 routed experts quantise every local expert's weights each micro-batch, and four operands
  // of every routed row: `auto` takes them only where the products' saving is the larger.
  const auto forced_routed = r.execution.forced.find("fp8_routed_experts");
  const bool routed_forced_on = forced_routed != r.execution.forced.end() && forced_routed->second;
  const double rows_per_expert = routed_rows_per_expert(r, l);
  decide(&ExecutionModes::fp8_routed_experts, "fp8_routed_experts",
         r.precision.fp8 == Fp8Scaling::None ? "precision.fp8 = \"none\""
         : r.model.moe.routed_experts == 0 ? "no MoE layer"
         : !gpu || !k.fp8_grouped_products ? "this build has no grouped FP8 products (PyTorch 2.9 or later on CUDA: scripts/gpu_build.sh)"
         : r.model.hidden % 16 != 0 || r.model.moe.intermediate % 16 != 0 ? "model.hidden and model.moe.intermediate must be multiples of 16"
         : !routed_forced_on && fp8_routed_expert_gain_seconds(r, rows_per_expert, l.recomputation) <= 0
             ? "at about " + std::to_string(static_cast<int64_t>(rows_per_expert)) +
                   " rows an expert a micro-batch, quantising the experts' weights and rows costs more than their FP8 products save on this hardware "
                   "(hardware.fp8_grouped_matmul_efficiency against grouped_matmul_efficiency; true turns it on)"
             : "");
  return m;
}

double fp8_routed_expert_gain_seconds(const Recipe& r, double rows, bool recomputation) {
  const HardwareSpec& hw = r.hardware;
  if (hw.peak_flops_fp8 <= 0 || hw.memory_bandwidth <= 0) return -1;
  const double h = r.model.hidden, i = r.model.moe.intermediate;
  // Per row: forward's and the input gradients' products, 12·h·i FLOPs of the 18·h·i, against
  // quantising x, a, dy and dh (fp8_routed_row_bytes). Per expert: its 3·h·i
  // weights and their transposes (kFp8ExpertWeightBytes each). As Planner::fp8_routed_quantization_bytes.
  // Recomputation runs forward again: its products (6·h·i), its x and a, its weights' quantisation.
  const double again = recomputation ? 1 : 0;
  const double saved = (12 + 6 * again) * h * i * (1 / (hw.peak_flops_bf16 * hw.grouped_matmul_efficiency) - 1 / (hw.peak_flops_fp8 * hw.fp8_grouped_matmul_efficiency));
  const double rows_cost = fp8_routed_row_bytes(r, recomputation) / hw.memory_bandwidth;
  const double weights_cost = (1 + again) * kFp8ExpertWeightBytes * 3 * h * i / hw.memory_bandwidth;
  return rows * (saved - rows_cost) - weights_cost;
}

double fp8_routed_row_bytes(const Recipe& r, bool recomputation) {
  const double e = 2, h = r.model.hidden, i = r.model.moe.intermediate;  // bf16 (precision.fp8 needs it)
  return (e + 1) * (2 * h + 3 * i + (recomputation ? h + i : 0));
}

double routed_rows_per_expert(const Recipe& r, const Layout& l) {
  if (r.model.moe.routed_experts <= 0) return 0;
  return static_cast<double>(l.micro) * static_cast<double>(r.batch.seq_len) * r.model.moe.top_k * std::max(1, l.expert) / r.model.moe.routed_experts;
}

}  // namespace dsrun
