#include "engine/model/linear_cross_entropy.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/model/fused_ops.hpp"

#include <algorithm>
#include <cmath>

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// The chunks [begin, begin + rows) of n tokens.
template <class Each>
void for_each_chunk(int64_t n, int64_t chunk, Each&& each) {
  for (int64_t begin = 0; begin < n; begin += chunk) each(begin, std::min(chunk, n - begin));
}

// Where each token's target lies in this rank's vocabulary slice (rows rank · V/t of the whole,
// `group` null or of one rank: all of it): its column (clamped) and whether it is here.
struct LocalTargets {
  Tensor column, here;
  LocalTargets(const Tensor& targets, const VocabularyGroup* group, int64_t local_vocab) {
    const Tensor local = group && group->size() > 1 ? targets - group->rank() * local_vocab : targets;
    here = local.ge(0).logical_and(local.lt(local_vocab));
    column = local.clamp(0, local_vocab - 1);
  }
};

// One chunk's share of the gradients from the gradient g of its logits: the hidden states' rows
// `dh` written, the weight's summed into the fp32 `d_weight` (written by the first chunk: no zero fill).
void add_chunk_gradients(const Tensor& g, const Tensor& h, const Tensor& weight, Tensor dh, Tensor& d_weight, bool first) {
  at::mm_out(dh, g, weight);
  compat::addmm_fp32(d_weight, g.t(), h, 1.0, first ? 0.0 : 1.0);
}

