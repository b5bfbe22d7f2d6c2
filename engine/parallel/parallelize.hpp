// Applies a layout to a model that knows nothing of ranks, in one fixed order (torchtitan's):
// pipeline split → expert sharding → tensor sharding → activation checkpointing → ZeRO over the
// data dimension (→ the pipeline stage that runs the schedule over what this rank keeps).
#pragma once

#include "engine/dist/mesh.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "engine/parallel/expert_parallel.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/parallel/zero.hpp"

#include <map>
#include <memory>

namespace dsrun {

struct ParallelizeOptions {
  // Pipeline parallelism: the model's pieces in pipeline numbering (Model::pipeline_unit_count),
  // stages × virtual stages of them in order, from the plan's split; rank r runs pieces r, r + stages, ...
  std::vector<UnitRange> pipeline_pieces;
  PipelineOptions pipeline;
  bool sequence_parallel = false;  // activations between tensor-parallel regions split along the sequence
  bool recomputation = false;      // checkpointable units recompute their activations in backward
  bool shared_experts_beside_dispatch = false;  // ExecutionModes::shared_experts_beside_dispatch
  bool tokens_once_per_rank = false;            // ExecutionModes::tokens_once_per_rank
  ZeroOptions zero;                // ZeRO on the data dimension: stage, dtype, offload
};

// The model as this rank runs it: its slice of every split weight, ZeRO's flat buffers over the
// data dimension, and the tensor-parallel regions. The model's forward takes it as its runner.
class ParallelModel final : public UnitRunner {
 public:
  ZeroDataParallel& zero() { return *zero_; }
  TensorParallel& tensor() { return tensor_; }
  // The pipeline stage this rank runs (null without pipeline parallelism: the trainer calls the
  // model's forward itself).
  PipelineStage* pipeline() { return pipeline_.get(); }

  // ZeRO gathers the unit's parameters around its computation, which recomputation may wrap.
  Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) override {
    return zero_->run(unit, [&](const Tensors& in) { return recomputation_.run(unit, fn, in); }, inputs);
  }
  torch::Tensor enter_split(const torch::Tensor& x) override { return tensor_.enter(x); }
  torch::Tensor leave_split(const torch::Tensor& partial) override { return tensor_.leave(partial); }
  bool splits_nothing() const override { return tensor_.size() == 1; }
  torch::Tensor embedding(const torch::Tensor& weight, const torch::Tensor& ids) override { return tensor_.embedding(weight, ids); }
  torch::Tensor projected_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets, int64_t chunk_tokens,
                               bool gradients_in_forward) override {
    return tensor_.projected_loss(hidden, weight, targets, chunk_tokens, gradients_in_forward);
  }
  torch::Tensor routed_experts(const RoutedPairs& pairs, const torch::Tensor& counts, const ExpertsFn& local, const std::function<void()>& meanwhile) override {
    return experts_ ? experts_->run(pairs, counts, local, meanwhile) : UnitRunner::routed_experts(pairs, counts, local, meanwhile);
  }
  void record_routing(int layer, const torch::Tensor& routed, int64_t dropped) override;
  // Context parallelism: the rank's queries over the whole sequence, by the group's gathered keys
  // and values (context_parallel_attention; the batch was split by ZigzagSplit::take).
  torch::Tensor split_sequence_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& places) override;
  // Context parallelism: the context group's sum (all_reduce_sequence_sum); else `part`.
  torch::Tensor sum_over_sequences(const torch::Tensor& part) override;
  // The split of a sequence of `seq_len` tokens over this rank's context group.
  ZigzagSplit sequence_split(int64_t seq_len) const { return {mesh_.shape().context, seq_len}; }

  // What this rank's MoE layers routed since the last call (forwards, not their recomputation),
  // by layer: pairs per expert, summed over micro-batches ([experts] int64), and pairs dropped.
  struct LayerRouting {
    torch::Tensor routed;
    int64_t dropped = 0;
  };
  std::map<int, LayerRouting> take_routing() { return std::exchange(routing_, {}); }

  // The gradient's norm over the whole mesh: split weights' squares summed over the tensor
  // dimension, replicated ones (the same on every tensor rank) counted once, and each pipeline
  // stage's added (a tied embedding counts on the first stage alone).
  double global_grad_norm();
  // The same as a scalar fp64 tensor where the gradients are (collectives there too): on GPUs the
  // host reads nothing.
  torch::Tensor global_grad_norm_tensor();
  // Whether any rank of the mesh has an inf or NaN gradient (fp16 overflow).
  bool gradients_overflowed();

 private:
  friend std::unique_ptr<ParallelModel> parallelize(Model&, DeviceMesh&, const ParallelizeOptions&);
  ParallelModel(DeviceMesh& mesh, bool sequence_parallel) : mesh_(mesh), tensor_(mesh.along(MeshDim::Tensor), sequence_parallel) {}
  DeviceMesh& mesh_;
  TensorParallel tensor_;
  Recomputation recomputation_;
  std::unique_ptr<ZeroDataParallel> zero_;
  std::unique_ptr<PipelineStage> pipeline_;
  std::unique_ptr<ExpertParallel> experts_;  // null without expert parallelism
  std::map<int, LayerRouting> routing_;
};

std::unique_ptr<ParallelModel> parallelize(Model& model, DeviceMesh& mesh, const ParallelizeOptions& options);

}  // namespace dsrun
