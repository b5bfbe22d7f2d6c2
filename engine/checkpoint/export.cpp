#include "engine/checkpoint/export.hpp"

#include "engine/checkpoint/checkpoint.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/load.hpp"

#include <nlohmann/json.hpp>

#include <cstring>

namespace dsrun {

namespace {

// "<prefix><n>.<rest>" -> n and rest ("block12.attn.wqkv.weight" -> 12, "attn.wqkv.weight" for
// prefix "block"; "mtp0.block.attn.wo.weight" -> 0, "block.attn.wo.weight" for "mtp"); false
// for names of another form.
bool split_numbered_name(const std::string& name, const std::string& prefix, int& number, std::string& rest) {
  if (!starts_with(name, prefix)) return false;
  size_t dot = name.find('.');
  if (dot == std::string::npos || dot == prefix.size()) return false;
  number = std::atoi(name.substr(prefix.size(), dot - prefix.size()).c_str());
  rest = name.substr(dot + 1);
  return true;
}

// gate_up (2 x inner rows) -> gate_proj, up_proj; down -> down_proj; under `prefix`.
std::vector<WeightPiece> swiglu_pieces(const std::string& prefix, const std::string& leaf, int64_t rows) {
  if (leaf == "gate_up.weight") return {{prefix + "gate_proj.weight", 0, rows / 2}, {prefix + "up_proj.weight", rows / 2, rows / 2}};
  if (leaf == "down.weight") return {{prefix + "down_proj.weight", 0, rows}};
  return {};
}

// One block's parameter (its name inside the block) under the Hugging Face prefix `p`
// ("model.layers.N."): Llama/DeepSeek names, and DeepSeek-V2/V3's for latent attention.
std::vector<WeightPiece> block_pieces(const std::string& p, const std::string& rest, int64_t rows, const ModelSpec& spec) {
  static const std::pair<const char*, const char*> same_rows[] = {
      {"attn_norm.weight", "input_layernorm.weight"},          {"mlp_norm.weight", "post_attention_layernorm.weight"},
      {"attn.wo.weight", "self_attn.o_proj.weight"},           {"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
      {"attn.q_norm.weight", "self_attn.q_a_layernorm.weight"}, {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
      {"attn.wq.weight", "self_attn.q_proj.weight"},           {"attn.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
      {"attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"}, {"attn.wkv_b.weight", "self_attn.kv_b_proj.weight"},
      {"moe.router.weight", "mlp.gate.weight"}};
  for (const auto& [ours, theirs] : same_rows)
    if (rest == ours) return {{p + theirs, 0, rows}};
  if (rest == "attn.wqkv.weight") {
    const int64_t q = static_cast<int64_t>(spec.heads) * spec.head_dim(), kv = static_cast<int64_t>(spec.kv_heads) * spec.head_dim();
    return {{p + "self_attn.q_proj.weight", 0, q}, {p + "self_attn.k_proj.weight", q, kv}, {p + "self_attn.v_proj.weight", q + kv, kv}};
  }
  if (starts_with(rest, "mlp.")) return swiglu_pieces(p + "mlp.", rest.substr(4), rows);
  if (starts_with(rest, "moe.shared.")) return swiglu_pieces(p + "mlp.shared_experts.", rest.substr(11), rows);
  if (starts_with(rest, "moe.expert")) {
    size_t dot = rest.find('.', 10);
    if (dot != std::string::npos) return swiglu_pieces(p + "mlp.experts." + rest.substr(10, dot - 10) + ".", rest.substr(dot + 1), rows);
  }
  return {};
}

// MTP module k's Hugging Face prefix: DeepSeek-V3 stores it as the layer after the last block.
std::string mtp_prefix(const ModelSpec& spec, int depth) { return "model.layers." + std::to_string(spec.layers + depth) + "."; }

}  // namespace

std::vector<WeightPiece> hf_pieces(const std::string& param, const std::vector<int64_t>& shape, const ModelSpec& spec) {
  const int64_t rows = shape.empty() ? 1 : shape[0];
  if (spec.arch == ModelArch::ResNet) return {{param, 0, rows}};
  // The embedding and the head, and their copies in the MTP layers (which share them).
  auto with_mtp_copies = [&](const std::string& name, const std::string& mtp_leaf) {
    std::vector<WeightPiece> pieces{{name, 0, rows}};
    for (int k = 0; k < spec.mtp.depth; ++k) pieces.push_back({mtp_prefix(spec, k) + mtp_leaf, 0, rows, /*copy=*/true});
    return pieces;
  };
  if (param == "embedding.weight") {
    std::vector<WeightPiece> pieces = with_mtp_copies("model.embed_tokens.weight", "embed_tokens.weight");
    if (spec.tie_embeddings)  // the head is this weight too
      for (int k = 0; k < spec.mtp.depth; ++k) pieces.push_back({mtp_prefix(spec, k) + "shared_head.head.weight", 0, rows, true});
    return pieces;
  }
  if (param == "norm.weight") return {{"model.norm.weight", 0, rows}};
  if (param == "head.weight") return with_mtp_copies("lm_head.weight", "shared_head.head.weight");
  int layer = 0;
  std::string rest;
  if (split_numbered_name(param, "mtp", layer, rest)) {
    const std::string p = mtp_prefix(spec, layer);
    if (rest == "enorm.weight" || rest == "hnorm.weight" || rest == "eh_proj.weight") return {{p + rest, 0, rows}};
    if (rest == "norm.weight") return {{p + "shared_head.norm.weight", 0, rows}};
    if (starts_with(rest, "block.")) {
      std::vector<WeightPiece> pieces = block_pieces(p, rest.substr(6), rows, spec);
      if (!pieces.empty()) return pieces;
    }
  }
  if (split_numbered_name(param, "block", layer, rest)) {
    std::vector<WeightPiece> pieces = block_pieces("model.layers." + std::to_string(layer) + ".", rest, rows, spec);
    if (!pieces.empty()) return pieces;
  }
  fail_at(__FILE__, __LINE__, "no Hugging Face name for parameter " + param);
}

std::string hf_buffer_name(const std::string& buffer, const ModelSpec& spec) {
  int layer = 0;
  std::string rest;
  if (split_numbered_name(buffer, "block", layer, rest) && rest == "moe.expert_bias") return "model.layers." + std::to_string(layer) + ".mlp.gate.e_score_correction_bias";
  if (split_numbered_name(buffer, "mtp", layer, rest) && rest == "block.moe.expert_bias") return mtp_prefix(spec, layer) + "mlp.gate.e_score_correction_bias";
  return "";
}

// DeepSeek-V2/V3's config.json (transformers' DeepseekV2Config / DeepseekV3Config): V3 where the
// router is sigmoid (or there is none), V2 where it is softmax. MoE layers follow the dense ones.
std::string deepseek_v2_v3_config(const ModelSpec& m, const std::string& torch_dtype) {
  const bool moe = m.moe.enabled(), v3 = !moe || m.moe.scoring == RouterScore::Sigmoid;
  nlohmann::ordered_json j;
  j["architectures"] = {v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"};
  j["model_type"] = v3 ? "deepseek_v3" : "deepseek_v2";
  j["vocab_size"] = m.vocab;
  j["hidden_size"] = m.hidden;
  j["intermediate_size"] = m.intermediate;
  j["moe_intermediate_size"] = moe ? m.moe.intermediate : m.intermediate;
  j["num_hidden_layers"] = m.layers;
  j["num_attention_heads"] = m.heads;
  j["num_key_value_heads"] = m.heads;
  j["n_shared_experts"] = moe ? m.moe.shared_experts : 0;
  j["n_routed_experts"] = moe ? m.moe.routed_experts : 0;
  j["num_experts_per_tok"] = moe ? m.moe.top_k : 0;
  j["first_k_dense_replace"] = moe ? m.moe.first_dense_layers : m.layers;
  j["moe_layer_freq"] = 1;
  j["n_group"] = m.moe.n_group;
  j["topk_group"] = m.moe.topk_group;
  j["norm_topk_prob"] = m.moe.norm_topk_prob;
  j["routed_scaling_factor"] = m.moe.routed_scaling_factor;
  j["scoring_func"] = v3 ? "sigmoid" : "softmax";
  j["topk_method"] = v3 ? "noaux_tc" : m.moe.n_group > 1 ? "group_limited_greedy" : "greedy";
  // One weight, of the sequence-wise loss with seq_aux, else of the batch-wise one.
  const bool per_sequence = m.moe.seq_aux_loss_weight > 0;
  j["aux_loss_alpha"] = per_sequence ? m.moe.seq_aux_loss_weight : moe && !m.moe.learns_bias() ? m.moe.aux_loss_weight : 0.0;
  j["seq_aux"] = per_sequence;
  if (m.mla.q_lora_rank > 0) j["q_lora_rank"] = m.mla.q_lora_rank;
  else j["q_lora_rank"] = nullptr;
  j["kv_lora_rank"] = m.mla.kv_lora_rank;
  j["qk_nope_head_dim"] = m.mla.qk_nope_head_dim;
  j["qk_rope_head_dim"] = m.mla.qk_rope_head_dim;
  j["v_head_dim"] = m.mla.v_head_dim;
  j["head_dim"] = m.mla.qk_rope_head_dim;  // transformers' rotary tables are this wide
  j["rope_interleave"] = true;             // the rotary pairs are (2i, 2i+1), as DeepSeek released them
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = m.max_seq_len;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  if (m.rope_scaling.kind == RopeScalingKind::Yarn) {
    const RopeScaling& y = m.rope_scaling;
    j["rope_scaling"] = {{"type", "yarn"}, {"rope_type", "yarn"}, {"factor", y.factor}, {"original_max_position_embeddings", y.original_max_position_embeddings},
                         {"beta_fast", y.beta_fast}, {"beta_slow", y.beta_slow}, {"mscale", y.mscale}, {"mscale_all_dim", y.mscale_all_dim}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["attention_bias"] = false;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["initializer_range"] = m.init_std;
  j["num_nextn_predict_layers"] = m.mtp.depth;
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

std::string hf_config_json(const ModelSpec& m, const std::string& torch_dtype) {
  nlohmann::ordered_json j;
  if (m.arch == ModelArch::ResNet) {
    j["architectures"] = {"ResNet"};
    j["model_type"] = "dsrun-resnet";
    j["depth"] = m.resnet.depth;
    j["width"] = m.resnet.width;
    j["num_labels"] = m.resnet.classes;
    j["image_size"] = m.resnet.image_size;
    j["torch_dtype"] = torch_dtype;
    return j.dump(2) + "\n";
  }
  if (m.latent_attention()) return deepseek_v2_v3_config(m, torch_dtype);
  const bool moe = m.moe.enabled();
  j["architectures"] = {moe ? "DeepseekForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = moe ? "deepseek" : "llama";
  j["hidden_size"] = m.hidden;
  j["intermediate_size"] = m.intermediate;
  j["num_hidden_layers"] = m.layers;
  j["num_attention_heads"] = m.heads;
  j["num_key_value_heads"] = m.kv_heads;
  j["vocab_size"] = m.vocab;
  j["max_position_embeddings"] = m.max_seq_len;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["initializer_range"] = m.init_std;
  j["attention_bias"] = false;
  if (moe) {
    j["n_routed_experts"] = m.moe.routed_experts;
    j["n_shared_experts"] = m.moe.shared_experts;
    j["num_experts_per_tok"] = m.moe.top_k;
    j["moe_intermediate_size"] = m.moe.intermediate;
    j["first_k_dense_replace"] = m.moe.first_dense_layers;
    j["moe_layer_freq"] = 1;
    j["norm_topk_prob"] = false;
    j["scoring_func"] = "softmax";
    j["aux_loss_alpha"] = m.moe.seq_aux_loss_weight > 0 ? m.moe.seq_aux_loss_weight : m.moe.aux_loss_weight;
    j["seq_aux"] = m.moe.seq_aux_loss_weight > 0;
  }
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

ExportResult export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& dtype) {
  if (dtype != "fp32" && dtype != "bf16") {
    ErrorContext c;
    c.key = "--dtype";
    c.hint = "use fp32 (exact) or bf16 (half the size)";
    throw Error("cannot export as \"" + dtype + "\"", c);
  }
  CheckpointManifest manifest = read_checkpoint(checkpoint_dir, /*verify_files=*/true);
  LoadOptions options;
  options.host = read_host_facts();
  LoadedRecipe loaded = load_recipe_text(manifest.config_toml, path_join(checkpoint_dir, kManifestFile), options);
  require_valid(loaded);
  const ModelSpec& spec = loaded.recipe.model;
  auto reader = std::make_shared<CheckpointReader>(checkpoint_dir, manifest);
  const CheckpointManifest& stored = reader->manifest();
  const bool bf16 = dtype == "bf16";
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  writer.set_metadata("dsrun.run_id", manifest.run_id);
  writer.set_metadata("dsrun.step", std::to_string(manifest.step));
  ExportResult result;
  for (const StoredParam& p : stored.params) {
    int64_t row_elements = 1;
    for (size_t d = 1; d < p.shape.size(); ++d) row_elements *= p.shape[d];
    for (const auto& piece : hf_pieces(p.name, p.shape, spec)) {
      std::vector<int64_t> shape = p.shape;
      if (!shape.empty()) shape[0] = piece.rows;
      const int64_t first = piece.row_begin * row_elements, count = piece.rows * row_elements;
      const StoredParam* param = &p;  // the manifest lives in the reader, which the writer keeps alive
      writer.add(piece.name, bf16 ? "BF16" : "F32", shape, [reader, param, first, count, bf16](char* out) {
        std::vector<float> values(static_cast<size_t>(count));
        reader->read(*param, "master", TensorRegion{}, first, first + count, values.data());
        if (!bf16) {
          std::memcpy(out, values.data(), values.size() * 4);
          return;
        }
        for (size_t i = 0; i < values.size(); ++i) {
          uint16_t h = float_to_bf16(values[i]);
          std::memcpy(out + 2 * i, &h, 2);
        }
      });
      ++result.tensors;
    }
  }
  // Buffers that are model state: every rank holds the same values, rank 0's are written.
  const SafetensorsFile& rank0 = reader->rank_file(0);
  for (const SafetensorsEntry& e : rank0.entries()) {
    if (!starts_with(e.name, "buffer.")) continue;
    const std::string name = hf_buffer_name(e.name.substr(7), spec);
    if (name.empty()) continue;
    const SafetensorsFile* file = &rank0;
    const SafetensorsEntry* entry = &e;
    writer.add(name, "F32", e.shape, [reader, file, entry](char* out) {  // fp32 in either dtype: the bias moves by steps of 1e-3
      std::vector<float> values = file->read_f32(*entry, 0, entry->numel());
      std::memcpy(out, values.data(), values.size() * 4);
    });
    ++result.tensors;
  }
  make_directories(out_dir);
  result.weights_path = path_join(out_dir, "model.safetensors");
  result.config_path = path_join(out_dir, "config.json");
  result.bytes = static_cast<int64_t>(writer.write_atomic(result.weights_path).bytes);
  write_file_atomic(result.config_path, hf_config_json(spec, bf16 ? "bfloat16" : "float32"));
  result.step = manifest.step;
  return result;
}

}  // namespace dsrun
