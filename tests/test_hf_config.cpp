// Hugging Face config.json -> recipe model section (dsrun init --from-hf): the models dsrun
// exports come back unchanged, DeepSeek's released configs read as their templates, the rest is refused by name.
#include "engine/checkpoint/export.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/hf_model_config.hpp"
#include "engine/recipe/load.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

using namespace dsrun;
using dsrun::test::contains;
using dsrun::test::error_of;
using dsrun::test::load_text;
using dsrun::test::TempDir;

namespace {

// config.json in a checkpoint directory named `name`.
std::string write_config(TempDir& dir, const std::string& name, const std::string& json) {
  make_directories(dir.file(name));
  write_file_atomic(dir.file(name + "/config.json"), json);
  return dir.file(name + "/config.json");
}

LoadedRecipe recipe_with_model(const std::string& section) { return load_text("base = [\"hardware/cpu\"]\n" + section); }

// The resolved model.* settings of two recipes that differ, as "key: a | b" lines.
std::vector<std::string> model_differences(const LoadedRecipe& a, const LoadedRecipe& b, const std::vector<std::string>& skipped) {
  std::vector<std::string> out;
  for (const auto& [key, setting] : a.config) {
    if (key.rfind("model.", 0) != 0 || std::find(skipped.begin(), skipped.end(), key) != skipped.end()) continue;
    const Value &mine = setting.value, &theirs = b.config.at(key).value;
    const auto numeric = [](const Value& v) { return v.kind == Value::Kind::Int || v.kind == Value::Kind::Float; };
    const auto text = [&](const Value& v) { return numeric(v) ? format_double(v.number()) : v.toml(); };
    if (numeric(mine) && numeric(theirs) ? mine.number() != theirs.number() : mine.toml() != theirs.toml())
      out.push_back(key + ": " + text(mine) + " | " + text(theirs));
  }
  return out;
}

// DeepSeek-V3's config.json as released (deepseek-ai/DeepSeek-V3).
const char* const kDeepSeekV3Config = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config", "AutoModel": "modeling_deepseek.DeepseekV3Model",
               "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})";

// DeepSeek-V2-Lite's (deepseek-ai/DeepSeek-V2-Lite): no query latent, softmax, greedy top-6.
const char* const kDeepSeekV2LiteConfig = R"({
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.39.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
})";

}  // namespace

TEST_CASE("every decoder template's exported config.json reads back as the same model", "[recipe][hf]") {
  TempDir dir;
  for (const std::string model : {"deepseek-tiny", "deepseek-tiny-gqa", "deepseek-moe-tiny", "deepseek-moe-16b", "deepseek-llm-7b", "deepseek-v3-tiny",
                                  "deepseek-v2-lite", "deepseek-v3"}) {
    INFO(model);
    const LoadedRecipe original = load_text("base = [\"hardware/cpu\", \"models/" + model + "\"]\n");
    REQUIRE(original.ok());
    const std::string path = write_config(dir, model, hf_config_json(original.recipe.model, "float32"));
    const HfModelSection section = model_section_from_hf_config(path);
    INFO(section.toml);
    const LoadedRecipe back = recipe_with_model(section.toml);
    INFO(back.report());
    REQUIRE(back.ok());
    CHECK(back.recipe.model.name == model);  // the checkpoint directory's name
    // What config.json cannot hold: the V3 selection bias's update rate and MTP's loss weight
    // are training settings; capacity and fixed route biases are dsrun's own.
    CHECK(model_differences(original, back, {"model.moe.bias_update_rate", "model.mtp.loss_weight", "model.moe.capacity_factor"}) == std::vector<std::string>{});
  }
}

TEST_CASE("DeepSeek-V3's and V2-Lite's released config.json read as their templates", "[recipe][hf]") {
  TempDir dir;
  const HfModelSection v3 = model_section_from_hf_config(write_config(dir, "DeepSeek-V3", kDeepSeekV3Config));
  INFO(v3.toml);
  const LoadedRecipe v3_recipe = recipe_with_model(v3.toml);
  INFO(v3_recipe.report());
  REQUIRE(v3_recipe.ok());
  const LoadedRecipe v3_template = load_text("base = [\"hardware/cpu\", \"models/deepseek-v3\"]\n");
  // The released config weighs the sequence-wise loss 0.001 (the report: 0.0001); the template
  // takes the report's. The name is the directory's.
  CHECK(model_differences(v3_template, v3_recipe, {"model.name", "model.mtp.loss_weight"}) ==
        std::vector<std::string>{"model.moe.seq_aux_loss_weight: 0.0001 | 0.001"});
  CHECK(v3.model_type == "deepseek_v3");
  for (const char* inference_only : {"ep_size", "use_cache", "bos_token_id", "torch_dtype", "auto_map"})
    CHECK(std::find(v3.ignored.begin(), v3.ignored.end(), inference_only) != v3.ignored.end());

  const HfModelSection lite = model_section_from_hf_config(write_config(dir, "DeepSeek-V2-Lite", kDeepSeekV2LiteConfig));
  const LoadedRecipe lite_recipe = recipe_with_model(lite.toml);
  REQUIRE(lite_recipe.ok());
  const LoadedRecipe lite_template = load_text("base = [\"hardware/cpu\", \"models/deepseek-v2-lite\"]\n");
  // V2's seq_aux: its one weight is the sequence-wise loss's (the template keeps DeepSeek-MoE's batch-wise one).
  CHECK(model_differences(lite_template, lite_recipe, {"model.name"}) ==
        std::vector<std::string>{"model.moe.aux_loss_weight: 0.001 | 0", "model.moe.seq_aux_loss_weight: 0 | 0.001"});
  CHECK(lite_recipe.recipe.model.mla.q_lora_rank == 0);  // null: a full query projection
}