// The fp32 weight gradient the chunks of n tokens write: uninitialised, since the first chunk
// writes it whole, unless there is no chunk.
Tensor head_gradient(const Tensor& weight, int64_t n) {
  const auto fp32 = weight.options().dtype(torch::kFloat32);
  return n > 0 ? torch::empty(weight.sizes(), fp32) : torch::zeros(weight.sizes(), fp32);
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight, const Tensor& targets, int64_t chunk,
                        int64_t group_address, bool wants_grad, bool gradient_in_forward) {
    VocabularyGroup* group = pointer_from_argument<VocabularyGroup>(group_address);
    const int64_t n = hidden.size(0), local_vocab = weight.size(0);
    const int ranks = group ? group->size() : 1;
    const LocalTargets t(targets, group, local_vocab);
    // (The plan's rule: ExecutionModes::loss_gradients_in_forward, engine/recipe/execution_modes.cpp.)
    const bool eager = wants_grad && gradient_in_forward && ranks == 1 && hidden.scalar_type() != torch::kFloat16;
    const Tensor w_t = weight.t();
    const auto fp32 = hidden.options().dtype(torch::kFloat32);

    Tensor lse = torch::empty({n}, fp32), target_logit = torch::empty({n}, fp32);
    Tensor d_hidden, d_weight;  // eager: the gradients for a loss gradient of 1
    if (eager) {
      d_hidden = torch::empty_like(hidden);
      d_weight = head_gradient(weight, n);
    }
    Tensor local_max, local_sum;  // several ranks: each row's maximum and sum of exp(z - maximum) over this slice
    if (ranks > 1) {
      local_max = torch::empty({n}, fp32);
      local_sum = torch::empty({n}, fp32);
    }
    for_each_chunk(n, chunk, [&](int64_t begin, int64_t rows) {
      const Tensor h = hidden.narrow(0, begin, rows);
      const Tensor column = t.column.narrow(0, begin, rows), here = t.here.narrow(0, begin, rows);
      Tensor z = compat::mm_fp32(h, w_t);  // [rows, V/t] fp32
      if (eager) {  // the log-sum-exp, the target's logit and the gradient in one pass over z
        const Tensor g = fused::cross_entropy_rows(z, column, here, 1.0 / static_cast<double>(n), hidden.scalar_type(), lse.narrow(0, begin, rows),
                                                   target_logit.narrow(0, begin, rows));
        add_chunk_gradients(g, h, weight, d_hidden.narrow(0, begin, rows), d_weight, begin == 0);
        return;
      }
      target_logit.narrow(0, begin, rows).copy_(z.gather(1, column.unsqueeze(1)).squeeze(1).mul_(here));
      if (ranks > 1) {
        Tensor m = std::get<0>(z.max(1));
        local_max.narrow(0, begin, rows).copy_(m);
        local_sum.narrow(0, begin, rows).copy_(z.sub_(m.unsqueeze(1)).exp_().sum(1));
        return;
      }
      lse.narrow(0, begin, rows).copy_(fused::row_logsumexp(z));
    });
    if (ranks > 1) {  // log Σ exp over the whole vocabulary, and the target's logit from the rank that has it
      Tensor maxima = torch::empty({ranks * n}, fp32);
      group->all_gather(local_max, maxima);
      const Tensor global_max = std::get<0>(maxima.view({ranks, n}).max(0));
      Tensor sums = local_sum.mul_((local_max - global_max).exp_());
      group->all_reduce_sum(sums);
      group->all_reduce_sum(target_logit);
      lse = sums.log_().add_(global_max);
    }
    ctx->saved_data["eager"] = eager;
    ctx->saved_data["chunk"] = chunk;
    save_pointer(ctx, "group", group);
    if (eager) ctx->save_for_backward({d_hidden, d_weight.to(weight.scalar_type())});
    else if (wants_grad) ctx->save_for_backward({hidden, weight, targets, lse});
    return (lse - target_logit).mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& scale = grads[0];  // d(anything)/d(loss): 1, a loss scale, a pipeline's micro-batch weight
    if (ctx->saved_data["eager"].toBool()) {  // scaled in place: nothing else reads them
      Tensor d_hidden = saved[0], d_weight = saved[1];
      fused::scale_(d_hidden, scale);
      fused::scale_(d_weight, scale);
      return {d_hidden, d_weight, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const Tensor &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3];
    VocabularyGroup* group = saved_pointer<VocabularyGroup>(ctx, "group");
    const int64_t n = hidden.size(0), local_vocab = weight.size(0);
    const LocalTargets t(targets, group, local_vocab);
    Tensor d_hidden = torch::empty_like(hidden);
    Tensor d_weight = head_gradient(weight, n);
    // The loss scale multiplies each chunk's gradient in fp32, before it is rounded to the compute dtype.
    for_each_chunk(n, ctx->saved_data["chunk"].toInt(), [&](int64_t begin, int64_t rows) {
      const Tensor h = hidden.narrow(0, begin, rows);
      Tensor z = compat::mm_fp32(h, weight.t());
      const Tensor g = fused::softmax_gradient(z, lse.narrow(0, begin, rows), t.column.narrow(0, begin, rows), t.here.narrow(0, begin, rows),
                                               1.0 / static_cast<double>(n), scale, h.scalar_type());
      add_chunk_gradients(g, h, weight, d_hidden.narrow(0, begin, rows), d_weight, begin == 0);
    });
    return {d_hidden, d_weight.to(weight.scalar_type()), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& targets, const LinearCrossEntropyOptions& options) {
  DSRUN_ASSERT(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), "linear_cross_entropy takes hidden [N, H] and weight [V, H]");
  DSRUN_ASSERT(targets.dim() == 1 && targets.size(0) == hidden.size(0), "linear_cross_entropy takes one target per token");
  DSRUN_ASSERT(options.chunk_tokens > 0, "linear_cross_entropy needs a positive chunk");
  // (Inside forward autograd is off: whether a gradient will be asked for is read here.)
  const bool wants_grad = torch::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return LinearCrossEntropyFunction::apply(hidden, weight, targets.to(hidden.device(), torch::kInt64), options.chunk_tokens,
                                           pointer_argument(options.group), wants_grad, options.gradient_in_forward);
}

}  // namespace dsrun
