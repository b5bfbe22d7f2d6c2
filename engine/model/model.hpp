// What every trainable model offers the engine: its parameters grouped in units (the granularity of
// ZeRO-3 gathering and of activation checkpointing) and logits for one micro-batch. Models know
// nothing of ranks; parallelism reaches in only through the UnitRunner their forward calls.
#pragma once

#include "engine/common/error.hpp"
#include "engine/model/linear_cross_entropy.hpp"
#include "engine/recipe/model_spec.hpp"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dsrun {

using Tensors = std::vector<torch::Tensor>;
// A unit's computation: tensors in, tensors out (a block maps {x, aux loss} to {x', aux loss'}).
// It must be a pure function of its inputs and the unit's parameters: checkpointing calls it twice.
using UnitFn = std::function<Tensors(const Tensors&)>;
// Runs some of a MoE layer's routed experts: `rows` grouped expert by expert, counts[j] rows for
// the j-th of them ([experts] int64 on the rows' device); returns each row's output in the same order.
using ExpertsFn = std::function<torch::Tensor(const torch::Tensor& rows, const torch::Tensor& counts)>;
// A MoE layer's (token, choice) pairs as the runner takes them, grouped by expert: `token` [P]
// int64, the row of `tokens` [T, H] each pair reads; `rows()` makes the pairs' rows [P, H] (with
// the layer's deterministic backward). An exchange that sends each token once per rank reads
// tokens and token; otherwise rows() is called once.
struct RoutedPairs {
  torch::Tensor tokens, token;
  int64_t choices = 1;  // the layer's top_k: at most this many pairs read one token
  std::function<torch::Tensor()> rows;
};

// The seam through which parallelism reaches into a model. run() runs one unit's computation:
// the default just calls it; ZeRO-3 gathers the unit's parameters around it, activation
// checkpointing recomputes it in backward. The region marks say where a layer's weights may be
// split over tensor-parallel ranks (Megatron-LM's f and g); on one rank they are identities.
class UnitRunner {
 public:
  virtual ~UnitRunner() = default;
  virtual Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) { return fn(inputs); }
  // Into column-parallel layers (q/k/v, gate/up, the output head): the same input on every rank.
  virtual torch::Tensor enter_split(const torch::Tensor& x) { return x; }
  // Out of row-parallel layers (attention output, down): partial sums become the whole output.
  virtual torch::Tensor leave_split(const torch::Tensor& partial) { return partial; }
  // Whether enter_split and leave_split pass tensors through as they are (no tensor parallelism):
  // then a row-parallel layer may add its output straight into the residual stream.
  virtual bool splits_nothing() const { return true; }
  // A lookup in an embedding whose rows (the vocabulary) may be split.
  virtual torch::Tensor embedding(const torch::Tensor& weight, const torch::Tensor& ids) { return torch::embedding(weight, ids); }
  // The output projection and the mean token cross-entropy in one, chunk_tokens tokens at a time
  // (linear_cross_entropy.hpp): hidden [N, H] as it enters the split region, weight [V, H] (this
  // rank's rows of the vocabulary under tensor parallelism), targets [N]. An fp32 scalar.
  // gradients_in_forward: ExecutionModes::loss_gradients_in_forward.
  virtual torch::Tensor projected_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets, int64_t chunk_tokens,
                                       bool gradients_in_forward) {
    LinearCrossEntropyOptions o;
    o.chunk_tokens = chunk_tokens;
    o.gradient_in_forward = gradients_in_forward;
    return linear_cross_entropy(hidden, weight, targets, o);
  }
  // Routed experts: `pairs` are every (token, choice) pair of a MoE layer, grouped by expert,
  // counts[e] for expert e of all the layer's ([experts] int64 on the device: here they stay
  // there); returns the pairs' outputs in that order. `local` runs the experts this rank keeps
  // (Model::keep_experts): all of them here; under expert parallelism the rows travel to the ranks
  // that keep theirs and back, which needs the counts on the host once. `meanwhile` is work of the
  // layer's own that needs no routed output (the shared experts): called once, while the rows travel.
  virtual torch::Tensor routed_experts(const RoutedPairs& pairs, const torch::Tensor& counts, const ExpertsFn& local, const std::function<void()>& meanwhile) {
    meanwhile();
    return local(pairs.rows(), counts);
  }
  // One MoE layer's routing in one forward: pairs routed to each expert (before any capacity,
  // [experts] int64) and pairs the capacity dropped. For metrics; recomputation does not repeat it.
  virtual void record_routing(int layer, const torch::Tensor& routed, int64_t dropped) {}
  // Causal attention over whole sequences of which this rank holds the tokens at `places` [s]
  // (Batch::places): q [b, s, heads, d], k [b, s, kv_heads, d], v [b, s, kv_heads, dv], heads a
  // multiple of kv_heads; returns [b, s, heads, dv]. Only a runner that splits sequences over
  // ranks (context parallelism) is given such batches: it gathers the other ranks' keys and values.
  virtual torch::Tensor split_sequence_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& places);
  // A statistic over whole sequences (a MoE router's balance counts and scores), summed over the
  // ranks that hold their parts; differentiable. Here every rank holds whole sequences: `part`.
  virtual torch::Tensor sum_over_sequences(const torch::Tensor& part) { return part; }
};

