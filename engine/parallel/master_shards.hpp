// ZeRO's master shards: the fp32 master weights this rank updates, and each step's gradient for
// them in the one form the step reads; the norm, clipping, unscaling and overflow checks over them.
#pragma once

#include "engine/parallel/flat_units.hpp"
#include "engine/parallel/host_buffers.hpp"
#include "engine/parallel/zero_options.hpp"

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace dsrun {

// How a step's gradient reaches the optimizer. The averaged gradient is always
// grad · grad_scale · clip_scale (÷ clip_divisor where clipping was decided on the device).
enum class GradientForm {
  None,     // no gradient taken since the last step
  Fp32,     // `grad` in fp32 on the master's device, the factors applied (both 1)
  Reduced,  // `grad` as reduced (working dtype; fp32 for libtorch's fused Adam), the step applies
            // the factors as it reads it: host masters, and ZeroOptions::step_applies_scales
  Pieces,   // ZeroOptions::gradients_left_to_autograd: `grad_pieces`, each parameter's gradient
            // where autograd left it; the step applies the factors
};

// The part of the flat parameter space one rank updates: fp32 master weights, their gradient,
// and which elements get weight decay (matrices do; norms and biases do not).
struct MasterShard {
  torch::Tensor master;  // fp32, updated in place by the optimizer
  GradientForm form = GradientForm::None;
  torch::Tensor grad;  // GradientForm::Fp32 and Reduced
  // GradientForm::Pieces: each parameter's gradient (contiguous, flattened) with its offset
  // within master, in parameter order.
  std::vector<std::pair<int64_t, torch::Tensor>> grad_pieces;
  double grad_scale = 1, clip_scale = 1;
  // Undefined, or a scalar fp32 tensor on the master's device that the step divides the gradient
  // by as well: clipping decided on the device (MasterShards::clip_on_device), no host read.
  torch::Tensor clip_divisor;
  torch::Tensor grad_sq;  // Σ (g · grad_scale)² as an fp64 scalar, taken where the gradient was reduced (undefined: not taken)
  // Host masters: where the host step writes the working parameters (the rank's slice): the slice
  // itself when it is in host memory, else a pinned upload buffer that goes up after the step.
  // Device masters: their slice with ZeroOptions::step_reads_working_gradient, else undefined.
  torch::Tensor param_out;
  bool params_written = false;
  // Offload: the gradient shard comes down into this host buffer (pinned on GPU ranks), so that
  // the host step can read it while the next step's gradients accumulate. The delayed update has
  // two, swapped every step: one read by the host step, one filled by the backward under way.
  torch::Tensor grad_staging, grad_staging_spare;
  std::vector<std::pair<int64_t, int64_t>> decay_ranges;  // [begin, end) within master (FlatUnitLayout)
  // The gradient as fp32 with its factors applied (norms, overflow checks, tests).
  torch::Tensor scaled_grad() const;
  // grad, or grad_pieces laid out as one flat tensor (for the paths that read it whole).
  torch::Tensor flat_grad() const;
};

// Σ (g · scale)² as an fp64 scalar where g is. On CPUs with exactly the roundings of
// MasterShard::scaled_grad (offloaded runs follow the others bitwise); on GPUs the norm kernel
// reads the working dtype, so no fp32 copy of the shard is made.
torch::Tensor squared_norm(const torch::Tensor& g, double scale);

class MasterShards {
 public:
  MasterShards(const FlatUnits& units, Communicator& data_group, const ZeroOptions& options) : units_(units), data_group_(data_group), options_(options) {}

  // Unit u's master from its fp32 values (offload: in host memory, with its staging buffers).
  void add(const FlatUnit& u, const torch::Tensor& flat32, HostBuffers& host);

  // The step's gradient of unit k, reduced over its group (summed, not yet averaged), in the form
  // the step reads (GradientForm); `came_down`: offload already put it in grad_staging, its norm taken.
  void take_reduced(size_t k, const torch::Tensor& reduced, bool came_down);
  // ZeroOptions::gradients_left_to_autograd: the parameters' gradients as autograd left them.
  void take_autograd_gradients(size_t k);

  // The squares behind the gradients' norm over the data ranks, apart for the parameters the
  // model marks as split by tensor parallelism and those it replicates (without
  // ZeroOptions::separate_replicated_norm all count as split): a [split, replicated] fp64 tensor
  // where the gradients are. Routed experts count as split, every expert once.
  torch::Tensor gradient_squares();
  double global_norm();
  // Global-norm clipping decided on the device: every step divides its gradient by
  // max(1, (norm + 1e-6) / max_norm) where norm > max_norm, norm a scalar tensor on the masters' device.
  void clip_on_device(const torch::Tensor& norm, double max_norm);
  void scale_gradients(double factor);
  // 1 where any of this rank's gradients has an inf or NaN, else 0: a float64 scalar on the
  // gradients' device, not read, so the check costs the host one read after the all-reduce.
  torch::Tensor nonfinite_flag() const;
  // After the step: the gradients and their factors are gone.
  void clear_gradients();

  double master_bytes() const;
  size_t size() const { return shards_.size(); }
  MasterShard& operator[](size_t k) { return shards_.at(k); }
  std::vector<MasterShard>& all() { return shards_; }

 private:
  const FlatUnits& units_;
  Communicator& data_group_;
  ZeroOptions options_;
  std::vector<MasterShard> shards_;
};

}  // namespace dsrun
