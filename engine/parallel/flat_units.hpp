// ZeRO's flat parameter units: each unit's parameters as views of one flat buffer in the compute
// dtype (whole at stages 0-2, this rank's slice at stage 3, gathered while it computes), its
// gradient accumulator, and the layout checkpoints read.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/flat_layout.hpp"
#include "engine/parallel/host_buffers.hpp"
#include "engine/parallel/zero_options.hpp"

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace dsrun {

struct FlatUnit {
  size_t index = 0;
  std::string name;
  Communicator* group = nullptr;  // the ranks its shards are spread over: the data group, or the expert replicas
  bool routed_experts = false;    // ParameterUnit::experts_of: kept apart from the unit that reads them
  std::vector<size_t> experts;    // the routed-expert units this unit's computation reads
  bool always_gets_gradients = true;  // may start its reduction from the gradient-ready hooks
  std::vector<torch::Tensor> params;
  FlatUnitLayout layout;
  std::vector<std::pair<int64_t, int64_t>> replicated_ranges;  // [begin, end) within the shard: TensorSplit::Replicated parameters
  torch::Tensor full;         // working parameters, compute dtype, [padded]; stage 3: only while gathered
  torch::Tensor param_shard;  // stage 3: this rank's slice of the working parameters
  torch::Tensor grad_acc;     // stage 0-1: [padded], the parameters' .grad are views of it (unless widened); stage 2-3: [shard]; gradient dtype
  bool gathered = false;
  bool gathered_for_backward = false;

  // This rank's slice of the working parameters (what its master shard updates).
  torch::Tensor working_slice() const;
};

class FlatUnits {
 public:
  FlatUnits(Model& model, Communicator& data_group, const ZeroOptions& options);

  // Where the working parameters compute: a deferred model's options.device, else its parameters'.
  torch::Device device() const { return device_; }
  FlatUnitLayout lay_out(const ParameterUnit& pu) const;
  // Builds unit pu whole (a deferred model's values exist for this unit only) and returns its
  // fp32 values, padding zero, for the master shard; the caller drops them.
  torch::Tensor add(const ParameterUnit& pu, FlatUnitLayout layout, HostBuffers& host);

  // Stage 3: all-gathers the unit's parameters from `shard` (this rank's, already on the device),
  // or from param_shard when `shard` is undefined; release() frees them again.
  void gather(FlatUnit& u, const torch::Tensor& shard);
  void release(FlatUnit& u);

  size_t size() const { return units_.size(); }
  FlatUnit& operator[](size_t k) { return *units_.at(k); }
  const FlatUnit& operator[](size_t k) const { return *units_.at(k); }

  // For checkpoints: unit k has numel(k) elements (padding excluded), its parameters at
  // offsets(k), and its master shard holds elements from master_begin(k); group(k) holds its shards.
  const std::string& name(size_t k) const { return units_.at(k)->name; }
  int64_t numel(size_t k) const { return units_.at(k)->layout.numel; }
  int64_t master_begin(size_t k) const { return units_.at(k)->layout.shard_begin; }
  const std::vector<torch::Tensor>& params(size_t k) const { return units_.at(k)->params; }
  const std::vector<int64_t>& offsets(size_t k) const { return units_.at(k)->layout.offsets; }
  const std::vector<int64_t>& shape(size_t k, size_t i) const { return units_.at(k)->layout.shapes.at(i); }
  Communicator& group(size_t k) const { return *units_.at(k)->group; }

  void zero_gradients();
  // Bytes of working parameters and gradients this rank holds now, to compare with the plan.
  double parameter_and_gradient_bytes() const;

 private:
  torch::Tensor materialise_values(const ParameterUnit& pu, const FlatUnitLayout& layout) const;
  // Stage 0-2: the whole flat buffer in the compute dtype; stage 3: this rank's slice of it.
  void create_working_parameters(FlatUnit& u, const torch::Tensor& flat32, HostBuffers& host) const;
  // The gradient accumulator, and the parameters (and at stage 0-1 their gradients) as views of the buffers.
  void bind_parameters(FlatUnit& u) const;

  Model& model_;
  Communicator& data_group_;
  ZeroOptions options_;
  torch::Device device_{torch::kCPU};
  std::vector<std::unique_ptr<FlatUnit>> units_;
};

}  // namespace dsrun
