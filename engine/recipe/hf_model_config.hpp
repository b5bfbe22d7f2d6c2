// A Hugging Face config.json (Llama, DeepSeek, DeepSeek-V2/V3) as a recipe's model section.
// Every key is either written as a model.* key, checked against what dsrun builds, or refused by name.
#pragma once

#include <string>
#include <vector>

namespace dsrun {

struct HfModelSection {
  std::string toml;                  // [model] and its sub-tables, ready to append to a recipe
  std::string model_type;            // config.json's model_type
  std::vector<std::string> ignored;  // keys read that change nothing in training (use_cache, bos_token_id, ...)
};

// Reads config_path (a config.json). Throws one Error listing every key dsrun cannot honour,
// each with its line and what to do.
HfModelSection model_section_from_hf_config(const std::string& config_path);

// The recipe key that a Hugging Face config name is copied into ("num_hidden_layers" ->
// "model.layers"), or nullptr: for "did you mean" on recipes written with Hugging Face's names.
const char* recipe_key_for_hf_name(const std::string& hf_name);

}  // namespace dsrun
