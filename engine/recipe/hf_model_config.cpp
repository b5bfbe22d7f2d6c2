// Hugging Face config.json -> recipe model keys. The key names and meanings follow transformers'
// LlamaConfig, DeepseekV2Config and DeepseekV3Config and DeepSeek's own remote-code configs.
#include "engine/recipe/hf_model_config.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/load.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

namespace dsrun {
namespace {

using Json = nlohmann::json;

// Keys whose value becomes one recipe key unchanged (null handled by the reader).
constexpr std::pair<const char*, const char*> kCopiedKeys[] = {
    {"vocab_size", "model.vocab"},
    {"hidden_size", "model.hidden"},
    {"intermediate_size", "model.intermediate"},
    {"num_hidden_layers", "model.layers"},
    {"num_attention_heads", "model.heads"},
    {"num_key_value_heads", "model.kv_heads"},
    {"max_position_embeddings", "model.max_seq_len"},
    {"rms_norm_eps", "model.norm_eps"},
    {"rope_theta", "model.rope_theta"},
    {"tie_word_embeddings", "model.tie_embeddings"},
    {"initializer_range", "model.init_std"},
    {"n_routed_experts", "model.moe.routed_experts"},
    {"n_shared_experts", "model.moe.shared_experts"},
    {"num_experts_per_tok", "model.moe.top_k"},
    {"moe_intermediate_size", "model.moe.intermediate"},
    {"first_k_dense_replace", "model.moe.first_dense_layers"},
    {"n_group", "model.moe.n_group"},
    {"topk_group", "model.moe.topk_group"},
    {"norm_topk_prob", "model.moe.norm_topk_prob"},
    {"routed_scaling_factor", "model.moe.routed_scaling_factor"},
    {"scoring_func", "model.moe.scoring_func"},
    {"q_lora_rank", "model.mla.q_lora_rank"},
    {"kv_lora_rank", "model.mla.kv_lora_rank"},
    {"qk_nope_head_dim", "model.mla.qk_nope_head_dim"},
    {"qk_rope_head_dim", "model.mla.qk_rope_head_dim"},
    {"v_head_dim", "model.mla.v_head_dim"},
    {"num_nextn_predict_layers", "model.mtp.depth"},
};

// Keys that describe the checkpoint file, the tokenizer or inference: read, and without effect
// on what is trained.
constexpr const char* kNoEffectKeys[] = {
    "architectures", "auto_map", "_name_or_path", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "ep_size", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "output_router_logits", "id2label", "label2id",
};

// One recipe table's keys, in the order they are written.
struct Table {
  std::string name;
  std::vector<std::pair<std::string, Value>> keys;
};

// The config.json being read: which keys were used, and what was refused (with its line).
class ConfigReader {
 public:
  explicit ConfigReader(std::string path) : path_(std::move(path)), text_(read_file(path_)) {
    try {
      json_ = Json::parse(text_);
    } catch (const Json::parse_error& e) {
      ErrorContext c;
      c.file = path_;
      c.hint = "give the config.json that transformers' save_pretrained wrote";
      throw Error(std::string("not JSON: ") + e.what(), c);
    }
    if (!json_.is_object()) {
      ErrorContext c;
      c.file = path_;
      throw Error("a config.json holds one JSON object", c);
    }
  }

  bool has(const std::string& key) const { return json_.contains(key) && !json_.at(key).is_null(); }
  // Marks key as read; null when absent.
  const Json& use(const std::string& key) {
    used_.insert(key);
    static const Json null_value;
    return json_.contains(key) ? json_.at(key) : null_value;
  }

