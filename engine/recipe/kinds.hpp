// The recipe's enumerations and their names: one table per enum feeds parsing (build.cpp),
// printing (to_string) and the schema's choices (schema.cpp). Torch-free, the lowest header of recipe/.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace dsrun {

// EnumNames<E>::table lists every value of E with the name recipes, messages and docs use.
template <typename E>
struct EnumNames {};
template <typename E, size_t N>
using NameTable = std::array<std::pair<E, const char*>, N>;

enum class Device { Cpu, Cuda };
template <>
struct EnumNames<Device> {
  static constexpr NameTable<Device, 2> table{{{Device::Cpu, "cpu"}, {Device::Cuda, "cuda"}}};
};

enum class DType { Fp32, Bf16, Fp16 };
template <>
struct EnumNames<DType> {
  static constexpr NameTable<DType, 3> table{{{DType::Fp32, "fp32"}, {DType::Bf16, "bf16"}, {DType::Fp16, "fp16"}}};
};

// FP8 products for the blocks' linear layers (engine/model/fp8_linear): one scale per tensor, per row
// (and per column for the transposed operands of backward), or per 1x128 / 128x128 block.
enum class Fp8Scaling { None, Tensorwise, Rowwise, Blockwise };
template <>
struct EnumNames<Fp8Scaling> {
  static constexpr NameTable<Fp8Scaling, 4> table{
      {{Fp8Scaling::None, "none"}, {Fp8Scaling::Tensorwise, "tensorwise"}, {Fp8Scaling::Rowwise, "rowwise"}, {Fp8Scaling::Blockwise, "blockwise"}}};
};

// What an FP8 product's sizes must be multiples of: whole 128-blocks for blockwise scales, else 16.
constexpr long long fp8_size_multiple(Fp8Scaling s) { return s == Fp8Scaling::Blockwise ? 128 : 16; }

// The collectives the plan prices, named as their probed keys are (hardware.<name>_gbs).
enum class Collective { AllReduce, AllGather, ReduceScatter, AllToAll };
template <>
struct EnumNames<Collective> {
  static constexpr NameTable<Collective, 4> table{
      {{Collective::AllReduce, "all_reduce"}, {Collective::AllGather, "all_gather"}, {Collective::ReduceScatter, "reduce_scatter"}, {Collective::AllToAll, "all_to_all"}}};
};

enum class ModelArch { DeepSeek, ResNet };
template <>
struct EnumNames<ModelArch> {
  static constexpr NameTable<ModelArch, 2> table{{{ModelArch::DeepSeek, "deepseek"}, {ModelArch::ResNet, "resnet"}}};
};

// Attention of a decoder: multi-head (grouped-query where kv_heads < heads) or DeepSeek-V2/V3's
// multi-head latent attention (keys and values from one compressed latent, a shared rotary key).
enum class AttentionKind { Mha, Mla };
template <>
struct EnumNames<AttentionKind> {
  static constexpr NameTable<AttentionKind, 2> table{{{AttentionKind::Mha, "mha"}, {AttentionKind::Mla, "mla"}}};
};

// A MoE router's affinities: DeepSeek-MoE/V2's softmax over the experts, or V3's sigmoid per expert.
enum class RouterScore { Softmax, Sigmoid };
template <>
struct EnumNames<RouterScore> {
  static constexpr NameTable<RouterScore, 2> table{{{RouterScore::Softmax, "softmax"}, {RouterScore::Sigmoid, "sigmoid"}}};
};

// Rotary position scaling beyond the trained length: none, or YaRN (DeepSeek-V2/V3's 128K).
enum class RopeScalingKind { None, Yarn };
template <>
struct EnumNames<RopeScalingKind> {
  static constexpr NameTable<RopeScalingKind, 2> table{{{RopeScalingKind::None, "none"}, {RopeScalingKind::Yarn, "yarn"}}};
};

// How MoE routing is kept even: an auxiliary loss, or DeepSeek-V3's learned selection bias.
enum class MoeBalance { AuxLoss, Bias };
template <>
struct EnumNames<MoeBalance> {
  static constexpr NameTable<MoeBalance, 2> table{{{MoeBalance::AuxLoss, "aux_loss"}, {MoeBalance::Bias, "bias"}}};
};

