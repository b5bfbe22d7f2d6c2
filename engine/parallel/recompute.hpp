// Activation checkpointing: the CheckpointedUnit autograd function, which runs a unit without
// keeping its activations and runs it again, with gradients, when backward reaches it.
#pragma once

#include "engine/model/model.hpp"

#include <memory>

namespace dsrun {

// Runs fn on inputs (one or two tensors: a block's activations and its running balance loss)
// with activations recomputed in backward. Autograd keeps only fn's address: the caller keeps fn
// alive until that backward has run.
Tensors run_recomputed(const std::shared_ptr<UnitFn>& fn, const Tensors& inputs);

// True while this thread runs a unit again for backward (what a forward records, it has recorded).
bool recomputing();

}  // namespace dsrun
