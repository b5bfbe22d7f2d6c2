// Activation checkpointing, step 4 of parallelize: units the model marks checkpointable run
// without keeping their activations and run again, with gradients, when backward reaches them.
#pragma once

#include "engine/model/model.hpp"

#include <memory>
#include <vector>

namespace dsrun {

// Runs fn on inputs (one or two tensors: a block's activations and its running balance loss)
// with activations recomputed in backward. The autograd node keeps fn until that backward.
Tensors run_recomputed(std::shared_ptr<UnitFn> fn, const Tensors& inputs);

// True while this thread runs a unit again for backward (what a forward records, it has recorded).
bool recomputing();

// Which units recompute: the model's checkpointable ones when `enabled` (the plan's
// layout.recomputation), none otherwise.
class Recomputation {
 public:
  Recomputation() = default;
  Recomputation(Model& model, bool enabled);
  // fn on inputs, through run_recomputed where the unit recomputes and gradients are on.
  Tensors run(int unit, const UnitFn& fn, const Tensors& inputs) const;

 private:
  std::vector<bool> recomputed_;  // by unit
};

}  // namespace dsrun