enum class Offload { None, Optimizer, OptimizerAndParams };
template <>
struct EnumNames<Offload> {
  static constexpr NameTable<Offload, 3> table{{{Offload::None, "none"}, {Offload::Optimizer, "optimizer"}, {Offload::OptimizerAndParams, "optimizer+params"}}};
};

enum class Checkpointing { None, Full, Auto };
template <>
struct EnumNames<Checkpointing> {
  static constexpr NameTable<Checkpointing, 3> table{{{Checkpointing::None, "none"}, {Checkpointing::Full, "full"}, {Checkpointing::Auto, "auto"}}};
};

enum class PipelineScheduleKind { GPipe, OneFOneB, Interleaved };
template <>
struct EnumNames<PipelineScheduleKind> {
  static constexpr NameTable<PipelineScheduleKind, 3> table{
      {{PipelineScheduleKind::GPipe, "gpipe"}, {PipelineScheduleKind::OneFOneB, "1f1b"}, {PipelineScheduleKind::Interleaved, "interleaved"}}};
};

enum class OptimizerKind { AdamW, Adam, Sgd };
template <>
struct EnumNames<OptimizerKind> {
  static constexpr NameTable<OptimizerKind, 3> table{{{OptimizerKind::AdamW, "adamw"}, {OptimizerKind::Adam, "adam"}, {OptimizerKind::Sgd, "sgd"}}};
};

enum class ScheduleKind { Constant, Linear, Cosine, OneCycle, MultiStep, Wsd };
template <>
struct EnumNames<ScheduleKind> {
  static constexpr NameTable<ScheduleKind, 6> table{{{ScheduleKind::Constant, "constant"},
                                                     {ScheduleKind::Linear, "linear"},
                                                     {ScheduleKind::Cosine, "cosine"},
                                                     {ScheduleKind::OneCycle, "onecycle"},
                                                     {ScheduleKind::MultiStep, "multistep"},
                                                     {ScheduleKind::Wsd, "wsd"}}};
};

enum class DataKind { Synthetic, Text, Tokens, Cifar10 };
template <>
struct EnumNames<DataKind> {
  static constexpr NameTable<DataKind, 4> table{{{DataKind::Synthetic, "synthetic"}, {DataKind::Text, "text"}, {DataKind::Tokens, "tokens"}, {DataKind::Cifar10, "cifar10"}}};
};

// The token corpora dsrun reads (data.format). auto: recognised by header (DSRUNTOK or a prepare
// manifest, a Megatron-LM .idx beside the .bin, llm.c's magic); dsrun: `dsrun prepare`'s directory or
// DSRUNTOK shards; megatron: PREFIX.bin with PREFIX.idx (MMIDIDX); llmc: 256 int32 header, magic
// 20240520 (uint16 tokens) or 20240801 (uint32); nanogpt: headerless tokens of data.token_width bytes.
enum class TokenFormat { Auto, Dsrun, Megatron, Llmc, Nanogpt };
template <>
struct EnumNames<TokenFormat> {
  static constexpr NameTable<TokenFormat, 5> table{
      {{TokenFormat::Auto, "auto"}, {TokenFormat::Dsrun, "dsrun"}, {TokenFormat::Megatron, "megatron"}, {TokenFormat::Llmc, "llmc"}, {TokenFormat::Nanogpt, "nanogpt"}}};
};

enum class HookErrorPolicy { Fail, Disable };
template <>
struct EnumNames<HookErrorPolicy> {
  static constexpr NameTable<HookErrorPolicy, 2> table{{{HookErrorPolicy::Fail, "fail"}, {HookErrorPolicy::Disable, "disable"}}};
};

// The name of any value above.
template <typename E, typename = decltype(EnumNames<E>::table)>
const char* to_string(E value) {
  for (const auto& [v, name] : EnumNames<E>::table)
    if (v == value) return name;
  return "?";
}

// The value named `name`, or nullopt (the schema has refused unknown names before build.cpp reads them).
template <typename E>
std::optional<E> enum_from_string(const std::string& name) {
  for (const auto& [v, n] : EnumNames<E>::table)
    if (name == n) return v;
  return std::nullopt;
}

// Every name, in table order: a schema key's choices.
template <typename E>
std::vector<std::string> enum_names() {
  std::vector<std::string> names;
  for (const auto& [v, n] : EnumNames<E>::table) names.push_back(n);
  return names;
}

}  // namespace dsrun