  int64_t integer(const std::string& key, int64_t fallback) { return typed(key, fallback, &Json::is_number_integer, "an integer", "write a whole number"); }
  double number(const std::string& key, double fallback) { return typed(key, fallback, &Json::is_number, "a number", "write a number"); }
  bool boolean(const std::string& key, bool fallback) { return typed(key, fallback, &Json::is_boolean, "true or false", "write true or false"); }
  std::string string(const std::string& key, const std::string& fallback) { return typed(key, fallback, &Json::is_string, "a string", "write a string"); }
  int64_t required_integer(const std::string& key) {
    if (!has(key)) refuse(key, "is missing", "a " + model_type + " config.json has it; check that this is the model's config.json");
    return integer(key, 0);
  }
  // A key dsrun builds only with one value: absent, null or that value are fine.
  void expect(const std::string& key, const Json& value, const std::string& why) {
    const Json& v = use(key);
    if (!v.is_null() && v != value) refuse(key, "= " + v.dump() + ": " + why, "dsrun builds " + key + " = " + value.dump() + " only");
  }

  void refuse(const std::string& key, const std::string& message, const std::string& fix) {
    used_.insert(key);
    problems_.push_back({key, message, fix});
  }

  // Every key not read is refused: dsrun does not know what it changes.
  void refuse_unread() {
    for (const auto& item : json_.items())
      if (!used_.count(item.key()))
        problems_.push_back({item.key(), "= " + item.value().dump() + ": dsrun does not know what this key changes in the model",
                             "if it changes nothing in training (a tokenizer or inference setting), delete it from a copy of config.json"});
  }

  // Throws one Error listing every refusal, each with its line in the file.
  void throw_if_refused() const {
    if (problems_.empty()) return;
    std::string message = std::to_string(problems_.size()) + (problems_.size() == 1 ? " key" : " keys") + " dsrun cannot honour:";
    for (const auto& p : problems_)
      message += "\n  " + path_ + ":" + std::to_string(line_of(p.key)) + ": " + p.key + " " + p.message + "\n      fix: " + p.fix;
    ErrorContext c;
    c.file = path_;
    c.line = line_of(problems_.front().key);
    c.key = problems_.front().key;
    c.hint = "dsrun init --from-hf writes a recipe only for a model it can train exactly";
    throw Error(message, c);
  }

  std::vector<std::string> no_effect_keys_present() {
    std::vector<std::string> out;
    for (const char* key : kNoEffectKeys)
      if (json_.contains(key)) {
        used_.insert(key);
        out.push_back(key);
      }
    return out;
  }

  std::string model_type;

 private:
  // key's value as T; absent or null: fallback; another type: refused, and fallback.
  template <typename T>
  T typed(const std::string& key, T fallback, bool (Json::*is)() const noexcept, const char* what, const char* fix) {
    const Json& v = use(key);
    if (v.is_null()) return fallback;
    if ((v.*is)()) return v.get<T>();
    refuse(key, "is " + v.dump() + ", not " + what, fix);
    return fallback;
  }

  struct Problem {
    std::string key, message, fix;
  };
  // The line of `"key":` in the text (the first one; nested keys are named "outer.inner").
  int line_of(const std::string& dotted) const {
    const std::string leaf = dotted.substr(dotted.rfind('.') == std::string::npos ? 0 : dotted.rfind('.') + 1);
    size_t at = text_.find("\"" + leaf + "\"");
    if (at == std::string::npos) return 1;
    return 1 + static_cast<int>(std::count(text_.begin(), text_.begin() + static_cast<std::ptrdiff_t>(at), '\n'));
  }

