// What every trainable model offers the engine: its parameters grouped in units (the granularity of
// ZeRO-3 gathering and of activation checkpointing) and a loss for one micro-batch. Models know
// nothing of ranks; parallelism reaches in only through the UnitRunner their forward calls.
#pragma once

#include "engine/common/error.hpp"
#include "engine/recipe/recipe.hpp"

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

// Runs one unit's computation. The default just calls it; ZeRO-3 gathers the unit's parameters
// around it, activation checkpointing recomputes it in backward.
class UnitRunner {
 public:
  virtual ~UnitRunner() = default;
  virtual Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) { return fn(inputs); }
};

struct ParameterUnit {
  std::string name;                  // "embedding", "block 3", "head"
  std::vector<torch::Tensor> params;  // leaf tensors owned by the model
  bool checkpointable = false;       // a transformer block or residual block
  // Every parameter gets a gradient in every backward (false for MoE blocks, whose experts may see
  // no token): only then may data parallelism reduce the unit as soon as autograd is done with it.
  bool always_gets_gradients = true;
  std::vector<std::string> names;    // the parameters' names in the model, for initialize_parameter
};

struct Batch {
  torch::Tensor inputs;   // token ids [b, s] (int64) or images [b, c, h, w]
  torch::Tensor targets;  // next tokens [b, s] or labels [b]
  int64_t items = 0;      // tokens (decoders) or images in the batch
  // Decoders with data.separate_documents: each token's position within its document [b, s]
  // (int64) and its document's number within the row [b, s] (int32). Undefined: one document.
  torch::Tensor positions, documents;
  // Images: each sample's index in the training stream [b] (int64, CPU), the key of its augmentation.
  torch::Tensor sample_ids;
};

struct ModelOutput {
  torch::Tensor loss;       // mean over the batch, what backward starts from (aux losses included)
  double task_loss = 0;     // cross-entropy alone, for reporting
  double aux_loss = 0;      // MoE load balance (0 for dense models)
  int64_t correct = -1;     // images: correct predictions; -1 where it does not apply
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::vector<ParameterUnit> parameter_units() = 0;
  virtual ModelOutput forward(const Batch& batch, UnitRunner& runner) = 0;
  virtual torch::nn::Module& module() = 0;
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
};

// Builds the recipe's model in fp32 on the CPU (DeepSeek deferred: no memory until ZeRO builds
// each unit, so no rank ever holds the whole model in fp32). ResNet is always built whole.
std::unique_ptr<Model> build_model(const ModelSpec& spec, int64_t seq_len, const ModelBuild& build);

}  // namespace dsrun
