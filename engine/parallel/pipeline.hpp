// Runs a pipeline schedule (engine/parallel/pipeline_schedule.hpp) on this rank: its chunks'
// forwards and backwards, the activations and gradients sent between stages, and tied embeddings
// kept in step between the first stage and the last.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/pipeline_schedule.hpp"
#include "engine/parallel/zero.hpp"

#include <torch/torch.h>

#include <functional>
#include <map>
#include <utility>
#include <vector>

namespace dsrun {

struct PipelineOptions {
  PipelineSchedule schedule;  // a training step's, for every pipeline rank
  // What crosses between chunks: the activations [micro, seq, hidden] (with sequence parallelism
  // seq / tensor) in the compute dtype, and for MoE models the running balance loss (fp32 scalar).
  std::vector<int64_t> activation_shape;
  bool carries_aux_loss = false;
  // Tied embeddings: this tensor rank's slice of the embedding weight, [vocab / tensor, hidden].
  std::vector<int64_t> tied_embedding_shape;
  torch::ScalarType dtype = torch::kFloat32;
  // The gradient dtype (precision.grad_dtype): wider than dtype, the last stage sums the tied head's
  // gradient over the step's micro-batches in it and sends it so; the first stage adds it once.
  torch::ScalarType gradient_dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
};

// What a step's micro-batches add up to: losses on the last stage (0 elsewhere); the items (tokens)
// every stage read.
struct PipelineTotals {
  double loss_sum = 0, aux_loss_sum = 0, mtp_loss_sum = 0;
  int64_t items = 0;
};

class PipelineStage {
 public:
  // chunks: this rank's pieces of the model (pipeline numbering), as kept by Model::keep_only;
  // runner: what the model's forward runs its units through (the ParallelModel).
  PipelineStage(Model& model, UnitRunner& runner, ZeroDataParallel& zero, Communicator& pipeline, std::vector<UnitRange> chunks, PipelineOptions options);

  using BatchFn = std::function<Batch(int micro_batch)>;
  using LossFn = std::function<MicroBatchLoss(const ModelOutput&, const Batch&)>;
  // One training step: every action of this rank's schedule. Backward starts from each
  // micro-batch's loss times loss_multiplier; ZeRO reduces each chunk's gradients after its last.
  PipelineTotals train_step(const BatchFn& batch, const LossFn& loss, double loss_multiplier);
  // Forwards alone over `micro_batches` micro-batches (evaluation, under no_grad).
  PipelineTotals evaluate(const BatchFn& batch, const LossFn& loss, int micro_batches);

  int stage() const { return pipeline_.rank(); }
  int stages() const { return pipeline_.world_size(); }

 private:
  struct Live;  // one micro-batch's chunk between its forward and the send of its input gradient
  using LiveMap = std::map<std::pair<int, int>, Live>;  // (micro-batch, chunk)
  PipelineTotals run(const PipelineSchedule& schedule, const BatchFn& batch, const LossFn& loss, double loss_multiplier);
  // One communication group of the schedule (communication_groups): its sends and receives issued together.
  void communicate(const PipelineSchedule& s, const PipelineAction* begin, const PipelineAction* end, LiveMap& live);
  torch::Tensor as_message(const torch::Tensor& t, const PipelineAction& a);
  void open_connections();       // every pair of neighbours, both ways at once, before any schedule runs
  void send_tied_weight();       // first stage → last, before the step's first forward
  void receive_tied_gradient();  // last stage → first: the first stage's, before its last backward
  void send_tied_gradient();     // the last stage's, after its step's last action
  void add_tied_gradient();      // the last stage's, after each backward of the head (a wider gradient dtype)

  Model& model_;
  UnitRunner& runner_;
  ZeroDataParallel& zero_;
  Communicator& pipeline_;
  std::vector<UnitRange> chunks_;  // pipeline numbering
  std::vector<UnitRange> local_;   // the same chunks in ZeRO's (kept) unit numbering
  PipelineOptions options_;
  std::vector<PendingCollective> sends_;  // waited for at the end of the step
  torch::Tensor tied_gradient_sum_;        // the last stage's head gradient of the tied weight, in gradient_dtype (a wider one only)
  bool warned_dtype_ = false;
};

}  // namespace dsrun