// How tensor parallelism may split a parameter (Megatron-LM's terms): the rows of a column-parallel
// weight (its outputs), the columns of a row-parallel weight (its inputs), or not at all. A fused
// weight lists its parts' row counts in `segments`: each rank takes its slice of every part, so
// that a rank's rows of a fused q/k/v projection are whole heads of q, k and v.
struct TensorSplit {
  enum Kind { Replicated, Rows, Columns };
  Kind kind = Replicated;
  std::vector<int64_t> segments;  // Rows: the parts' sizes along dim 0 (empty: `equal_parts` parts)
  int equal_parts = 1;            // Rows without segments: this many parts of equal size (gate and up)
};

struct ParameterUnit {
  std::string name;                  // "embedding", "block 3", "head"
  std::vector<torch::Tensor> params;  // leaf tensors owned by the model
  bool checkpointable = false;       // a transformer block or residual block
  // Every parameter gets a gradient in every backward (false for MoE blocks, whose experts may see
  // no token): only then may data parallelism reduce the unit as soon as autograd is done with it.
  bool always_gets_gradients = true;
  std::vector<std::string> names;    // the parameters' names in the model, for initialize_parameter
  std::vector<TensorSplit> splits;   // per parameter; empty: all replicated
  // Routed experts kept apart (Model::keep_experts): the unit whose computation reads them, listed
  // before it; data parallelism gathers and recomputes them with that unit and reduces them over
  // the ranks that keep the same experts. -1: an ordinary unit.
  int experts_of = -1;
};

struct Batch {
  torch::Tensor inputs;   // token ids [b, s] (int64) or images [b, c, h, w]
  torch::Tensor targets;  // next tokens [b, s] or labels [b]
  int64_t items = 0;      // tokens (decoders) or images in the batch
  // Decoders with data.separate_documents: each token's position within its document [b, s]
  // (int64) and its document's number within the row [b, s] (int32). Undefined: one document.
  torch::Tensor positions, documents;
  // Context parallelism: where this rank's tokens lie in the whole sequence, in the order it holds
  // them [s] (int64, the same for every row; engine/parallel/context_parallel.hpp). Undefined: the
  // rank holds whole sequences, places 0..s-1.
  torch::Tensor places;
  // Images: each sample's index in the training stream [b] (int64, CPU), the key of its augmentation.
  torch::Tensor sample_ids;
};

// What a model computes; the loss is the trainer's (engine/train/loss.hpp), except where the model
// fuses its output projection with the token cross-entropy (ModelBuild::loss_chunk_tokens).
struct ModelOutput {
  // Decoders: [b, s, vocab] (with tensor parallelism, this rank's slice of the vocabulary);
  // images: [b, classes]. In the compute dtype. Undefined where `loss` is given instead.
  torch::Tensor logits;
  torch::Tensor loss;       // the mean token cross-entropy (fp32 scalar), computed without whole logits
  // Added to the loss, an fp32 scalar: MoE balance losses and the MTP modules' weighted loss
  // (model.mtp); undefined for dense models without MTP.
  torch::Tensor aux_loss;
  // For reporting only: the MTP modules' mean cross-entropy, unweighted and detached (model.mtp;
  // undefined without MTP, and on pipeline stages without the head).
  torch::Tensor mtp_loss;
};

// One micro-batch's loss as the trainer computes it from a ModelOutput (engine/train/loss.hpp);
// the pipeline carries it between stages, so it belongs to the model's contract.
struct MicroBatchLoss {
  torch::Tensor loss;     // what backward starts from: the mean over the batch, aux loss included
  double task_loss = 0;   // cross-entropy alone, for reporting
  double aux_loss = 0;    // MoE balance and the weighted MTP loss (0 for dense models without MTP)
  double mtp_loss = 0;    // the MTP modules' mean cross-entropy, unweighted (0 without MTP)
  // Unread (micro_batch_loss's read_now false): the two as fp32 scalars where they were computed
  // (aux undefined for dense models), for the caller to read once per step: reading them between
  // forward and backward would stop the host until the device caught up.
  torch::Tensor task_value, aux_value, mtp_value;
  int64_t correct = -1;   // images: correct predictions; -1 where it does not apply
};

