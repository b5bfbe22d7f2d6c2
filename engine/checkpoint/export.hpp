// Interchange with Hugging Face: dsrun's parameter names <-> Llama/DeepSeek tensor names (fused
// q/k/v and gate/up split by rows), config.json, and consolidating a sharded checkpoint into one
// safetensors file. No torch: `dsrun export` runs without it; ranks use the same name table to import.
#pragma once

#include "engine/recipe/recipe.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

// Rows [row_begin, row_begin + rows) of a dsrun parameter are the Hugging Face tensor `name`.
struct WeightPiece {
  std::string name;
  int64_t row_begin = 0, rows = 0;
  // A second copy of rows another piece already names (DeepSeek-V3 stores the embedding and the
  // head again inside each MTP layer): written on export, not read on import.
  bool copy = false;
};

// The Hugging Face tensors a dsrun parameter is made of (one piece for most; q/k/v and gate/up
// are fused here). ResNet parameters keep their dsrun names.
std::vector<WeightPiece> hf_pieces(const std::string& param, const std::vector<int64_t>& shape, const ModelSpec& spec);

// The Hugging Face name of a model buffer that is model state, "" for the others (BatchNorm's
// statistics stay per rank): the MoE selection bias is DeepSeek-V3's e_score_correction_bias.
std::string hf_buffer_name(const std::string& buffer, const ModelSpec& spec);

// config.json for the model: LlamaForCausalLM for dense decoders, DeepseekForCausalLM for MoE,
// DeepseekV3ForCausalLM for latent attention with a sigmoid router (or none), DeepseekV2ForCausalLM
// for latent attention with a softmax router.
std::string hf_config_json(const ModelSpec& spec, const std::string& torch_dtype);

struct ExportResult {
  std::string weights_path, config_path;
  int64_t tensors = 0, bytes = 0;
  int64_t step = 0;
};

// Consolidates the checkpoint in `checkpoint_dir` (verified first) into OUT/model.safetensors and
// OUT/config.json; dtype "fp32" (exact) or "bf16".
ExportResult export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& dtype);

}  // namespace dsrun