TEST_CASE("config.json keys dsrun cannot honour are refused by name and line, all at once", "[recipe][hf][errors]") {
  TempDir dir;
  const std::string path = write_config(dir, "odd", R"({
  "model_type": "deepseek_v2",
  "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
  "vocab_size": 1000, "max_position_embeddings": 1024,
  "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
  "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "scoring_func": "softmax",
  "hidden_act": "gelu",
  "attention_bias": true,
  "topk_method": "noaux_tc",
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
  "sliding_window_pattern": 4
})");
  const std::string error = error_of([&] { model_section_from_hf_config(path); });
  INFO(error);
  CHECK(contains(error, "5 keys dsrun cannot honour"));
  CHECK(contains(error, path + ":7: hidden_act = \"gelu\": dsrun's feed-forward layers are SwiGLU"));
  CHECK(contains(error, path + ":8: attention_bias = true"));
  CHECK(contains(error, "topk_method = \"noaux_tc\" with scoring_func = \"softmax\""));
  CHECK(contains(error, "rope_scaling has rope_type \"llama3\""));
  CHECK(contains(error, path + ":11: sliding_window_pattern = 4: dsrun does not know what this key changes"));

  const std::string qwen = write_config(dir, "qwen", R"({"model_type": "qwen2", "hidden_size": 64})");
  CHECK(contains(error_of([&] { model_section_from_hf_config(qwen); }), "model_type = \"qwen2\": dsrun builds llama, deepseek"));
  const std::string broken = write_config(dir, "broken", "{\"model_type\": ");
  CHECK(contains(error_of([&] { model_section_from_hf_config(broken); }), "not JSON"));
  // A value the recipe's own rules refuse is caught where the recipe is loaded: 64 experts in 3 groups.
  std::string v3 = kDeepSeekV3Config;
  v3.replace(v3.find("\"n_group\": 8"), 12, "\"n_group\": 3");
  const LoadedRecipe grouped = recipe_with_model(model_section_from_hf_config(write_config(dir, "v3", v3)).toml);
  CHECK(contains(grouped.report(), "model.moe.n_group"));
}

TEST_CASE("transformers 5's rope_parameters carry rope_theta and YaRN's settings", "[recipe][hf]") {
  TempDir dir;
  std::string json = kDeepSeekV2LiteConfig;
  json.replace(json.find("\"rope_scaling\""), json.find("\"rope_theta\": 10000,") + 20 - json.find("\"rope_scaling\""),
               "\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 50000.0, \"factor\": 40.0, \"original_max_position_embeddings\": 4096,"
               " \"beta_fast\": 32.0, \"beta_slow\": 1.0, \"mscale\": 0.707, \"mscale_all_dim\": 0.707, \"truncate\": true},");
  const LoadedRecipe r = recipe_with_model(model_section_from_hf_config(write_config(dir, "v5", json)).toml);
  INFO(r.report());
  REQUIRE(r.ok());
  CHECK(r.recipe.model.rope_theta == 50000.0);
  CHECK(r.recipe.model.rope_scaling.kind == RopeScalingKind::Yarn);
  CHECK(r.recipe.model.rope_scaling.mscale == Approx(0.707));
}

TEST_CASE("transformers 5's DeepseekV3 config.json (no router keys: sigmoid, the bias within groups) reads as that model", "[recipe][hf]") {
  TempDir dir;
  // save_pretrained of bench/hf_deepseek_v3_check.py's model by transformers 5.17 on the GPU machine.
  const std::string path = write_config(dir, "hf", R"({
  "architectures": [
    "DeepseekV3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 0,
  "dtype": "float32",
  "eos_token_id": 1,
  "first_k_dense_replace": 1,
  "head_dim": 16,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.05,
  "intermediate_size": 96,
  "kv_lora_rank": 32,
  "max_position_embeddings": 256,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 32,
  "n_group": 4,
  "n_routed_experts": 8,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 4,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 3,
  "num_key_value_heads": 4,
  "num_nextn_predict_layers": 1,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "q_lora_rank": 48,
  "qk_head_dim": 48,
  "qk_nope_head_dim": 32,
  "qk_rope_head_dim": 16,
  "rms_norm_eps": 1e-06,
  "rope_interleave": true,
  "rope_parameters": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "rope_type": "yarn",
    "type": "yarn"
  },
  "routed_scaling_factor": 2.5,
  "tie_word_embeddings": false,
  "topk_group": 2,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "v_head_dim": 32,
  "vocab_size": 256
})");
  const HfModelSection section = model_section_from_hf_config(path);
  INFO(section.toml);
  const LoadedRecipe r = recipe_with_model(section.toml);
  INFO(r.report());
  REQUIRE(r.ok());
  const ModelSpec& m = r.recipe.model;
  CHECK(m.moe.scoring == RouterScore::Sigmoid);
  CHECK(m.moe.learns_bias());
  CHECK(m.moe.n_group == 4);
  CHECK(m.moe.topk_group == 2);
  CHECK(m.moe.norm_topk_prob);
  CHECK(m.moe.routed_scaling_factor == 2.5);
  CHECK(m.moe.seq_aux_loss_weight == 0);  // transformers' V3 computes no balance loss
  CHECK(m.mla.q_lora_rank == 48);
  CHECK(m.rope_scaling.kind == RopeScalingKind::Yarn);
  CHECK(m.rope_scaling.mscale_all_dim == Approx(0.8));
  CHECK(m.rope_scaling.original_max_position_embeddings == 64);
  CHECK(m.mtp.depth == 1);
  CHECK(m.init_std == Approx(0.05));
  for (const char* no_effect : {"dtype", "pad_token_id", "use_cache"})
    CHECK(std::find(section.ignored.begin(), section.ignored.end(), no_effect) != section.ignored.end());
}

