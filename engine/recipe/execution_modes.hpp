// How a step executes where the plan prices it and the engine must do the same: one torch-free
// value, decided once from the recipe, its layout and the build's kernels, pinned for the ranks.
#pragma once

#include "engine/common/build_kernels.hpp"
#include "engine/recipe/layout.hpp"
#include "engine/recipe/load.hpp"
#include "engine/recipe/recipe.hpp"

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

struct ExecutionModes {
  // Decoders: the output projection and the cross-entropy fused, this many tokens' logits at a
  // time (batch.loss_chunk_tokens, "auto" decided by the plan); 0: whole logits.
  int64_t loss_chunk_tokens = 0;
  bool loss_gradients_in_forward = false;   // that loss makes its gradients in forward (exact: one tensor rank, not fp16)
  bool step_applies_scales = false;         // the optimizer's step applies clip and unscale (torch's fused or dsrun's Adam)
  bool update_on_device = false;            // dsrun's Adam kernel reads the working gradients, writes the working parameters
  bool gradients_left_to_autograd = false;  // no gradient buffer: one GPU rank at ZeRO 0-2, updating on the device
  bool variable_length_attention = false;   // attention within documents by the variable-length kernel, not a mask
  bool shared_experts_beside_dispatch = false;  // expert parallelism: the shared experts run while the routed rows travel
  bool tokens_once_per_rank = false;            // expert parallelism: a token travels once to each rank its choices are on
  bool cuda_graphs = false;                     // the steady step's forward and backward replayed as one captured CUDA graph
  bool fp8_routed_experts = false;              // precision.fp8 for the routed experts' grouped products too
  // The dtype gradients are accumulated and reduced in (precision.grad_dtype, `auto` decided by
  // gradient_dtype_rule); fp32 beside a bf16/fp16 working dtype adds each micro-batch's gradient
  // into an fp32 buffer (Megatron-Core's main_grad).
  DType gradient_dtype = DType::Fp32;

  // The keys that pin these in a rank's config, beside the layout's (Layout::to_config_keys).
  std::vector<std::pair<std::string, Value>> to_config_keys() const;
  std::string describe() const;  // the modes on, in words, for the plan
  bool operator==(const ExecutionModes& o) const;
  bool operator!=(const ExecutionModes& o) const { return !(*this == o); }
};

// One row per on/off mode: its key under [execution] and its field. The schema, the recipe's
// reading, the pinned keys, the plan's words and the rank's check all loop over this table; a new
// mode is a field, a row, and its rule in decide_execution_modes.
struct ExecutionModeRow {
  const char* name;                 // execution.<name>
  bool ExecutionModes::*field;
  const char* words;                // as the plan says it is on
  const char* doc;                  // the schema's text
};
const std::array<ExecutionModeRow, 9>& execution_mode_rows();

// The kernels a plan assumes: this build's where it can run the recipe's device; for a GPU recipe
// planned by a build without CUDA (a laptop, a login node), those of dsrun's GPU build
// (scripts/gpu_build.sh), where the ranks will run.
BuildKernels planned_kernels(Device device, const BuildKernels& here);

// Rows an expert of a MoE layer gets in a micro-batch on average: every (token, choice) pair of the
// micro-batches of the expert-parallel group, spread over the routed experts.
double routed_rows_per_expert(const Recipe& recipe, const Layout& layout);
// The seconds of memory traffic quantising a routed expert parameter costs each micro-batch, in bytes
// at hardware.memory_bandwidth: 6 bytes move (its maximum read, then it read again and its two FP8
// copies written), but the MoE benchmark's steps on one H100 at 768, 1536 and 3072 rows an expert
// fit twice that (the maxima's atomics and the transposed writes; docs/benchmarks.md, 2026-11-28).
constexpr double kFp8ExpertWeightBytes = 12;
// Bytes quantising one routed row's four operands moves in a micro-batch (x and dy h wide, a i, dh
// 2·i; e + 1 bytes an element in one pass), forward's x and a again with recomputation. The plan's
// total and `auto`'s rule both price with these two.
double fp8_routed_row_bytes(const Recipe& recipe, bool recomputation);
// execution.fp8_routed_experts' `auto`, from the recipe's hardware figures: the seconds an expert's
// FP8 products save at `rows` rows, less its rows' and its weights' quantisation (negative: a loss).
double fp8_routed_expert_gain_seconds(const Recipe& recipe, double rows, bool recomputation = false);

// A mode the recipe (or the launcher's pin) set true that its rule refuses here, and why.
struct RefusedMode {
  std::string name;  // ExecutionModeRow::name
  std::string why;
  std::string describe() const { return "execution." + name + " = true does not hold here: " + why; }
};

// precision.grad_dtype as the plan decides it, and why in words: the recipe's, or `auto`'s rule
// (fp32 wherever a bf16/fp16 gradient would be summed: more than one micro-batch a step or more
// than one data rank; else the working dtype, with nothing to sum).
std::pair<DType, std::string> gradient_dtype_rule(const Recipe& recipe, const Layout& layout);
// The recipe with precision.grad_dtype pinned to the working dtype, where `auto` may widen it
// (bf16/fp16, grad_dtype left to auto); nullopt otherwise. The plan falls back to it where fp32
// gradients keep every layout from fitting (make_plan, search_layouts).
std::optional<Recipe> recipe_with_working_gradients(const Recipe& recipe);

// Every mode on where its rule allows and execution.<name> is not false. `refused`, when given,
// gets each mode set true that does not hold here (the plan notes it, a rank refuses it; the rule wins).
ExecutionModes decide_execution_modes(const Recipe& recipe, const Layout& layout, int64_t loss_chunk_tokens, const BuildKernels& kernels,
                                      std::vector<RefusedMode>* refused = nullptr);

}  // namespace dsrun
