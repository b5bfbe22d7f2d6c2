// The recipe language's single source of truth: every key with its type, default, range, choices
// and documentation. The loader validates against it and docs/recipe.md is generated from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

enum class ValueType {
  Int,          // TOML integer
  Float,        // TOML float (integers accepted)
  Bool,
  String,
  Choice,       // string from `choices`
  IntOrAuto,    // integer in range, or "auto"
  FloatOrAuto,  // float in range, or "auto"
  BoolOrAuto,   // true, false, or "auto"
  FloatList,    // array of numbers, each in range
  StringList,   // array of strings
};

struct KeySpec {
  std::string key;            // dotted, e.g. "parallel.zero_stage"
  ValueType type;
  std::string default_toml;   // default as a TOML literal: 3, "auto", [0.9, 0.95]
  double min = 0, max = 0;    // inclusive numeric range (each element for lists); ignored when min == max == 0
  std::vector<std::string> choices;
  std::string doc;
};

struct SectionSpec {
  std::string name;  // "parallel"
  std::string doc;
};

const std::vector<SectionSpec>& recipe_sections();
const std::vector<KeySpec>& recipe_schema();
const KeySpec* find_key_spec(const std::string& key);
// Tables whose keys are free-form and passed through (hook options).
bool is_open_table_key(const std::string& key);
// Keys users reach for that dsrun derives instead, with the explanation to print.
const char* derived_key_explanation(const std::string& key);
// The dsrun key for a name from DeepSpeed or Hugging Face configs ("learning_rate" -> "optimizer.lr").
const char* key_for_foreign_name(const std::string& name);
std::string value_type_name(ValueType t);

// The reference page (docs/recipe.md), generated so it can never drift from the schema.
std::string recipe_reference_markdown();

}  // namespace dsrun
