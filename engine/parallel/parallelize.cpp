#include "engine/parallel/parallelize.hpp"

#include "engine/common/error.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/sequence_collectives.hpp"

#include <cmath>
#include <map>

namespace dsrun {

namespace {

// Each split weight becomes this rank's slice. A deferred model's parameters only change shape;
// their values are cut from the full initial weight when ZeRO builds the unit, so that every
// layout starts from the one-process weights.
void shard_tensors(Model& model, TensorParallel& tp, ZeroOptions& zero) {
  if (tp.size() == 1) return;
  torch::NoGradGuard no_grad;
  auto full_shapes = std::make_shared<std::map<std::string, std::pair<std::vector<int64_t>, TensorSplit>>>();
  for (ParameterUnit& unit : model.parameter_units())
    for (size_t i = 0; i < unit.params.size(); ++i) {
      torch::Tensor& p = unit.params[i];
      const TensorSplit split = i < unit.splits.size() ? unit.splits[i] : TensorSplit{};
      if (split.kind == TensorSplit::Replicated) {
        // Replicated weights outside the regions (the norms) see 1/t of the tokens under sequence parallelism.
        if (tp.sequence_parallel()) tp.sum_gradient_over_group(p, torch_dtype(zero.gradient_dtype()));
        continue;
      }
      (*full_shapes)[unit.names.at(i)] = {p.sizes().vec(), split};
      if (model.deferred())
        p.set_data(torch::empty(tensor_slice_shape(p.sizes().vec(), split, tp.size()), p.options()));
      else
        p.set_data(tensor_slice(p.detach(), split, tp.rank(), tp.size()));
    }
  if (!model.deferred()) return;
  const int rank = tp.rank(), size = tp.size();
  zero.initial_values = [&model, full_shapes, rank, size](const std::string& name, torch::Tensor& values) {
    auto it = full_shapes->find(name);
    if (it == full_shapes->end()) return model.initialize_parameter(name, values);
    torch::Tensor full = torch::empty(it->second.first, values.options());
    model.initialize_parameter(name, full);
    copy_tensor_slice(values, full, it->second.second, rank, size);
  };
}

}  // namespace

std::unique_ptr<ParallelModel> parallelize(Model& model, DeviceMesh& mesh, const ParallelizeOptions& options) {
  std::unique_ptr<ParallelModel> pm(new ParallelModel(mesh, options.sequence_parallel));
  ZeroOptions zero = options.zero;
  // 1. Pipeline split: this rank keeps its chunks (pieces r, r + stages, ...) and drops the rest.
  const int stages = mesh.shape().pipeline;
  std::vector<UnitRange> chunks;
  if (stages > 1) {
    DSRUN_ASSERT(static_cast<int>(options.pipeline_pieces.size()) % stages == 0, "pipeline pieces come in stages × virtual stages");
    for (size_t g = mesh.coordinates().pipeline; g < options.pipeline_pieces.size(); g += stages) chunks.push_back(options.pipeline_pieces[g]);
    model.keep_only(chunks);
  }
  // 2. Expert sharding: this rank keeps its shard of every MoE layer's routed experts, as units of
  //    their own that ZeRO reduces over the data ranks keeping the same experts.
  const int expert_shards = mesh.shape().expert;
  if (expert_shards > 1) {
    model.keep_experts(mesh.shape().expert_shard(mesh.rank()), expert_shards);
    pm->experts_ = std::make_unique<ExpertParallel>(mesh.experts(ExpertGroup::Shards),
                                                   ExpertExchange{options.shared_experts_beside_dispatch, options.tokens_once_per_rank});
    zero.expert_replicas = &mesh.experts(ExpertGroup::Replicas);
  }
  // 3. Tensor sharding: split weights become this rank's slices (with sequence parallelism,
  //    replicated weights sum their gradients over the tensor group).
  shard_tensors(model, pm->tensor_, zero);
  // 4. Activation checkpointing: checkpointable units recompute in backward (run() wraps them).
  pm->recomputation_ = Recomputation(model, options.recomputation);
  // 5. ZeRO over the data dimension: flat buffers, sharded states, gradient reduction.
  zero.separate_replicated_norm = pm->tensor_.size() > 1;
  pm->zero_ = std::make_unique<ZeroDataParallel>(model, mesh.along(MeshDim::Data), zero);
  if (stages > 1) pm->pipeline_ = std::make_unique<PipelineStage>(model, *pm, *pm->zero_, mesh.along(MeshDim::Pipeline), chunks, options.pipeline);
  return pm;
}

torch::Tensor ParallelModel::split_sequence_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& places) {
  Communicator& group = mesh_.context();
  const ZigzagSplit split = sequence_split(q.size(1) * group.world_size());
  DSRUN_ASSERT(places.size(0) == split.local_tokens(), "the batch was split for this context group");
  return context_parallel_attention(q, k, v, split, group);
}

torch::Tensor ParallelModel::sum_over_sequences(const torch::Tensor& part) {
  return mesh_.shape().context > 1 ? all_reduce_sequence_sum(part, mesh_.context()) : part;
}

void ParallelModel::record_routing(int layer, const torch::Tensor& routed, int64_t dropped) {
  if (recomputing()) return;  // counted by the forward it repeats
  LayerRouting& r = routing_[layer];
  r.routed = r.routed.defined() ? r.routed + routed : routed.clone();
  r.dropped += dropped;
}

torch::Tensor ParallelModel::global_grad_norm_tensor() {
  const torch::Tensor squares = zero_->masters().gradient_squares();  // [split, replicated], fp64
  torch::Tensor split = squares.narrow(0, 0, 1).clone();
  if (tensor_.size() > 1) mesh_.along(MeshDim::Tensor).all_reduce_sum(split);
  torch::Tensor total = split + squares.narrow(0, 1, 1);
  if (mesh_.shape().pipeline > 1) mesh_.along(MeshDim::Pipeline).all_reduce_sum(total);
  return total.sqrt().reshape({});
}

double ParallelModel::global_grad_norm() { return global_grad_norm_tensor().item<double>(); }

bool ParallelModel::gradients_overflowed() {
  double bad = zero_->gradients_overflowed() ? 1 : 0;
  if (mesh_.shape().data == mesh_.shape().size()) return bad > 0;  // ZeRO's answer is the world's
  torch::Tensor t = torch::tensor({bad}, torch::kFloat64);
  mesh_.world().all_reduce_sum(t);
  return t.item<double>() > 0;
}

}  // namespace dsrun