// Consecutive units of a model's pipeline numbering (the embedding, each block, the head), [begin, end).
struct UnitRange {
  int begin = 0, end = 0;
  int size() const { return end - begin; }
};

// Tied embeddings cut by the pipeline: the first stage's embedding weight (a parameter), and on the
// stage with the head the tensor it reads in its place, which the pipeline fills from the first
// stage every step and whose gradient it sends back there (Megatron-LM keeps a second parameter).
struct TiedEmbedding {
  torch::Tensor weight;     // the embedding's parameter, where the embedding is kept
  torch::Tensor head_copy;  // where the head is kept without the embedding: a leaf requiring grad
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::vector<ParameterUnit> parameter_units() = 0;
  virtual ModelOutput forward(const Batch& batch, UnitRunner& runner) = 0;
  virtual torch::nn::Module& module() = 0;

  // Pipeline parallelism. The units in pipeline numbering (0: the model cannot be pipelined): like
  // parameter_units(), except that tied embeddings get a unit of their own, apart from the head.
  virtual int pipeline_unit_count() const { return 0; }
  // Keep only these ranges (this rank's chunks, in order): parameter_units() lists their units
  // alone, in that order, and the other units' parameters are dropped.
  virtual void keep_only(const std::vector<UnitRange>& chunks) { DSRUN_ASSERT(false, "this model cannot be pipelined"); }
  // Runs kept chunk `chunk` on the state the unit before it produced ({} before the embedding).
  // Returns {x, aux loss} after a block (the state the next chunk takes), {logits, aux loss} after
  // the head ({loss, aux loss} where computes_loss()); the aux loss is an fp32 scalar (0 for dense models).
  virtual Tensors forward_chunk(int chunk, const Batch& batch, const Tensors& state, UnitRunner& runner) {
    DSRUN_ASSERT(false, "this model cannot be pipelined");
    return {};
  }
  virtual TiedEmbedding tied_embedding() { return {}; }
  // Whether forward gives the token cross-entropy (ModelOutput::loss) rather than logits.
  virtual bool computes_loss() const { return false; }
  // The MTP modules' mean cross-entropy of the latest forward, detached (undefined without MTP).
  virtual torch::Tensor last_mtp_loss() const { return {}; }
  // Expert parallelism: keep shard `shard` of `shards` of every MoE layer's routed experts (the
  // others' parameters are dropped). parameter_units() then lists each layer's kept experts as a
  // unit of its own (experts_of), after all the others.
  virtual void keep_experts(int shard, int shards) { DSRUN_ASSERT(shards == 1, "this model has no routed experts"); }
  // MoE balance by bias (model.moe.balance = "bias"): moves MoE layer `layer`'s selection bias
  // toward even loads; `loads` are the pairs routed to each expert this step, summed over every
  // rank that routes ([experts]). Every rank calls it with the same loads and keeps the same bias.
  virtual void balance_experts(int layer, const torch::Tensor& loads, double rate) {}
  // Deferred: the parameters have shapes but no values (never written, so no resident memory);
  // ZeRO builds each unit from initialize_parameter.
  virtual bool deferred() const { return false; }
  // Writes parameter `name`'s initial values into `values` (fp32, on the CPU, its shape). Only
  // models that can be built deferred need it.
  virtual void initialize_parameter(const std::string& name, torch::Tensor& values) const {
    DSRUN_ASSERT(false, "this model is never built deferred (" + name + ")");
  }
};

struct ModelBuild {
  uint64_t seed = 0;      // the run's seed: the initial weights are a function of it alone
  bool deferred = false;  // parameters without values, materialised unit by unit by ZeRO
  // Decoders: > 0 fuses the output projection with the cross-entropy, this many tokens' logits at
  // a time (batch.loss_chunk_tokens); 0 returns the whole logits for the trainer's loss.
  int64_t loss_chunk_tokens = 0;
  // The execution modes the model runs (ExecutionModes, decided by the plan): the fused loss's
  // gradients made in forward, and attention within documents by the variable-length kernel.
  bool loss_gradients_in_forward = true;
  bool variable_length_attention = false;
  Fp8Scaling fp8 = Fp8Scaling::None;  // precision.fp8: the blocks' linear layers' products
  bool fp8_routed_experts = false;    // and the routed experts' grouped products (execution.fp8_routed_experts)
};

// Builds the recipe's model in fp32 on the CPU (DeepSeek deferred: no memory until ZeRO builds
// each unit, so no rank ever holds the whole model in fp32). ResNet is always built whole.
std::unique_ptr<Model> build_model(const ModelSpec& spec, int64_t seq_len, const ModelBuild& build);

}  // namespace dsrun