  std::string path_, text_;
  Json json_;
  std::set<std::string> used_;
  std::vector<Problem> problems_;
};

void put_in(std::vector<Table>& tables, const std::string& table, const std::string& leaf, Value v) {
  auto it = std::find_if(tables.begin(), tables.end(), [&](const Table& t) { return t.name == table; });
  if (it == tables.end()) it = tables.insert(tables.end(), Table{table, {}});
  it->keys.emplace_back(leaf, std::move(v));
}

// Writes the value of a copied Hugging Face key under its recipe key.
void put(std::vector<Table>& tables, const std::string& hf_name, Value v) {
  const char* key = recipe_key_for_hf_name(hf_name);
  DSRUN_ASSERT(key != nullptr, hf_name + " is not in kCopiedKeys");
  const std::string k = key;
  put_in(tables, k.substr(0, k.rfind('.')), k.substr(k.rfind('.') + 1), std::move(v));
}

// rope_scaling (transformers 4) or rope_parameters (transformers 5, with rope_theta inside).
void read_rope(ConfigReader& r, std::vector<Table>& tables, double& rope_theta) {
  const std::string name = r.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  const Json rope = r.use(name);
  r.use(name == "rope_parameters" ? "rope_scaling" : "rope_parameters");  // (the other, null or absent, is read too)
  if (rope.is_null()) return;
  if (!rope.is_object()) return r.refuse(name, "is " + rope.dump() + ", not an object", "write null or an object with rope_type");
  std::set<std::string> known;
  auto get = [&](const char* k) -> Json {
    known.insert(k);
    return rope.contains(k) ? rope.at(k) : Json();
  };
  if (get("rope_theta").is_number()) rope_theta = rope.at("rope_theta").get<double>();
  const Json rope_type = get("rope_type"), old_type = get("type");  // (transformers 5 writes both; 4, type)
  const Json& type = rope_type.is_null() ? old_type : rope_type;
  const std::string kind = type.is_string() ? type.get<std::string>() : "default";
  if (kind == "default") {
    for (const auto& item : rope.items())
      if (!known.count(item.key())) r.refuse(name + "." + item.key(), "= " + item.value().dump() + " with default rotary embeddings", "delete it");
    return;
  }
  if (kind != "yarn")
    return r.refuse(name, "has rope_type \"" + kind + "\": dsrun's rotary scaling is YaRN (DeepSeek-V2/V3's)", "train without it, or with YaRN");
  const std::string t = "model.rope_scaling";
  put_in(tables, t, "type", Value::of_string("yarn"));
  for (const char* k : {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}) {
    const Json v = get(k);
    if (v.is_number()) put_in(tables, t, k, Value::of_float(v.get<double>()));
    else if (!v.is_null()) r.refuse(name + "." + k, "is " + v.dump() + ", not a number", "write a number");
  }
  const Json original = get("original_max_position_embeddings");
  if (original.is_number_integer()) put_in(tables, t, "original_max_position_embeddings", Value::of_int(original.get<int64_t>()));
  if (!get("factor").is_number()) r.refuse(name + ".factor", "is missing", "YaRN needs its factor (DeepSeek-V3: 40)");
  const Json truncate = get("truncate");
  if (truncate.is_boolean() && !truncate.get<bool>())
    r.refuse(name + ".truncate", "= false", "dsrun's YaRN rounds its correction range as DeepSeek's does (truncate = true)");
  for (const auto& item : rope.items())
    if (!known.count(item.key()))
      r.refuse(name + "." + item.key(), "= " + item.value().dump() + ": dsrun's YaRN is DeepSeek's and has no such setting", "delete it, or train without it");
}

// The routed experts and their router (DeepSeek-MoE, V2, V3). Absent router keys take their
// model type's meaning: transformers' DeepseekV3Config has none of them (sigmoid scores, the
// selection bias within groups, no balance loss); DeepSeek-MoE's and V2's default to softmax,
// greedy choice and a sequence-wise loss of 0.001.
void read_moe(ConfigReader& r, std::vector<Table>& tables) {
  const bool v3 = r.model_type == "deepseek_v3";
  const int64_t routed = r.integer("n_routed_experts", 0);
  const char* const moe_keys[] = {"n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
                                  "norm_topk_prob", "routed_scaling_factor", "scoring_func", "topk_method", "n_group", "topk_group", "aux_loss_alpha", "seq_aux"};
  if (routed <= 0) {  // a dense model: its MoE keys are unused, in transformers too
    for (const char* k : moe_keys) r.use(k);
    return;
  }
  put(tables, "n_routed_experts", Value::of_int(routed));
  put(tables, "n_shared_experts", Value::of_int(r.integer("n_shared_experts", 0)));
  put(tables, "num_experts_per_tok", Value::of_int(r.required_integer("num_experts_per_tok")));
  put(tables, "moe_intermediate_size", Value::of_int(r.required_integer("moe_intermediate_size")));
  put(tables, "first_k_dense_replace", Value::of_int(r.integer("first_k_dense_replace", 0)));
  r.expect("moe_layer_freq", 1, "dsrun's MoE layers follow the dense ones without gaps");
  const std::string scoring = r.string("scoring_func", v3 ? "sigmoid" : "softmax");
  if (scoring != "softmax" && scoring != "sigmoid") r.refuse("scoring_func", "= \"" + scoring + "\"", "use softmax or sigmoid");
  put(tables, "scoring_func", Value::of_string(scoring));
  put(tables, "norm_topk_prob", Value::of_bool(r.boolean("norm_topk_prob", false)));
  put(tables, "routed_scaling_factor", Value::of_float(r.number("routed_scaling_factor", 1.0)));
  const std::string method = r.string("topk_method", v3 ? "noaux_tc" : "greedy");
  const int64_t groups = r.integer("n_group", 1), kept = r.integer("topk_group", 1);
  if (method == "greedy") {  // groups are not read by greedy choice
    put(tables, "n_group", Value::of_int(1));
    put(tables, "topk_group", Value::of_int(1));
  } else if (method == "group_limited_greedy" || method == "noaux_tc") {
    const bool bias = method == "noaux_tc";
    if (scoring != (bias ? "sigmoid" : "softmax"))
      r.refuse("topk_method", "= \"" + method + "\" with scoring_func = \"" + scoring + "\"",
               bias ? "dsrun scores groups by their best two sigmoid affinities (V3's noaux_tc): use sigmoid"
                  : "dsrun scores groups by their best softmax affinity (V2's group_limited_greedy): use softmax");
    put(tables, "n_group", Value::of_int(groups));
    put(tables, "topk_group", Value::of_int(kept));
    if (bias) put_in(tables, "model.moe", "balance", Value::of_string("bias"));
  } else {
    r.refuse("topk_method", "= \"" + method + "\"", "use greedy, group_limited_greedy or noaux_tc");
  }
  // aux_loss_alpha weighs the sequence-wise balance loss with seq_aux, else the batch-wise one.
  const double alpha = r.number("aux_loss_alpha", v3 ? 0.0 : 0.001);
  const bool per_sequence = r.boolean("seq_aux", true);
  if (method != "noaux_tc")  // (with the selection bias there is no batch-wise loss)
    put_in(tables, "model.moe", "aux_loss_weight", Value::of_float(per_sequence ? 0.0 : alpha));
  put_in(tables, "model.moe", "seq_aux_loss_weight", Value::of_float(per_sequence ? alpha : 0.0));
}

// MLA's widths (DeepSeek-V2/V3).
void read_latent_attention(ConfigReader& r, std::vector<Table>& tables, int64_t heads) {
  put_in(tables, "model", "attention", Value::of_string("mla"));
  put(tables, "q_lora_rank", Value::of_int(r.integer("q_lora_rank", 0)));  // null: a full query projection
  for (const char* k : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) put(tables, k, Value::of_int(r.required_integer(k)));
  r.expect("num_key_value_heads", heads, "latent attention has one key and value per head");
  r.expect("rope_interleave", true, "dsrun rotates MLA's pairs (2i, 2i+1), as DeepSeek released the weights");
  const int64_t rope_dim = r.integer("qk_rope_head_dim", 0), nope_dim = r.integer("qk_nope_head_dim", 0);
  r.expect("head_dim", rope_dim, "with MLA transformers' head_dim is the rotary width qk_rope_head_dim");
  r.expect("qk_head_dim", nope_dim + rope_dim, "transformers 5 derives it: qk_nope_head_dim + qk_rope_head_dim");
}

}  // namespace

const char* recipe_key_for_hf_name(const std::string& hf_name) {
  for (const auto& [hf, ours] : kCopiedKeys)
    if (hf_name == hf) return ours;
  return nullptr;
}

HfModelSection model_section_from_hf_config(const std::string& config_path) {
  ConfigReader r(config_path);
  HfModelSection out;
  out.model_type = r.model_type = r.string("model_type", "");
  const std::string& type = out.model_type;
  if (type != "llama" && type != "deepseek" && type != "deepseek_v2" && type != "deepseek_v3") {
    r.refuse("model_type", "= \"" + type + "\": dsrun builds llama, deepseek (DeepSeek-MoE), deepseek_v2 and deepseek_v3 models",
             "start from a recipe template instead (dsrun templates)");
    r.throw_if_refused();
  }
  out.ignored = r.no_effect_keys_present();

  std::vector<Table> tables{{"model", {}}};
  // The model is named after the checkpoint's directory.
  std::string name = parent_directory(config_path);
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  name = name.substr(name.rfind('/') == std::string::npos ? 0 : name.rfind('/') + 1);
  if (name.empty() || name == ".") name = type;
  put_in(tables, "model", "name", Value::of_string(name));
  put_in(tables, "model", "arch", Value::of_string("deepseek"));
  for (const char* k : {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size", "max_position_embeddings"})
    put(tables, k, Value::of_int(r.required_integer(k)));
  const int64_t hidden = r.integer("hidden_size", 0), heads = r.integer("num_attention_heads", 0);
  // transformers' defaults where a key is absent (every DeepSeek and Llama config writes them).
  put(tables, "rms_norm_eps", Value::of_float(r.number("rms_norm_eps", 1e-6)));
  double rope_theta = r.number("rope_theta", 10000.0);
  put(tables, "tie_word_embeddings", Value::of_bool(r.boolean("tie_word_embeddings", false)));
  put(tables, "initializer_range", Value::of_float(r.number("initializer_range", 0.02)));

  const bool latent = (type == "deepseek_v2" || type == "deepseek_v3") && r.boolean("use_mla", true);
  if (latent) {
    read_latent_attention(r, tables, heads);
  } else {
    put(tables, "num_key_value_heads", Value::of_int(r.integer("num_key_value_heads", heads)));
    if (heads > 0) r.expect("head_dim", hidden / heads, "dsrun's heads are hidden_size / num_attention_heads wide");
    r.expect("rope_interleave", false, "dsrun rotates a multi-head attention's halves (Llama's layout)");
    for (const char* k : {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
      if (r.has(k)) r.refuse(k, "is set without latent attention", "delete it, or use a deepseek_v2/deepseek_v3 config");
  }
  read_moe(r, tables);
  read_rope(r, tables, rope_theta);
  put(tables, "rope_theta", Value::of_float(rope_theta));
  const int64_t mtp = r.integer("num_nextn_predict_layers", 0);
  if (mtp > 0) put(tables, "num_nextn_predict_layers", Value::of_int(mtp));

  r.expect("hidden_act", "silu", "dsrun's feed-forward layers are SwiGLU");
  r.expect("attention_bias", false, "dsrun's attention projections have no bias");
  r.expect("mlp_bias", false, "dsrun's feed-forward projections have no bias");
  r.expect("attention_dropout", 0.0, "dsrun trains without attention dropout");
  r.expect("pretraining_tp", 1, "the slicing of Llama's original tensor-parallel run; it changes nothing else");
  r.expect("use_sliding_window", false, "dsrun's attention is causal over the whole sequence");
  r.expect("sliding_window", nullptr, "dsrun's attention is causal over the whole sequence");
  const Json quantization = r.use("quantization_config");
  if (!quantization.is_null()) {
    const bool blockwise_fp8 = quantization.value("quant_method", "") == "fp8" && quantization.value("fmt", "e4m3") == "e4m3" &&
                               quantization.value("weight_block_size", Json::array()) == Json::array({128, 128});
    if (!blockwise_fp8)
      r.refuse("quantization_config", "= " + quantization.dump() + ": dsrun reads FP8 E4M3 weights in 128 x 128 blocks (DeepSeek-V3's) only",
               "dequantise the weights first (to bf16 or fp32 safetensors)");
  }
  r.refuse_unread();
  r.throw_if_refused();

  std::string text;
  for (const Table& t : tables) {
    if (t.keys.empty()) continue;
    text += "\n[" + t.name + "]\n";
    for (const auto& [key, value] : t.keys) text += key + " = " + value.toml() + "\n";
  }
  out.toml = text;
  return out;
}

}  // namespace dsrun
